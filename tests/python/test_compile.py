"""torch.compile and the fused step as a custom op (optfuse::fused_step, python/optfuse/torch/_compile.py).

* step() alone compiles with fullgraph=True (no graph break at all) and equals the eager step
  bitwise, parameters and states, for several optimizer classes, with the default backend
  (Inductor), mode="reduce-overhead", and aot_eager (which hands the op copies of the parameters
  and states: the functionalization hazard the op must handle by acting on what it is passed).
* A compiled train step (forward, backward, step, zero_grad) equals the same step run eagerly,
  within 1e-6 relative: not bitwise, because Inductor's forward and backward kernels round
  differently from eager's (the step itself is bitwise, above). Its graph breaks are only torch's
  own (Tensor.backward, Optimizer.zero_grad): none comes from optfuse.
* A tensor lr under a cosine schedule: 100 steps, no recompilation, also when the lr tensor is
  changed inside the compiled function (the op is then handed the functional copy of lr).
* What cannot be traced falls back to the eager step (a graph break), correctly: a closure, a
  gradient vanishing.
CUDA cases skip with a visible reason where there is no GPU.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import optfuse
import optfuse.torch as oft
from conftest import HAS_CUDA, NO_CUDA_REASON, batch, make_model, rel_diff
from test_training_loop import require_compile

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="this torch has no torch.compile")

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON))]
MODES = [pytest.param(None, id="default"), pytest.param("reduce-overhead", id="reduce-overhead")]
# Inductor's forward/backward kernels against eager's (measured on CPU, torch 2.15: <= 2e-7).
TRAIN_TOL = 1e-6


def _clip_chain():
    return optfuse.parse_chain("chain(clip_by_global_norm(1.0), adam(lr=1e-2))")


OPTIMIZERS = {
    "AdamW": lambda ps, lr=1e-2: oft.AdamW(ps, lr=lr, weight_decay=0.1),
    "SGD-momentum": lambda ps, lr=1e-2: oft.SGD(ps, lr=lr, momentum=0.9, nesterov=True),
    "Adam-amsgrad": lambda ps, lr=1e-2: oft.Adam(ps, lr=lr, amsgrad=True),
    "Fused-clip-adam": lambda ps, lr=1e-2: oft.Fused(_clip_chain(), ps, lr=lr),
    # eta and mu are uniform states: averaging (mu < 1) from step 4
    "ASGD": lambda ps, lr=1e-2: oft.ASGD(ps, lr=lr, lambd=0.3, alpha=0.6, t0=2, weight_decay=0.01),
}


@pytest.fixture
def dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def _frame_compiles(counters):
    """Frames Dynamo has compiled so far (every recompile adds one)."""
    return sum(counters["frames"].values()) if "frames" in counters else counters["stats"]["unique_graphs"]


def _optfuse_breaks(counters):
    """Graph breaks attributed to optfuse's step (anything else is torch's own)."""
    return {k: v for k, v in counters["graph_break"].items()
            if "optfuse" in k or "FusedOptimizer" in k or "_eager_step" in k}


def _new_grads(params, twins, s):
    g = torch.Generator().manual_seed(500 + s)
    for p, q in zip(params, twins):
        grad = torch.randn(p.shape, generator=g).to(p.device)
        p.grad = grad.clone()   # new gradient tensors every step, as zero_grad(set_to_none) gives
        q.grad = grad.clone()


def _assert_bitwise(opt, ref):
    for (p, q) in zip([p for g in opt.param_groups for p in g["params"]],
                      [q for g in ref.param_groups for q in g["params"]]):
        assert torch.equal(p, q), f"parameter of shape {tuple(p.shape)}: {(p - q).abs().max().item()}"
    a, b = opt.state_dict()["state"], ref.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys()
        for k in a[i]:
            assert torch.equal(a[i][k], b[i][k]), f"state {k} of parameter {i}"


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("backend,mode", [pytest.param("inductor", None, id="default"),
                                          pytest.param("inductor", "reduce-overhead", id="reduce-overhead"),
                                          pytest.param("aot_eager", None, id="aot_eager")])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_is_one_graph_and_bitwise_eager(name, backend, mode, device_name, dynamo):
    device = torch.device(device_name)
    require_compile(device, mode)
    model = make_model(device)
    params = list(model.parameters())
    twins = [p.detach().clone().requires_grad_() for p in params]
    opt, ref = OPTIMIZERS[name](params), OPTIMIZERS[name](twins)
    kw = {"backend": backend} if mode is None else {"mode": mode}
    step = torch.compile(lambda: opt.step(), fullgraph=True, **kw)  # any graph break raises
    foreign = 0
    for s in range(8):
        _new_grads(params, twins, s)
        if s in (0, 5):
            opt.step()   # eager: builds the tables (s == 0); points them back at our tensors (s == 5)
        else:
            step()
            foreign += opt._foreign
        ref.step()
    _assert_bitwise(opt, ref)
    assert not dynamo["graph_break"], dict(dynamo["graph_break"])
    if backend == "aot_eager":
        assert foreign, "aot_eager should hand the op copies of the parameters and states"


def _train_step(model, opt, lr_in_graph=False):
    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if lr_in_graph:
            opt.param_groups[0]["lr"].mul_(0.98)   # traced: the op gets the functional lr
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_train_step_equals_eager(name, mode, device_name, dynamo):
    device = torch.device(device_name)
    require_compile(device, mode)
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt, ref = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref_model.parameters())
    step = torch.compile(_train_step(model, opt), mode=mode)
    ref_step = _train_step(ref_model, ref)
    start = copy.deepcopy(model)
    for s in range(10):
        x, y = batch(s, device)
        step(x, y)
        ref_step(x, y)
        if s == 1:
            warm = (_frame_compiles(dynamo), dict(dynamo["graph_break"]))
    assert rel_diff(model, ref_model) <= TRAIN_TOL
    assert rel_diff(model, start) > 1e3 * TRAIN_TOL, "training did not move the parameters"
    # After the first two calls (the first step is eager and builds the tables; the second retraces
    # once): nothing recompiles and no new graph break appears.
    assert (_frame_compiles(dynamo), dict(dynamo["graph_break"])) == warm
    assert len(_optfuse_breaks(dynamo)) <= 1, _optfuse_breaks(dynamo)  # the first step's, only


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["scheduler", "in_graph"])
def test_tensor_lr_cosine_100_steps_never_recompiles(where, mode, device_name, dynamo):
    device = torch.device(device_name)
    require_compile(device, mode)
    steps = 100
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    lr, ref_lr = torch.tensor(1e-2, device=device), torch.tensor(1e-2, device=device)
    opt, ref = oft.AdamW(model.parameters(), lr=lr), oft.AdamW(ref_model.parameters(), lr=ref_lr)
    in_graph = where == "in_graph"
    step = torch.compile(_train_step(model, opt, in_graph), mode=mode)
    ref_step = _train_step(ref_model, ref, in_graph)
    sched = ref_sched = None
    if not in_graph:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref, T_max=steps)
    warm = None
    for s in range(steps + 2):
        x, y = batch(s % 7, device)
        step(x, y)
        ref_step(x, y)
        if sched is not None:
            sched.step()
            ref_sched.step()
        if s == 1:
            warm = (_frame_compiles(dynamo), dict(dynamo["graph_break"]))
    assert (_frame_compiles(dynamo), dict(dynamo["graph_break"])) == warm, "recompiled or broke after warm-up"
    assert opt.param_groups[0]["lr"] is lr and lr.item() == ref_lr.item() != 1e-2
    assert rel_diff(model, ref_model) <= TRAIN_TOL


@pytest.mark.parametrize("case", ["closure", "grad_vanishes"])
def test_fallbacks_stay_correct(case, dynamo):
    device = torch.device("cpu")
    require_compile(device, None)
    model = make_model(device)
    params = list(model.parameters())
    twins = [p.detach().clone().requires_grad_() for p in params]
    opt, ref = OPTIMIZERS["AdamW"](params), OPTIMIZERS["AdamW"](twins)
    if case == "closure":
        step = torch.compile(lambda: opt.step(lambda: None))
        ref_step = lambda: ref.step(lambda: None)  # noqa: E731
    else:
        step = torch.compile(lambda: opt.step())
        ref_step = ref.step
    for s in range(6):
        _new_grads(params, twins, s)
        if case == "grad_vanishes" and s in (3, 4):
            params[0].grad = twins[0].grad = None
        step()
        ref_step()
    _assert_bitwise(opt, ref)


def test_structure_change_inside_compiled_step_raises_clearly(dynamo):
    """A CPU tensor weight_decay going from 0 (rule left out of the chain) to non-zero: the compiled
    step cannot rebuild, so it raises (changing nothing) instead of stepping without weight decay; one
    eager step rebuilds, and compiled steps then match the eager twin again."""
    require_compile(torch.device("cpu"), None)
    params = list(make_model(torch.device("cpu")).parameters())
    twins = [p.detach().clone().requires_grad_() for p in params]
    wd, ref_wd = torch.tensor(0.0), torch.tensor(0.0)
    opt, ref = oft.AdamW(params, lr=1e-2, weight_decay=wd), oft.AdamW(twins, lr=1e-2, weight_decay=ref_wd)
    step = torch.compile(lambda: opt.step())
    for s in range(3):
        _new_grads(params, twins, s)
        step()
        ref.step()
    wd.fill_(0.1)
    ref_wd.fill_(0.1)
    before = [p.detach().clone() for p in params]
    with pytest.raises(optfuse.OptfuseError, match="eager step"):
        step()
    assert all(torch.equal(a, b) for a, b in zip(before, params)), "a step that raised changed parameters"
    for s in range(3, 6):
        _new_grads(params, twins, s)
        (opt.step if s == 3 else step)()
        ref.step()
    _assert_bitwise(opt, ref)
