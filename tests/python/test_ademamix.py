"""optfuse.torch.AdEMAMix against the paper's Algorithm 1 (Pagliardini, Ablin, Grangier 2024, "The
AdEMAMix Optimizer: Better, Faster, Older"), written below in plain torch with the warm-up
schedulers of the paper's appendix, in the arguments and state keys of its reference
implementation (apple/ml-ademamix): 10 steps with new gradients every step.

Tolerances (max |p_ours - p_ref| / max |p_ref| over the parameters):
- against the float32 reference, F32_TOL = 1e-6: both do the same float32 operations in the same
  order (moments as mul + add, bias corrections and schedules in float64 and rounded once to
  float32 where they meet tensors, as torch rounds a Python scalar); what is left is torch's CPU
  kernels fusing a multiply-add (add_(x, alpha=a) is one fma) where optfuse rounds twice, a few
  float32 ulps of the update per step, i.e. ~1e-7 of the parameter scale after 10 steps. The same
  bound as the other drop-ins (docs/python.md), 2e-6 on CUDA (torch's kernels contract more).
- against the float64 reference, F64_TOL = 2e-6: the float32 rounding of the three moments and the
  parameter itself (~6e-8 relative per operation) over 10 steps at lr 1e-2.
Measured on CPU: at most 1.9e-7 against the float32 reference and
2.6e-7 against the float64 one over CONFIGS (the float32 reference itself is 2.6e-7 from float64).
"""
import copy
import math

import pytest
import torch

import optfuse.torch as oft
from conftest import DEVICES, make_model, rel_diff, train, twin

STEPS = 10
F32_TOL = 1e-6
CUDA_F32_TOL = 2e-6
F64_TOL = 2e-6


def alpha_at(step, alpha, warmup):
    """alpha_t: linear from 0 to alpha over `warmup` steps (None: no warm-up)."""
    if warmup is not None and step < warmup:
        return step / float(warmup) * alpha
    return alpha


def beta3_at(step, beta1, beta3, warmup):
    """beta3_t: from beta1 to beta3 over `warmup` steps, linear in the half-life of the EMA."""
    if warmup is None or step >= warmup:
        return beta3

    def half_life(b):  # steps for b^t to reach 1/2, less one (1e-8 keeps b = 0 finite)
        return math.log(0.5) / math.log(b + 1e-8) - 1

    a = step / float(warmup)
    return 0.5 ** (1 / ((1 - a) * half_life(beta1) + a * half_life(beta3) + 1))


class AdEMAMixAlgorithm1(torch.optim.Optimizer):
    """Algorithm 1 of the paper, one parameter at a time, in the parameter's dtype."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=2.0, beta3_warmup=None,
                 alpha_warmup=None, eps=1e-8, weight_decay=0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), alpha=alpha, beta3_warmup=beta3_warmup,
                                      alpha_warmup=alpha_warmup, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2, b3 = group["betas"]
            lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg_fast"] = torch.zeros_like(p)
                    st["exp_avg_slow"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] = int(st["step"]) + 1
                t = st["step"]
                g = p.grad
                a_t = alpha_at(t, group["alpha"], group["alpha_warmup"])
                b3_t = beta3_at(t, b1, b3, group["beta3_warmup"])
                m1, m2, nu = st["exp_avg_fast"], st["exp_avg_slow"], st["exp_avg_sq"]
                m1.mul_(b1).add_(g, alpha=1 - b1)
                m2.mul_(b3_t).add_(g, alpha=1 - b3_t)
                nu.mul_(b2).addcmul_(g, g, value=1 - b2)
                m1_hat = m1 / (1 - b1 ** t)
                denom = nu.sqrt() / math.sqrt(1 - b2 ** t) + eps
                update = (m1_hat + a_t * m2) / denom
                # weight decay joins the update before lr scales it (Algorithm 1, last line)
                update = update + wd * p
                p.add_(-lr * update)


def _pair(device):
    a = make_model(device)
    return a, twin(a)


def _tol(device):
    return CUDA_F32_TOL if torch.device(device).type == "cuda" else F32_TOL


CONFIGS = [
    dict(lr=1e-2),
    dict(lr=1e-2, t_alpha_beta3=5),
    dict(lr=1e-2, betas=(0.8, 0.95, 0.999), alpha=5.0, alpha_warmup=4, beta3_warmup=8, eps=1e-6),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=1e-2, weight_decay=0.1, t_alpha_beta3=6, alpha=8.0),
    dict(lr=1e-2, betas=(0.0, 0.999, 0.9999)),  # b1 = 0: the reference keeps no fast EMA (m1 = g)
]


def _ref_kwargs(kw):
    kw = dict(kw)
    t = kw.pop("t_alpha_beta3", None)
    if t is not None:
        kw["alpha_warmup"] = kw["beta3_warmup"] = t
    return kw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_matches_algorithm1_float32(device, kw):
    a, b = _pair(device)
    ours = oft.AdEMAMix(a.parameters(), **kw)
    ref = AdEMAMixAlgorithm1(b.parameters(), **_ref_kwargs(kw))
    train(a, ours, STEPS, device)
    train(b, ref, STEPS, device)
    d = rel_diff(a, b)
    assert d <= _tol(device), f"{kw}: {d:.3g}"
    # the moments too (relative to each one's scale); state_dict() writes the step counts
    ours.state_dict()
    for pa, pb in zip(a.parameters(), b.parameters()):
        for k in ("exp_avg_fast", "exp_avg_slow", "exp_avg_sq"):
            x, y = ours.state[pa][k], ref.state[pb][k]
            assert (x - y).abs().max().item() <= 4 * _tol(device) * y.abs().max().item() + 1e-30, k
        assert int(ours.state[pa]["step"]) == ref.state[pb]["step"] == STEPS


@pytest.mark.parametrize("kw", [CONFIGS[0], CONFIGS[4]], ids=["plain", "warmup_wd"])
def test_close_to_float64_algorithm(kw):
    a = make_model("cpu")
    b = make_model("cpu", dtype=torch.float64)
    ours = oft.AdEMAMix(a.parameters(), **kw)
    ref = AdEMAMixAlgorithm1(b.parameters(), **_ref_kwargs(kw))
    train(a, ours, STEPS, "cpu")
    train(b, ref, STEPS, "cpu", dtype=torch.float64)
    d = rel_diff(a, b)
    assert d <= F64_TOL, d


def test_warmup_changes_the_trajectory():
    """The warm-ups do something (a test of the test: a no-op scheduler would pass the others)."""
    a, b = _pair("cpu")
    train(a, oft.AdEMAMix(a.parameters(), lr=1e-2), STEPS, "cpu")
    train(b, oft.AdEMAMix(b.parameters(), lr=1e-2, t_alpha_beta3=100), STEPS, "cpu")
    assert rel_diff(a, b) > 1e-4  # measured 5.6e-4 (alpha ramps over 100 steps, 10 taken)


@pytest.mark.parametrize("device", DEVICES)
def test_two_groups_and_scheduler(device):
    a, b = _pair(device)

    def groups(m):
        w = [p for n, p in m.named_parameters() if n.endswith("weight")]
        bias = [p for n, p in m.named_parameters() if n.endswith("bias")]
        return [dict(params=w, weight_decay=0.1, alpha_warmup=3, beta3_warmup=7),
                dict(params=bias, lr=3e-2, betas=(0.8, 0.9, 0.99), alpha=4.0)]

    ours = oft.AdEMAMix(groups(a), lr=1e-2)
    ref = AdEMAMixAlgorithm1(groups(b), lr=1e-2)
    lam = lambda s: 0.7 ** s  # noqa: E731
    train(a, ours, STEPS, device, scheduler=torch.optim.lr_scheduler.LambdaLR(ours, lam))
    train(b, ref, STEPS, device, scheduler=torch.optim.lr_scheduler.LambdaLR(ref, lam))
    assert ours.param_groups[1]["lr"] == pytest.approx(3e-2 * 0.7 ** STEPS)
    d = rel_diff(a, b)
    assert d <= _tol(device), d


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip(device):
    kw = dict(lr=1e-2, weight_decay=0.05, t_alpha_beta3=8)
    a, b = _pair(device)
    ours = oft.AdEMAMix(a.parameters(), **kw)
    ref = AdEMAMixAlgorithm1(b.parameters(), **_ref_kwargs(kw))
    train(a, ours, 5, device)
    train(b, ref, 5, device)
    # a state dict holds the optimizer's own tensors (as torch's): a saved copy, as torch.save makes
    sd = copy.deepcopy(ours.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg_fast", "exp_avg_slow", "exp_avg_sq"}
    assert sd["param_groups"][0]["alpha_warmup"] == sd["param_groups"][0]["beta3_warmup"] == 8
    # ours -> a fresh optfuse optimizer, and ours -> the reference; both continue from step 5
    c, d_ = _pair(device)
    with torch.no_grad():
        for pc, pd_, pa in zip(c.parameters(), d_.parameters(), a.parameters()):
            pc.copy_(pa)
            pd_.copy_(pa)
    ours2 = oft.AdEMAMix(c.parameters(), **kw)
    ours2.load_state_dict(copy.deepcopy(sd))  # loading keeps the given tensors: one copy each
    ref2 = AdEMAMixAlgorithm1(d_.parameters(), **_ref_kwargs(kw))
    ref2.load_state_dict(copy.deepcopy(sd))
    # and the reference's state (int step) -> optfuse
    ours3 = oft.AdEMAMix(b.parameters(), **kw)
    ours3.load_state_dict(copy.deepcopy(ref.state_dict()))
    train(a, ours, 5, device, start=5)
    train(c, ours2, 5, device, start=5)
    train(d_, ref2, 5, device, start=5)
    train(b, ours3, 5, device, start=5)
    assert rel_diff(c, a) == 0  # the same kernel from the same state: bitwise
    assert rel_diff(d_, a) <= _tol(device)
    assert rel_diff(b, a) <= _tol(device)
    assert int(ours3.state_dict()["state"][0]["step"]) == 10


def test_arguments():
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = oft.AdEMAMix(p)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["alpha"], g["eps"], g["weight_decay"]) == (1e-3, (0.9, 0.999, 0.9999), 2.0, 1e-8, 0)
    assert g["alpha_warmup"] is None and g["beta3_warmup"] is None
    with pytest.raises(ValueError):
        oft.AdEMAMix(p, betas=(0.9, 0.999))
    with pytest.raises(ValueError):
        oft.AdEMAMix(p, betas=(0.9, 0.999, 1.0))
    with pytest.raises(ValueError):
        oft.AdEMAMix(p, alpha=-1)
    with pytest.raises(ValueError):
        oft.AdEMAMix(p, t_alpha_beta3=10, alpha_warmup=5)
    with pytest.raises(ValueError):
        oft.AdEMAMix(p, alpha_warmup=-3)
    assert "AdEMAMix" in oft.__all__


def test_hyperparameter_changes_do_not_rebuild():
    """alpha, betas and the warm-ups are runtime values: changing them pushes numbers, the same
    compiled kernel keeps running (the engine is not rebuilt)."""
    a, b = _pair("cpu")
    ours = oft.AdEMAMix(a.parameters(), lr=1e-2)
    ref = AdEMAMixAlgorithm1(b.parameters(), lr=1e-2)
    train(a, ours, 3, "cpu")
    train(b, ref, 3, "cpu")
    engines = dict(ours._engines)
    for opt in (ours, ref):
        opt.param_groups[0].update(alpha=6.0, betas=(0.85, 0.99, 0.995), alpha_warmup=20, beta3_warmup=10)
    train(a, ours, 4, "cpu", start=3)
    train(b, ref, 4, "cpu", start=3)
    assert all(ours._engines[k] is e for k, e in engines.items()) and ours._engines.keys() == engines.keys()
    assert rel_diff(a, b) <= F32_TOL
