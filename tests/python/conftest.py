"""Shared helpers: devices, a small model, and side-by-side training of two optimizers."""
import copy

import pytest

torch = pytest.importorskip("torch")

HAS_CUDA = torch.cuda.is_available()

# A test's one-line summary for the end of the run (e.g. "optim_db Adam on cpu: 40 configurations, 40
# passed"): `record_property(SUMMARY, text)`. pytest_terminal_summary below prints them all after the
# progress dots and the -rs lines, in the order the tests ran, so they never break up the progress.
SUMMARY = "summary"
_summaries = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _summaries.extend(v for k, v in report.user_properties if k == SUMMARY)


def pytest_terminal_summary(terminalreporter):
    if _summaries:
        terminalreporter.section("summaries")
        for text in _summaries:
            terminalreporter.write_line(text)


NO_CUDA_REASON = "CUDA is not available here (torch.cuda.is_available() is False): CUDA cases need a GPU"


def _device_params():
    out = [pytest.param("cpu", id="cpu")]
    out.append(pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)))
    return out


DEVICES = _device_params()


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def make_model(device, dtype=torch.float32, seed=0):
    """A 2-layer MLP with biases (4 parameter tensors)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
    return model.to(device=device, dtype=dtype)


def batch(step, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 12, generator=g)
    y = torch.randn(16, 5, generator=g)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def loss_of(model, step, device, dtype):
    x, y = batch(step, device, dtype)
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def train(model, opt, steps, device, dtype=torch.float32, start=0, scheduler=None):
    losses = []
    for s in range(start, start + steps):
        opt.zero_grad()
        loss = loss_of(model, s, device, dtype)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def rel_diff(model_a, model_b):
    """max |p_a - p_b| / max |p_b| over all parameters (errors relative to the parameter scale)."""
    num = max((a.detach().float() - b.detach().float()).abs().max().item()
              for a, b in zip(model_a.parameters(), model_b.parameters()))
    den = max(b.detach().float().abs().max().item() for b in model_b.parameters())
    return num / den


def twin(model):
    return copy.deepcopy(model)
