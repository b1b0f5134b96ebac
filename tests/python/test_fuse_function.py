"""fuse(fn), the function form: torch's own _single_tensor_adam / _sgd / _rmsprop fused, against
calling torch's function directly (float32, 1e-6 relative to the parameter scale, states and steps)."""
import inspect

import pytest

torch = pytest.importorskip("torch")
import optfuse.torch  # noqa: E402
from optfuse.torch import OptfuseError  # noqa: E402
from torch.optim.adam import _single_tensor_adam  # noqa: E402
from torch.optim.rmsprop import _single_tensor_rmsprop  # noqa: E402
from torch.optim.sgd import _single_tensor_sgd  # noqa: E402

from conftest import DEVICES  # noqa: E402

STEPS = 15
TOL = 1e-6
SHAPES = [(5, 3), (7,), (2, 3, 4), (1,)]


def _rel(a, b):
    """max |a - b| / max |b|; over lists of tensors, relative to the largest of all (the parameter scale)."""
    if isinstance(a, list):
        return max((x - y).abs().max().item() for x, y in zip(a, b)) / max(y.abs().max().item() for y in b)
    den = b.abs().max().item()
    return (a - b).abs().max().item() / (den if den > 0 else 1.0)


def _accepts(fn, name):
    return name in inspect.signature(fn).parameters


def _kw(fn, **kw):
    """Keyword arguments the installed torch's function takes (2.11 and 2.15 differ: decoupled_weight_decay)."""
    return {k: v for k, v in kw.items() if _accepts(fn, k)}


def _side_by_side(fn, device, make_lists, kw_of_step, positional_tail=()):
    torch.manual_seed(0)
    params = [torch.randn(s, device=device) for s in SHAPES]
    ref = [p.clone() for p in params]
    ours = [p.clone() for p in params]
    ref_lists, our_lists = make_lists(ref), make_lists(ours)
    fused = optfuse.torch.fuse(fn)
    counts = None
    for s in range(STEPS):
        grads = [torch.randn_like(p) * (0.1 if s % 2 else 1.0) for p in params]
        kw = kw_of_step(s)
        fn(ref, [g.clone() for g in grads], *ref_lists, *positional_tail, **kw)
        fused(ours, [g.clone() for g in grads], *our_lists, *positional_tail, **kw)
        if s == 2:
            counts = (fused.traces, fused.compiles)
        assert _rel(ours, ref) <= TOL, f"step {s + 1}: parameters differ by {_rel(ours, ref):.3g}"
    assert (fused.traces, fused.compiles) == counts, "a hyperparameter change recompiled"
    for la, lb in zip(our_lists, ref_lists):
        assert len(la) == len(lb)
        for a, b in zip(la, lb):
            assert (a is None) == (b is None)
            if a is not None and a.dim() == 0:
                assert a.item() == b.item() and a.dtype == b.dtype
        tensors = [(a, b) for a, b in zip(la, lb) if a is not None and a.dim() > 0]
        if tensors:
            assert _rel([a for a, _ in tensors], [b for _, b in tensors]) <= TOL
    return fused


def _lr(s):
    return 1e-2 * (0.5 if s >= STEPS // 2 else 1.0) * (0.97 ** s)


def _steps(ps):
    return [torch.tensor(0.0) for _ in ps]  # torch.optim keeps step tensors on the CPU (not capturable)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("maximize", [False, True])
def test_adam(device, amsgrad, weight_decay, maximize):
    def lists(ps):
        z = lambda: [torch.zeros_like(p) for p in ps]  # noqa: E731
        return z(), z(), (z() if amsgrad else []), _steps(ps)

    def kw(s):
        return _kw(_single_tensor_adam, amsgrad=amsgrad, has_complex=False, beta1=0.9, beta2=0.99, lr=_lr(s),
                   weight_decay=weight_decay, eps=1e-8, maximize=maximize, capturable=False, differentiable=False,
                   decoupled_weight_decay=False)
    fused = _side_by_side(_single_tensor_adam, device, lists, kw, (None, None))
    assert fused.traces == 1 and fused.compiles == 1


@pytest.mark.skipif(not _accepts(_single_tensor_adam, "decoupled_weight_decay"),
                    reason="this torch's _single_tensor_adam has no decoupled_weight_decay")
def test_adam_decoupled():
    def lists(ps):
        return [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps], [], _steps(ps)

    def kw(s):
        return dict(amsgrad=False, has_complex=False, beta1=0.9, beta2=0.999, lr=_lr(s), weight_decay=0.05, eps=1e-8,
                    maximize=False, capturable=False, differentiable=False, decoupled_weight_decay=True)
    _side_by_side(_single_tensor_adam, "cpu", lists, kw, (None, None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("momentum,dampening,nesterov", [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.1, False),
                                                          (0.9, 0.0, True)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("maximize", [False, True])
def test_sgd(device, momentum, dampening, nesterov, weight_decay, maximize):
    # momentum buffers start as None: the function creates them (torch.clone(grad)) on the first step
    def lists(ps):
        return ([None] * len(ps),)

    def kw(s):
        return _kw(_single_tensor_sgd, weight_decay=weight_decay, momentum=momentum, lr=_lr(s), dampening=dampening,
                   nesterov=nesterov, maximize=maximize, has_sparse_grad=False)
    fused = _side_by_side(_single_tensor_sgd, device, lists, kw, (None, None))
    # the first step (buffers created) and later steps are two structures; without momentum, one
    assert fused.traces == (2 if momentum else 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay,maximize", [(0.0, False), (0.1, True)])
def test_rmsprop(device, centered, momentum, weight_decay, maximize):
    def lists(ps):
        z = lambda: [torch.zeros_like(p) for p in ps]  # noqa: E731
        return z(), (z() if centered else []), (z() if momentum else []), _steps(ps)

    def kw(s):
        return _kw(_single_tensor_rmsprop, lr=_lr(s), alpha=0.99, eps=1e-8, weight_decay=weight_decay,
                   momentum=momentum, centered=centered, maximize=maximize, differentiable=False, capturable=False,
                   has_complex=False)
    tail = (None, None) if _accepts(_single_tensor_rmsprop, "grad_scale") else ()
    _side_by_side(_single_tensor_rmsprop, device, lists, kw, tail)


def test_flag_change_is_a_new_trace_and_table_reuse():
    torch.manual_seed(1)
    ps = [torch.randn(4), torch.randn(3)]
    ea, es, st = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps], _steps(ps)
    fused = optfuse.torch.fuse(_single_tensor_adam)
    base = _kw(_single_tensor_adam, amsgrad=False, has_complex=False, beta1=0.9, beta2=0.99, lr=1e-3,
               weight_decay=0.0, eps=1e-8, maximize=False, capturable=False, differentiable=False,
               decoupled_weight_decay=False)
    grads = [torch.randn_like(p) for p in ps]
    fused(ps, grads, ea, es, [], st, None, None, **base)
    fused(ps, grads, ea, es, [], st, None, None, **dict(base, lr=5e-4))   # hyper: pushed
    assert (fused.traces, fused.compiles) == (1, 1)
    fused(ps, grads, ea, es, [], st, None, None, **dict(base, maximize=True))  # structure: traced again
    assert (fused.traces, fused.compiles) == (2, 2)
    assert [t.item() for t in st] == [3.0, 3.0]


def test_refusals():
    ps = [torch.randn(4)]
    kw = _kw(_single_tensor_adam, amsgrad=False, has_complex=False, beta1=0.9, beta2=0.99, lr=1e-3, weight_decay=0.0,
             eps=1e-8, maximize=False, capturable=False, differentiable=False, decoupled_weight_decay=False)
    lists = lambda: ([torch.randn(4)], [torch.randn(4)], [torch.zeros(4)], [torch.zeros(4)], [],  # noqa: E731
                     [torch.tensor(0.0)])
    fused = optfuse.torch.fuse(_single_tensor_adam)
    with pytest.raises(OptfuseError, match="grad_scale"):
        fused(*lists(), torch.tensor(2.0), None, **kw)
    with pytest.raises(OptfuseError, match="differentiable=True"):
        fused(*lists(), None, None, **dict(kw, differentiable=True))
    with pytest.raises(OptfuseError, match="int32|float32, float64"):
        fused([torch.ones(4, dtype=torch.int32)], [torch.ones(4, dtype=torch.int32)],
              [torch.zeros(4, dtype=torch.int32)], [torch.zeros(4, dtype=torch.int32)], [], [torch.tensor(0.0)],
              None, None, **kw)

    def norm_clip(params, grads, *, lr):
        for p, g in zip(params, grads):
            p.add_(g / g.norm(), alpha=-lr)
    with pytest.raises(OptfuseError, match="'norm'"):
        optfuse.torch.fuse(norm_clip)(ps, [torch.randn(4)], lr=0.1)

    def data_dependent(params, grads, *, lr):
        for p, g in zip(params, grads):
            if g.max() > 0:
                p.add_(g, alpha=-lr)
    with pytest.raises(OptfuseError, match="cannot be fused"):
        optfuse.torch.fuse(data_dependent)(ps, [torch.randn(4)], lr=0.1)


def test_hand_written_warmup_branch():
    """A Python branch on the step and a hyperparameter is traced both ways (a select)."""
    def warm_sgd(params, grads, bufs, steps, *, lr, warmup, beta):
        for p, g, b, s in zip(params, grads, bufs, steps):
            s += 1
            step = s.item()
            b.mul_(beta).add_(g)
            scale = step / warmup if step < warmup else 1.0
            p.add_(b, alpha=-lr * scale)
    torch.manual_seed(2)
    ps = [torch.randn(6), torch.randn(2, 2)]
    qs = [p.clone() for p in ps]
    bp, bq = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    sp, sq = _steps(ps), _steps(ps)
    fused = optfuse.torch.fuse(warm_sgd)
    for s in range(10):
        gs = [torch.randn_like(p) for p in ps]
        warm_sgd(ps, gs, bp, sp, lr=0.1, warmup=5.0, beta=0.9)
        fused(qs, gs, bq, sq, lr=0.1, warmup=5.0, beta=0.9)
        assert _rel(qs, ps) <= TOL
    assert [t.item() for t in sq] == [10.0, 10.0] and fused.traces == 1


def test_a_skipped_branch_side_is_checked_when_values_change():
    """rmsprop traced with momentum == 0 and no momentum buffers: its momentum > 0 side fails on the
    probe (an empty list) and is left out of the rule. Called later with momentum > 0 and still no
    buffers, torch's function raises IndexError; the fused one must refuse too, not step the
    momentum-free rule silently."""
    ps = [torch.randn(6)]
    sq, steps = [torch.zeros(6)], _steps(ps)
    fused = optfuse.torch.fuse(_single_tensor_rmsprop)
    tail = (None, None) if _accepts(_single_tensor_rmsprop, "grad_scale") else ()
    kw = _kw(_single_tensor_rmsprop, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
             maximize=False, differentiable=False, capturable=False, has_complex=False)
    fused(ps, [torch.randn(6)], sq, [], [], steps, *tail, **kw)
    fused(ps, [torch.randn(6)], sq, [], [], steps, *tail, **dict(kw, lr=5e-3))  # another value, same side: fine
    with pytest.raises(IndexError):
        _single_tensor_rmsprop([torch.randn(6)], [torch.randn(6)], [torch.zeros(6)], [], [], _steps([torch.randn(6)]),
                               *tail, **dict(kw, momentum=0.9))
    with pytest.raises(OptfuseError, match="raises IndexError"):
        fused(ps, [torch.randn(6)], sq, [], [], steps, *tail, **dict(kw, momentum=0.9))
