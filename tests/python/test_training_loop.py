"""The loop users write, against torch: zero_grad() -> forward -> backward -> step() for every drop-in
optimizer (with lr schedulers, parameters that lack a gradient on some steps, gradients in new
memory every step), tensor hyperparameters (CPU and CUDA tensors, changed in place), CUDA graph
capture of forward+backward+step (and what happens when it cannot work), torch.compile of a whole
train step without recompiling, a step that never waits for the GPU, and the state dict after all
that.

Every comparison is against torch.optim's for-loop implementation (foreach=False) on a deep copy of
the same model, measured as in test_torch_parity.py: max|p_ours - p_torch| / max|p_torch|.
"""
import copy
import sys
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import optfuse
import optfuse.torch as oft
from conftest import HAS_CUDA, NO_CUDA_REASON, batch, loss_of, make_model, rel_diff, twin

STEPS = 30
# The tolerances of test_torch_parity.py (reasons in docs/python.md): float32 on CPU <= 1e-6; on
# CUDA <= 2e-6, because torch's CUDA kernels let nvcc contract multiply-adds into FMAs and optfuse's
# (compiled with --fmad=false) do not.
F32_TOL = 1e-6
CUDA_F32_TOL = 2e-6
# Optimizer state (exp_avg, momentum_buffer...) is compared relative to each state tensor's own
# largest element, without the dilution the parameters get from their size (an update is ~1e-2 of
# a weight), so the same roundings weigh more: measured on CPU over this file's loops, at most
# 1.5e-5 (RMSprop, centered, momentum, parameters skipping steps); every other class below 1e-6.
STATE_TOL = 1e-4

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)
CUDA = torch.device("cuda")


def tol(device):
    return CUDA_F32_TOL if torch.device(device).type == "cuda" else F32_TOL


def torch_cls(name):
    return getattr(torch.optim, name)


def moved(model, start):
    """How far training moved the parameters (relative, like rel_diff): a comparison of two runs is
    only meaningful when this is far above the tolerance."""
    return rel_diff(model, start)


def assert_same_training(ours_model, ref_model, ours, ref, device, start_model=None, ptol=None, f64=None):
    """Parameters within the float32 tolerance, state within STATE_TOL, per-parameter steps exact.

    f64: a function that runs torch's same training in float64. The parity tests' tolerances are
    for 20 steps; over 30 steps (more with parameters that skip steps) RMSprop with momentum drifts
    further from torch by float32 rounding alone (measured on CPU: up to 5.5e-6, while torch's own
    float32 run is 3.4e-6 from the float64 one). So past the tolerance, and only up to 10x it, the
    run must be as faithful to float64 math as torch's own float32 run (the criterion of the
    bfloat16 parity tests: at most 25% farther, plus the tolerance)."""
    ptol = tol(device) if ptol is None else ptol
    d = rel_diff(ours_model, ref_model)
    if d > ptol:
        assert f64 is not None and d <= 10 * ptol, \
            f"parameters differ from torch's by {d:.3g} (relative), tolerance {ptol:g}"
        exact = f64()
        ours_err, torch_err = rel_diff(ours_model, exact), rel_diff(ref_model, exact)
        assert ours_err <= 1.25 * torch_err + ptol, (
            f"parameters differ from torch's by {d:.3g} (relative; tolerance {ptol:g}) and are farther from "
            f"float64 math ({ours_err:.3g}) than torch's float32 run is ({torch_err:.3g})")
    if start_model is not None:
        m = moved(ref_model, start_model)
        assert m > 1000 * ptol, f"training barely moved the parameters ({m:.3g}): the comparison would be vacuous"
    a, b = ours.state_dict(), ref.state_dict()
    assert a["state"].keys() == b["state"].keys(), (
        f"state_dict()['state'] has entries for parameters {sorted(a['state'])}, torch's for {sorted(b['state'])}")
    for i, ref_state in b["state"].items():
        assert a["state"][i].keys() == ref_state.keys(), (i, sorted(a["state"][i]), sorted(ref_state))
        for k, v in ref_state.items():
            mine = a["state"][i][k]
            if k == "step":
                assert float(mine) == float(v), f"parameter {i}: step {float(mine)} != torch's {float(v)}"
                continue
            scale = max(v.detach().float().abs().max().item(), 1e-30)
            err = (mine.detach().float() - v.detach().float()).abs().max().item() / scale
            assert err <= STATE_TOL, f"parameter {i}: state {k!r} differs from torch's by {err:.3g} (relative)"


def loop(model, opt, device, steps=STEPS, start=0, scheduler=None, after_backward=None, extra=None):
    """The loop users write: zero_grad() (default set_to_none=True), forward, backward, step()."""
    dtype = next(model.parameters()).dtype
    for s in range(start, start + steps):
        opt.zero_grad()
        params = [p for g in opt.param_groups for p in g["params"]]
        assert all(p.grad is None for p in params), "zero_grad() should set gradients to None by default"
        if extra is None:
            loss = loss_of(model, s, device, dtype)
        else:
            loss = extra(model, s)
        loss.backward()
        if after_backward is not None:
            after_backward(model, s)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def torch_run(name, kw, device, steps=STEPS, dtype=torch.float64, sched=None, holes=False):
    """torch's for-loop class through the same loop (float64 by default: the yardstick above)."""
    def run():
        model = make_holey_model(device, dtype) if holes else make_model(device, dtype)
        opt = torch_cls(name)(model.parameters(), foreach=False, **kw)
        scheduler = None
        if sched:
            scheduler = make_scheduler(sched[0], opt, sched[1]) if isinstance(sched, tuple) else make_scheduler(sched, opt)
        loop(model, opt, device, steps=steps, scheduler=scheduler,
             extra=loss_with_holes if holes else None, after_backward=_drop_some_grads if holes else None)
        return model
    return run


# --- 1. the training loop ---------------------------------------------------------------------------

LOOP_CASES = [
    ("SGD", dict(lr=0.05)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("Adam", dict(lr=1e-2)),
    ("Adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2)),
    ("AdamW", dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("Adagrad", dict(lr=0.05)),
    ("Adagrad", dict(lr=0.05, lr_decay=0.01, weight_decay=0.01)),
    ("RMSprop", dict(lr=1e-2)),
    ("RMSprop", dict(lr=1e-2, centered=True)),
    ("RMSprop", dict(lr=1e-2, momentum=0.9)),
    ("RMSprop", dict(lr=1e-2, centered=True, momentum=0.9, weight_decay=0.01)),
]

# One configuration per class with its structural options switched on.
RICH_CASES = [
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("Adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("Adagrad", dict(lr=0.05, lr_decay=0.01, weight_decay=0.01)),
    ("RMSprop", dict(lr=1e-2, centered=True, momentum=0.9, weight_decay=0.01)),
]


def case_id(case):
    name, kw = case
    return name + "".join(f"-{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("case", LOOP_CASES, ids=[case_id(c) for c in LOOP_CASES])
def test_training_loop_matches_torch(case, device):
    name, kw = case
    model = make_model(device)
    start, ref_model = twin(model), twin(model)
    ours = getattr(oft, name)(model.parameters(), **kw)
    ref = torch_cls(name)(ref_model.parameters(), foreach=False, **kw)
    loop(model, ours, device)
    loop(ref_model, ref, device)
    assert_same_training(model, ref_model, ours, ref, device, start, f64=torch_run(name, kw, device))


def make_scheduler(kind, opt, t_max=STEPS):
    if kind == "StepLR":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)


@pytest.mark.parametrize("sched", ["StepLR", "CosineAnnealingLR"])
@pytest.mark.parametrize("case", RICH_CASES, ids=[case_id(c) for c in RICH_CASES])
def test_training_loop_with_lr_scheduler(case, sched, device):
    check_training_loop_with_lr_scheduler(case, sched, device)


def check_training_loop_with_lr_scheduler(case, sched, device):
    """Ours and torch's (foreach=False) under the same scheduler: the same lrs, the same training
    (shared with test_training_loop_dropins.py)."""
    name, kw = case
    model = make_model(device)
    start, ref_model = twin(model), twin(model)
    ours = getattr(oft, name)(model.parameters(), **kw)
    ref = torch_cls(name)(ref_model.parameters(), foreach=False, **kw)
    s_ours, s_ref = make_scheduler(sched, ours), make_scheduler(sched, ref)
    loop(model, ours, device, scheduler=s_ours)
    loop(ref_model, ref, device, scheduler=s_ref)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert ref.param_groups[0]["lr"] < 0.5 * kw["lr"], "the schedule did not change lr: the test would be vacuous"
    assert_same_training(model, ref_model, ours, ref, device, start, f64=torch_run(name, kw, device, sched=sched))


def make_holey_model(device, dtype=torch.float32):
    """make_model's MLP plus a parameter `aux` (an output bias) that only some steps use."""
    model = make_model(device, dtype)
    model.register_parameter("aux", torch.nn.Parameter(torch.linspace(-0.5, 0.5, 5, device=device, dtype=dtype)))
    return model


def loss_with_holes(model, s):
    x, y = batch(s, model[0].weight.device, model[0].weight.dtype)
    out = model(x)
    if s % 3 != 0:          # on steps 0, 3, 6... aux is not in the graph: its .grad stays None
        out = out + model.aux
    return F.mse_loss(out, y)


def _drop_some_grads(model, s):
    if s % 4 == 1:              # a layer frozen for this step, by hand
        model[0].bias.grad = None


@pytest.mark.parametrize("case", RICH_CASES, ids=[case_id(c) for c in RICH_CASES])
def test_training_loop_parameters_without_grad_on_some_steps(case, device):
    name, kw = case
    model = make_holey_model(device)
    start, ref_model = twin(model), twin(model)
    ours = getattr(oft, name)(model.parameters(), **kw)
    ref = torch_cls(name)(ref_model.parameters(), foreach=False, **kw)
    loop(model, ours, device, extra=loss_with_holes, after_backward=_drop_some_grads)
    loop(ref_model, ref, device, extra=loss_with_holes, after_backward=_drop_some_grads)
    assert_same_training(model, ref_model, ours, ref, device, start, f64=torch_run(name, kw, device, holes=True))
    if name != "SGD":  # torch's SGD keeps no step
        steps = {i: float(st["step"]) for i, st in ref.state_dict()["state"].items()}
        assert len(set(steps.values())) == 3, f"expected three different step counts, torch has {steps}"


def _replace_grads(mode, keep):
    """After backward, move gradients to memory they never had before (kept alive in `keep`, so
    that no address is ever reused)."""
    def after_backward(model, s):
        params = list(model.parameters())
        if mode == "clone":   # one parameter's gradient becomes a copy
            w = model[0].weight
            w.grad = w.grad.clone()
            keep.append(w.grad)
        else:                 # every gradient becomes a view into one new flat buffer (as DDP buckets)
            flat = torch.empty(sum(p.numel() for p in params), device=params[0].device)
            off = 0
            for p in params:
                n = p.numel()
                flat[off:off + n].copy_(p.grad.reshape(-1))
                p.grad = flat[off:off + n].view_as(p)
                off += n
            keep.append(flat)
    return after_backward


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_in_place"])
@pytest.mark.parametrize("mode", ["clone", "flat_buffer_views"])
@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-2)), ("SGD", dict(lr=0.05, momentum=0.9))],
                         ids=["AdamW", "SGD"])
def test_gradients_in_new_memory_every_step(name, kw, mode, set_to_none, device):
    model = make_model(device)
    start, ref_model = twin(model), twin(model)
    ours = getattr(oft, name)(model.parameters(), **kw)
    ref = torch_cls(name)(ref_model.parameters(), foreach=False, **kw)
    keep, ref_keep = [], []
    ptrs = []
    for m, opt, k in ((model, ours, keep), (ref_model, ref, ref_keep)):
        replace = _replace_grads(mode, k)
        for s in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            loss_of(m, s, device, torch.float32).backward()
            replace(m, s)
            if opt is ours:
                ptrs.append(m[0].weight.grad.data_ptr())
            opt.step()
    assert len(set(ptrs)) == STEPS, "the gradient did not move to new memory every step"
    assert_same_training(model, ref_model, ours, ref, device, start)


# --- 2. tensor hyperparameters ---------------------------------------------------------------------

# (class, float values, the keys given as 0-dim tensors, the values fill_()ed in at steps 10 and 20)
TENSOR_CASES = [
    ("SGD", dict(lr=0.05), ["lr"], [dict(lr=0.02), dict(lr=0.08)]),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
     ["lr", "momentum", "dampening", "weight_decay"],
     [dict(lr=0.02, momentum=0.5), dict(dampening=0.3, weight_decay=0.05)]),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True), ["lr", "momentum"], [dict(momentum=0.6), dict(lr=0.02)]),
    ("Adam", dict(lr=1e-2), ["lr"], [dict(lr=3e-3), dict(lr=2e-2)]),
    ("Adam", dict(lr=1e-2, betas=(0.9, 0.99)), ["betas"], [dict(betas=(0.8, 0.95)), dict(betas=(0.95, 0.999))]),
    ("Adam", dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True),
     ["lr", "betas", "eps", "weight_decay"],
     [dict(lr=3e-3, betas=(0.8, 0.95)), dict(eps=1e-4, weight_decay=0.3)]),
    ("AdamW", dict(lr=1e-2), ["lr"], [dict(lr=3e-3), dict(lr=2e-2)]),
    # weight decay 0 when the optimizer is built, non-zero later: the rule must be in the chain then
    # (a CUDA tensor: always; a CPU tensor: the change rebuilds)
    ("AdamW", dict(lr=1e-2, weight_decay=0.0), ["lr", "weight_decay"], [dict(weight_decay=0.1), dict(lr=3e-3)]),
    ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.0), ["weight_decay"],
     [dict(weight_decay=0.05), dict(weight_decay=0.2)]),
    ("AdamW", dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1),
     ["lr", "betas", "eps", "weight_decay"],
     [dict(lr=3e-3, betas=(0.8, 0.95)), dict(eps=1e-4, weight_decay=0.3)]),
    ("Adagrad", dict(lr=0.05), ["lr"], [dict(lr=0.02), dict(lr=0.1)]),
    ("Adagrad", dict(lr=0.05, lr_decay=0.01, eps=1e-8, weight_decay=0.01), ["lr", "lr_decay", "eps", "weight_decay"],
     [dict(lr=0.02, lr_decay=0.05), dict(eps=1e-4, weight_decay=0.05)]),
    ("RMSprop", dict(lr=1e-2), ["lr"], [dict(lr=3e-3), dict(lr=2e-2)]),
    ("RMSprop", dict(lr=1e-2, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.9, centered=True),
     ["lr", "alpha", "eps", "weight_decay", "momentum"],
     [dict(lr=3e-3, alpha=0.95), dict(momentum=0.5, eps=1e-4, weight_decay=0.05)]),
]

# (parameter device, hyperparameter tensor device)
PLACES = [
    pytest.param("cpu", "cpu", id="cpu-params-cpu-hypers"),
    pytest.param("cuda", "cpu", id="cuda-params-cpu-hypers", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)),
    pytest.param("cuda", "cuda", id="cuda-params-cuda-hypers", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)),
]


def tensorize(kw, keys, hyper_device):
    out = dict(kw)
    for k in keys:
        if k == "betas":
            out[k] = tuple(torch.tensor(float(b), device=hyper_device) for b in kw[k])
        else:
            out[k] = torch.tensor(float(kw[k]), device=hyper_device)
    return out


def fill_hypers(group, values):
    for k, v in values.items():
        if k == "betas":
            for t, b in zip(group[k], v):
                t.fill_(b)
        else:
            group[k].fill_(v)


def _tensor_run(name, kw, keys, fills, device, hyper_device, ours):
    model = make_model(device)
    start = twin(model)
    hk = tensorize(kw, keys, hyper_device)
    if ours:
        opt = getattr(oft, name)(model.parameters(), **hk)
    else:
        opt = torch_cls(name)(model.parameters(), foreach=False, **hk)
    for s in range(STEPS):
        if fills is not None and s in (10, 20):
            fill_hypers(opt.param_groups[0], fills[s // 10 - 1])
        loop(model, opt, device, steps=1, start=s)
    return model, opt, start


@pytest.mark.parametrize("device,hyper_device", PLACES)
@pytest.mark.parametrize("case", TENSOR_CASES, ids=[case_id(c[:2]) + "-tensor:" + ",".join(c[2]) for c in TENSOR_CASES])
def test_tensor_hyperparameters_changed_in_place(case, device, hyper_device):
    name, kw, keys, fills = case
    device = torch.device(device)
    try:
        ref_model, ref, start = _tensor_run(name, kw, keys, fills, device, hyper_device, ours=False)
    except (RuntimeError, ValueError, TypeError) as e:
        # torch rejects this combination: optfuse must reject it too (drop-in), with the same kind of error
        with pytest.raises(type(e)):
            _tensor_run(name, kw, keys, fills, device, hyper_device, ours=True)
        return
    model, ours, _ = _tensor_run(name, kw, keys, fills, device, hyper_device, ours=True)
    for k in keys:  # the group still holds tensors, with the filled-in values
        mine, theirs = ours.param_groups[0][k], ref.param_groups[0][k]
        mine, theirs = (mine, theirs) if k == "betas" else ((mine,), (theirs,))
        assert all(torch.is_tensor(t) for t in mine), (k, mine)
        assert [t.item() for t in mine] == [t.item() for t in theirs], (k, mine, theirs)
    # The in-place changes matter: torch without them ends up far away.
    plain_model, _, _ = _tensor_run(name, kw, keys, None, device, hyper_device, ours=False)
    assert rel_diff(plain_model, ref_model) > 100 * tol(device), "the fill_() changes made no difference"
    assert_same_training(model, ref_model, ours, ref, device, start)


@pytest.mark.parametrize("device,hyper_device", PLACES)
@pytest.mark.parametrize("sched", ["StepLR", "CosineAnnealingLR"])
@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-2, weight_decay=0.1)),
                                     ("SGD", dict(lr=0.05, momentum=0.9)),
                                     ("RMSprop", dict(lr=1e-2))], ids=["AdamW", "SGD", "RMSprop"])
def test_scheduler_fills_a_tensor_lr(name, kw, sched, device, hyper_device):
    check_scheduler_fills_a_tensor_lr(name, kw, sched, torch.device(device), hyper_device)


def check_scheduler_fills_a_tensor_lr(name, kw, sched, device, hyper_device):
    """lr given as a tensor (on hyper_device): the scheduler fill_()s it, ours and torch train alike."""
    runs = []
    for cls in (getattr(oft, name), lambda params, **k: torch_cls(name)(params, foreach=False, **k)):
        model = make_model(device)
        start = twin(model)
        lr = torch.tensor(kw["lr"], device=hyper_device)
        opt = cls(model.parameters(), **dict(kw, lr=lr))
        scheduler = make_scheduler(sched, opt)
        loop(model, opt, device, scheduler=scheduler)
        # LRScheduler writes a tensor lr with fill_(): the group keeps the very tensor given
        assert opt.param_groups[0]["lr"] is lr
        assert lr.item() < 0.5 * kw["lr"], "the schedule did not change lr: the test would be vacuous"
        runs.append((model, opt))
    (model, ours), (ref_model, ref) = runs
    assert ours.param_groups[0]["lr"].item() == ref.param_groups[0]["lr"].item()
    assert_same_training(model, ref_model, ours, ref, device, start)


# Combinations of tensor hyperparameters torch's constructors reject; optfuse (a drop-in) must too.
REJECTED = [
    ("Adam", lambda: dict(betas=(torch.tensor(0.9), 0.999))),
    ("AdamW", lambda: dict(betas=(0.9, torch.tensor(0.999)))),
    ("Adam", lambda: dict(lr=torch.tensor(1e-3), foreach=True)),
    ("AdamW", lambda: dict(lr=torch.tensor(1e-3), foreach=True)),
    ("Adam", lambda: dict(lr=torch.tensor([1e-3, 1e-3]))),
    ("AdamW", lambda: dict(betas=(torch.tensor([0.9, 0.9]), torch.tensor([0.99, 0.99])))),
]


@pytest.mark.parametrize("name,make_kw", REJECTED, ids=[f"{n}-{i}" for i, (n, _) in enumerate(REJECTED)])
def test_tensor_hyperparameters_torch_rejects_are_rejected(name, make_kw):
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(Exception) as torch_err:
        torch_cls(name)([p], **make_kw())
    with pytest.raises(torch_err.type):
        getattr(oft, name)([p], **make_kw())


# --- 5. torch.compile ---------------------------------------------------------------------------------

_compile_problem = {}


def require_compile(device, mode):
    """Skip (visibly) when torch.compile cannot work here at all, e.g. inductor without a C++ compiler
    or Triton; any other failure of the real test is a failure."""
    key = (device.type, mode)
    if key not in _compile_problem:
        problem = None
        if not hasattr(torch, "compile"):
            problem = "this torch has no torch.compile"
        elif hasattr(torch, "_dynamo") and not torch._dynamo.is_dynamo_supported():
            problem = "TorchDynamo does not support this Python"
        else:
            try:
                torch._dynamo.reset()
                f = torch.compile(lambda x: torch.tanh(x) * 2 + 1, mode=mode)
                f(torch.ones(8, device=device))
            except Exception as e:  # noqa: BLE001 - any failure of a trivial compile means "unavailable"
                problem = f"{type(e).__name__}: {str(e)[:300]}"
            finally:
                torch._dynamo.reset()
        _compile_problem[key] = problem
    if _compile_problem[key]:
        pytest.skip(f"torch.compile(mode={mode!r}) does not work on {device.type} here: {_compile_problem[key]}")


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    prev = torch._dynamo.config.error_on_recompile
    yield counters
    torch._dynamo.config.error_on_recompile = prev
    torch._dynamo.reset()


COMPILE_MODES = [
    pytest.param("cpu", None, id="cpu-default"),
    pytest.param("cuda", None, id="cuda-default", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)),
    pytest.param("cuda", "reduce-overhead", id="cuda-reduce-overhead",
                 marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)),
]
# Inductor's kernels for the forward and backward need not round as eager's do; measured on CPU
# (torch 2.15) the parameters stayed within 2e-7 of eager torch's, so the float32 tolerances hold,
# with the float64 yardstick of assert_same_training for drift beyond them.


def make_train_step(model, opt):
    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


@pytest.mark.parametrize("device_name,mode", COMPILE_MODES)
def test_torch_compile_train_step(device_name, mode, fresh_dynamo):
    device = torch.device(device_name)
    require_compile(device, mode)
    model = make_model(device)
    start, ref_model = twin(model), twin(model)
    ours = oft.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    step = torch.compile(make_train_step(model, ours), mode=mode)
    ref_step = make_train_step(ref_model, ref)
    for s in range(10):
        x, y = batch(s, device)
        step(x, y)
        ref_step(x, y)
    assert fresh_dynamo["stats"]["unique_graphs"] >= 1, "torch.compile compiled nothing"
    assert_same_training(model, ref_model, ours, ref, device, start, f64=torch_run("AdamW", dict(lr=1e-2), device, 10))


@pytest.mark.parametrize("device_name,mode", COMPILE_MODES)
def test_torch_compile_tensor_lr_schedule_never_recompiles(device_name, mode, fresh_dynamo):
    device = torch.device(device_name)
    require_compile(device, mode)
    steps = 20
    model = make_model(device)
    start, ref_model = twin(model), twin(model)
    lr, ref_lr = torch.tensor(1e-2, device=device), torch.tensor(1e-2, device=device)
    ours = oft.AdamW(model.parameters(), lr=lr)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=ref_lr, foreach=False)
    step = torch.compile(make_train_step(model, ours), mode=mode)
    ref_step = make_train_step(ref_model, ref)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(ours, T_max=steps)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref, T_max=steps)
    graphs = None
    for s in range(steps):
        x, y = batch(s, device)
        step(x, y)
        ref_step(x, y)
        sched.step()      # lr.fill_(cosine value)
        ref_sched.step()
        # The first call runs the eager step (it builds the tables: a graph break), the second
        # retraces once with the step as the custom op (test_compile.py); then nothing recompiles.
        if s == 1:
            graphs = fresh_dynamo["stats"]["unique_graphs"]
            assert graphs >= 1, "torch.compile compiled nothing"
            torch._dynamo.config.error_on_recompile = True  # a recompile from now on raises
    assert fresh_dynamo["stats"]["unique_graphs"] == graphs, "recompiled after the second call"
    assert ours.param_groups[0]["lr"] is lr and lr.item() == ref_lr.item() < 1e-3
    assert_same_training(model, ref_model, ours, ref, device, start,
                         f64=torch_run("AdamW", dict(lr=1e-2), device, steps, sched=("CosineAnnealingLR", steps)))


# --- 6. step() never waits for the GPU --------------------------------------------------------------------

QUEUED_MS = 50.0


def _sleep_cycles(ms):
    """GPU clock cycles that torch.cuda._sleep spins for about `ms` milliseconds (calibrated here,
    after a first sleep has brought the clocks up)."""
    n = 20_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        torch.cuda.synchronize()
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()
    return int(n * ms / a.elapsed_time(b))


@requires_cuda
@pytest.mark.parametrize("variant", ["float_hypers", "float_lr_scheduler", "cuda_tensor_lr_scheduler",
                                     "grad_scaler"])
def test_step_never_waits_for_the_gpu(variant):
    model = make_model(CUDA)
    lr = torch.tensor(1e-2, device=CUDA) if variant == "cuda_tensor_lr_scheduler" else 1e-2
    opt = oft.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9) if "scheduler" in variant else None
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0) if variant == "grad_scaler" else None
    data = _graph_data(10)
    cycles = None
    host_ms, wait_ms, slept_ms = [], [], []
    for s in range(10):
        timed = s >= 3                        # after warm-up
        if timed and cycles is None:
            cycles = _sleep_cycles(QUEUED_MS)
        opt.zero_grad()                       # new gradient tensors every step
        x, y = data[s]
        loss = F.mse_loss(model(x), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if timed:                             # the GPU is busy for ~QUEUED_MS behind the backward
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
        t0 = time.perf_counter()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
        t1 = time.perf_counter()
        if timed:
            torch.cuda.synchronize()          # still long: the work really was queued
            t2 = time.perf_counter()
            host_ms.append((t1 - t0) * 1e3)
            wait_ms.append((t2 - t1) * 1e3)
            slept_ms.append(a.elapsed_time(b))
        if scaler is not None:
            scaler.update()
        if sched is not None:
            sched.step()
    report = (f"host ms per step {[round(h, 2) for h in host_ms]}, GPU sleep ms {[round(q, 1) for q in slept_ms]}, "
              f"wait after step ms {[round(w, 1) for w in wait_ms]}")
    assert min(slept_ms) > 0.4 * QUEUED_MS, f"the queued sleep was too short to tell anything: {report}"
    for host, wait, slept in zip(host_ms, wait_ms, slept_ms):
        assert wait > 0.5 * slept, f"the sleep was over when step() returned: the test would be vacuous ({report})"
        assert host < 0.1 * slept, f"step() waited for the GPU ({report})"


def _time_behind_gpu_work(prepare, act, cycles):
    """Host ms of act(prepare()) with `cycles` of torch.cuda._sleep queued ahead (none if 0), the
    sleep's GPU ms, and whether the sleep was still running when act returned."""
    obj = prepare()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    if cycles:
        torch.cuda._sleep(cycles)
    b.record()
    t0 = time.perf_counter()
    act(obj)
    t1 = time.perf_counter()
    busy = not b.query()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3, a.elapsed_time(b), busy


@requires_cuda
@pytest.mark.parametrize("event", ["first_step", "rebuild", "destroy"])
def test_building_and_destroying_an_optimizer_never_wait_for_the_gpu(event):
    """The first step of a new optimizer (its tables built and uploaded), a step that rebuilds them
    (a parameter group added: the old tables are retired) and destroying an optimizer (its device
    buffers freed) queue their work behind the GPU's instead of waiting for it: each takes about as
    long behind 200 ms of queued GPU work as alone. (cuMemFree, cuMemAlloc and cuMemFreeHost wait
    for all queued work: device buffers are stream-ordered and page-locked slots never freed, see
    cuda_executor.cpp.) Many tensors, so that the tables are large. Destroying is measured on the
    core optimizer, whose destructor runs when its last reference goes (no cycles)."""
    params = [torch.nn.Parameter(torch.randn(4096, device=CUDA)) for _ in range(600)]
    extra = [torch.nn.Parameter(torch.randn(4096, device=CUDA))]
    for p in params + extra:
        p.grad = torch.randn_like(p)
    warm = oft.AdamW(params, lr=1e-3)  # compiles and loads the kernels
    warm.step()

    def prepare():
        if event == "destroy":
            core = optfuse.Optimizer("adamw(lr=1e-3)", "cuda")
            tensors = [(p.detach(), p.grad, [torch.zeros_like(p), torch.zeros_like(p)], 0) for p in params]
            core.set_tensors(tensors)
            core.step()
            return [core, tensors]  # (the states live as long as the optimizer)
        opt = oft.AdamW(params, lr=1e-3)
        if event == "rebuild":
            opt.step()
            opt.add_param_group({"params": extra})
        return [opt]

    def act(holder):
        if event == "destroy":
            # (counted outside the assert: pytest's rewritten assert keeps holder[0] in a temporary)
            refs = sys.getrefcount(holder[0])  # the list's and the argument's
            assert refs == 2, f"something else holds the optimizer ({refs} references): it would not die here"
            holder.clear()  # the last reference: the destructor runs now (then the states go)
        else:
            holder[0].step()

    queued = 200.0
    alone, _, _ = _time_behind_gpu_work(prepare, act, 0)
    behind, slept, busy = _time_behind_gpu_work(prepare, act, _sleep_cycles(queued))
    report = f"{event}: {alone:.1f} ms alone, {behind:.1f} ms behind {slept:.1f} ms of GPU work"
    assert slept > 0.4 * queued and busy, f"the queued sleep was too short to tell anything: {report}"
    assert behind < alone + 0.5 * slept, f"waited for the GPU: {report}"


# --- 7. the state dict after the loop ------------------------------------------------------------------
# test_torch_features.py round-trips the state dict both ways after 5 plain steps. Here: after the
# 30-step loop with a tensor lr moved by a scheduler and parameters that missed gradients (so the
# per-parameter steps differ), continuing 5 steps from the loaded state equals continuing the
# original optimizer, ours -> torch and torch -> ours.

@pytest.mark.parametrize("case", RICH_CASES, ids=[case_id(c) for c in RICH_CASES])
def test_state_dict_round_trip_after_the_loop(case, device):
    name, kw = case
    classes = {"ours": getattr(oft, name), "torch": lambda params, **k: torch_cls(name)(params, foreach=False, **k)}
    for first, second in (("ours", "torch"), ("torch", "ours")):
        model = make_holey_model(device)
        opt = classes[first](model.parameters(), **dict(kw, lr=torch.tensor(kw["lr"])))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        loop(model, opt, device, extra=loss_with_holes, after_backward=_drop_some_grads, scheduler=sched)
        sd = copy.deepcopy(opt.state_dict())
        if name != "SGD":
            assert len({float(st["step"]) for st in sd["state"].values()}) == 3
        # the twin continues from the saved state with the other implementation
        model2 = twin(model)
        opt2 = classes[second](model2.parameters(), **dict(kw, lr=torch.tensor(1.0)))
        opt2.load_state_dict(sd)
        assert float(opt2.param_groups[0]["lr"]) == float(opt.param_groups[0]["lr"])
        assert float(opt.param_groups[0]["lr"]) == pytest.approx(kw["lr"] * 0.5 ** 3, rel=1e-6)
        before = twin(model)
        loop(model, opt, device, steps=5, start=STEPS, extra=loss_with_holes, after_backward=_drop_some_grads)
        loop(model2, opt2, device, steps=5, start=STEPS, extra=loss_with_holes, after_backward=_drop_some_grads)
        ours_opt, ref_opt = (opt, opt2) if first == "ours" else (opt2, opt)
        ours_model, ref_model = (model, model2) if first == "ours" else (model2, model)
        assert moved(model, before) > 100 * tol(device), "the 5 continued steps barely moved the parameters"
        assert_same_training(ours_model, ref_model, ours_opt, ref_opt, device)


# --- 3. and 4. CUDA graphs ---------------------------------------------------------------------------------
# Last in this file (which pytest runs last of tests/python): a capture that fails inside torch can
# leave torch's CUDA generator marked as capturing ("Offset increment outside graph capture
# encountered unexpectedly" in every later test that draws CUDA random numbers, torch.compile's
# included), so these tests come after everything else.

GRAPH_CASES = [
    # every float hyperparameter of the class (what its _hypers pushes) as a CUDA tensor
    ("AdamW", dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05), dict(capturable=True)),
    ("Adam", dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05), dict(capturable=True)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01), dict()),
    # eta and mu: uniform states committed by the captured kernel (torch's reference: its capturable
    # path, eta and mu in float32 tensor math, within the state tolerance of float64 math rounded once)
    ("ASGD", dict(lr=0.05, lambd=0.3, alpha=0.6, t0=2, weight_decay=0.01), dict(capturable=True)),
]
WARMUP, REPLAYS = 3, 10


def cuda_hypers(kw):
    return tensorize(kw, list(kw), CUDA)


def _ref_torch_opt(name, params, kw, flags):
    """The eager reference: torch's for-loop class, the same CUDA tensor hyperparameters (torch's
    capturable path where the class has one, as the torch recipe for graphs asks)."""
    return torch_cls(name)(params, foreach=False, **cuda_hypers(kw), **flags)


def _graph_data(n):
    return [batch(s, CUDA) for s in range(n)]


def _graph_step(model, opt, x, y, scaler=None):
    loss = F.mse_loss(model(x), y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss


def _warm_up_on_side_stream(model, opt, data, static_x, static_y, scaler=None):
    """torch's recipe before a capture: WARMUP eager steps on a side stream, then back to the current one."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in range(WARMUP):
            static_x.copy_(data[s][0])
            static_y.copy_(data[s][1])
            opt.zero_grad(set_to_none=True)
            _graph_step(model, opt, static_x, static_y, scaler)
    torch.cuda.current_stream().wait_stream(side)


def _train_in_graph(model, opt, data, sched=None, scaler=None):
    """torch.cuda.graphs' "whole network capture": warm up on a side stream, capture forward, backward
    and step on static inputs, then replay with new data copied into them."""
    static_x, static_y = (t.clone() for t in data[0])
    _warm_up_on_side_stream(model, opt, data, static_x, static_y, scaler)
    after_warmup = twin(model)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        _graph_step(model, opt, static_x, static_y, scaler)
    for s in range(WARMUP, WARMUP + REPLAYS):
        static_x.copy_(data[s][0])
        static_y.copy_(data[s][1])
        graph.replay()
        if sched is not None:
            sched.step()
    torch.cuda.synchronize()
    return after_warmup


def _train_eager(model, opt, data, sched=None, scaler=None):
    for s in range(WARMUP + REPLAYS):
        opt.zero_grad(set_to_none=True)
        _graph_step(model, opt, data[s][0], data[s][1], scaler)
        if sched is not None and s >= WARMUP:
            sched.step()
    torch.cuda.synchronize()


@requires_cuda
@pytest.mark.parametrize("name,kw,flags", GRAPH_CASES, ids=[c[0] for c in GRAPH_CASES])
def test_cuda_graph_capture_of_the_whole_step(name, kw, flags):
    data = _graph_data(WARMUP + REPLAYS)
    model = make_model(CUDA)
    ref_model = twin(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the schedulers' "step() before optimizer.step()" on replays
        ours = getattr(oft, name)(model.parameters(), **cuda_hypers(kw), **flags)
        sched = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.5)
        after_warmup = _train_in_graph(model, ours, data, sched)
        ref = _ref_torch_opt(name, ref_model.parameters(), kw, flags)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
        _train_eager(ref_model, ref, data, ref_sched)
    assert moved(model, after_warmup) > 1000 * CUDA_F32_TOL, "the replays did not train"
    assert ours.param_groups[0]["lr"].item() == ref.param_groups[0]["lr"].item()
    assert ref.param_groups[0]["lr"].item() == pytest.approx(kw["lr"] * 0.5 ** (REPLAYS // 2), rel=1e-6)
    assert_same_training(model, ref_model, ours, ref, CUDA)  # includes step == WARMUP + REPLAYS


@requires_cuda
def test_cuda_graph_with_grad_scaler_skips_an_inf_step():
    # GradScaler inside the captured graph (not only eager): GradScaler.step hands an optimizer with
    # _step_supports_amp_scaling grad_scale / found_inf as device tensors without syncing, and
    # GradScaler.update is device-side, so forward+backward+scaler.step+scaler.update are captured.
    # The reference is eager torch AdamW(capturable=True, foreach=False) with an eager GradScaler.
    name, kw, flags = GRAPH_CASES[0]
    data = _graph_data(WARMUP + REPLAYS)
    bad = WARMUP + 4
    x_bad = data[bad][0].clone()
    x_bad[0, 0] = float("inf")   # tanh saturates, 0 * inf: NaN gradients for the first layer
    data[bad] = (x_bad, data[bad][1])
    model = make_model(CUDA)
    ref_model = twin(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=1000)
        ours = getattr(oft, name)(model.parameters(), **cuda_hypers(kw), **flags)
        sched = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.5)
        _train_in_graph(model, ours, data, sched, scaler)
        ref_scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=1000)
        ref = _ref_torch_opt(name, ref_model.parameters(), kw, flags)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
        _train_eager(ref_model, ref, data, ref_sched, ref_scaler)
    assert ref_scaler.get_scale() == 512.0, "the reference did not see the inf step"
    assert scaler.get_scale() == 512.0
    assert float(ref.state_dict()["state"][0]["step"]) == WARMUP + REPLAYS - 1
    assert_same_training(model, ref_model, ours, ref, CUDA)  # the skipped step did not count


# --- 4. capture with Python-float hyperparameters raises ------------------------------------------------

def test_optfuse_error_is_a_runtime_error():
    # what a failed capture raises must be catchable as the RuntimeError torch's own capture errors are
    assert issubclass(oft.OptfuseError, RuntimeError)

@requires_cuda
@pytest.mark.parametrize("tensors,expect_names", [
    ([], ["lr"]),
    (["lr", "betas"], ["eps", "weight_decay"]),
], ids=["all-floats", "lr-and-betas-tensors"])
def test_capture_with_float_hyperparameters_raises(tensors, expect_names):
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    data = _graph_data(WARMUP + 5)
    model = make_model(CUDA)
    ref_model = twin(model)
    hk = tensorize(kw, tensors, CUDA)
    ours = oft.AdamW(model.parameters(), capturable=bool(tensors), **hk)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, capturable=bool(tensors),
                            **tensorize(kw, tensors, CUDA))
    static_x, static_y = (t.clone() for t in data[0])
    _warm_up_on_side_stream(model, ours, data, static_x, static_y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(oft.OptfuseError) as err:
        with torch.cuda.graph(graph):
            ours.step()
    assert isinstance(err.value, RuntimeError)
    for n in expect_names:
        assert n in str(err.value), f"the error should name the float hyperparameter {n!r}: {err.value}"
    # Nothing was half-done: the next eager steps continue exactly like torch's (which never tried).
    torch.cuda.synchronize()
    for s in range(WARMUP, WARMUP + 5):
        ours.zero_grad()
        _graph_step(model, ours, *data[s])
    for s in range(WARMUP + 5):
        ref.zero_grad()
        _graph_step(ref_model, ref, *data[s])
    assert float(ours.state_dict()["state"][0]["step"]) == WARMUP + 5
    assert_same_training(model, ref_model, ours, ref, CUDA)
