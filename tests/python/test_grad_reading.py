"""How a step reads the gradients: through torch.Tensor's DLPack C exchange API (torch >= 2.10) or,
without it, through Python method calls (python/bindings/dlpack_exchange.h, GradWatch in
python/bindings/optimizer.cpp). Both ways are run here on the loop users write, on gradients that move
in the ways torch allows (new tensors every step, a non-contiguous gradient, a gradient whose dtype
changes through param.grad_dtype, a gradient tensor re-pointed in place), against torch.optim.
"""
import pytest
import torch

import optfuse.torch as oft
from optfuse.torch import _reader
from conftest import loss_of, make_model, rel_diff, twin

STEPS = 12
TOL = 1e-6  # float32 on the CPU, as test_torch_parity.py
HAS_EXCHANGE = _reader.HAS_DLPACK_EXCHANGE


@pytest.fixture(params=["reader", "exchange", "methods"])
def reading(request):
    """Optimizers built inside the test read tensors the given way: optfuse._torch_reader (then the
    exchange API for what it leaves), the exchange API alone, or Python method calls; the default is
    restored after."""
    if request.param == "exchange" and not HAS_EXCHANGE:
        pytest.skip(f"torch {torch.__version__} has no DLPack C exchange API (__dlpack_c_exchange_api__)")
    if request.param == "reader" and not _reader.HAS_TORCH_READER:
        pytest.skip(_reader.why_not())
    assert _reader.read_through(request.param)
    yield request.param
    _reader.read_through("default")


def train(model, opt, after_backward=None, set_to_none=True, steps=STEPS):
    for s in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        loss_of(model, s, "cpu", torch.float32).backward()
        if after_backward is not None:
            after_backward(model, s)
        opt.step()


def assert_matches_torch(name, kw, after_backward=None, set_to_none=True):
    model = make_model("cpu")
    start, ref_model = twin(model), twin(model)
    ours = getattr(oft, name)(model.parameters(), **kw)
    ref = getattr(torch.optim, name)(ref_model.parameters(), foreach=False, **kw)
    train(model, ours, after_backward, set_to_none)
    train(ref_model, ref, after_backward, set_to_none)
    assert rel_diff(ref_model, start) > 1000 * TOL, "training barely moved the parameters"
    d = rel_diff(model, ref_model)
    assert d <= TOL, f"parameters differ from torch's by {d:.3g}"


@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-2)), ("SGD", dict(lr=0.05, momentum=0.9))])
def test_new_gradients_every_step(reading, name, kw):
    assert_matches_torch(name, kw)


def test_a_non_contiguous_gradient_on_some_steps(reading):
    def transpose_some(model, s):
        if s % 3 == 1:  # the same values, stored transposed: a rebuild reads them right
            w = model[0].weight
            w.grad = w.grad.t().contiguous().t()
            assert not w.grad.is_contiguous()
    assert_matches_torch("AdamW", dict(lr=1e-2), transpose_some)


def test_a_gradient_re_pointed_in_place():
    """The same gradient object moved to other memory (`grad.set_(...)`): the exchange API reads
    every gradient's pointer each step, so the step follows. (The method-call path only reads new
    gradient objects: docs/python.md lists this as its limitation.)"""
    if not HAS_EXCHANGE:
        pytest.skip(f"torch {torch.__version__} has no DLPack C exchange API")
    keep = []

    def re_point(model, s):
        w = model[0].weight
        stale = w.grad.detach()  # shares the storage the gradient leaves
        w.grad.set_(w.grad.clone())  # same object, new storage
        stale.zero_()  # a step that read the old storage would see a zero gradient
        keep.append(stale)
    # zero_grad(set_to_none=False): the gradient stays the very object of the last step
    assert_matches_torch("AdamW", dict(lr=1e-2), re_point, set_to_none=False)


def test_a_gradient_dtype_change_rebuilds(reading):
    """bfloat16 parameters whose gradients turn float32 (param.grad_dtype) after some steps: the
    kernel must read them as float32 from then on. Checked against the same optimizer given the
    float32 gradients from the start of a rebuild: both end bitwise equal."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip(f"torch {torch.__version__} has no Tensor.grad_dtype (torch >= 2.10)")
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(33, 7).to(torch.bfloat16)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa = oft.AdamW(a, lr=1e-2, master_weights=True)
    ob = oft.AdamW(b, lr=1e-2, master_weights=True)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        grads = [torch.randn(p.shape, generator=g) for p in a]
        if step == 3:  # a's gradients become float32 (torch wants .grad None while grad_dtype changes)
            oa.zero_grad()
            for p in a:
                p.grad_dtype = torch.float32
        for p, x in zip(a, grads):
            p.grad = x if step >= 3 else x.to(torch.bfloat16)
        for p, x in zip(b, grads):  # b: the float32 values rounded to bfloat16 the same way
            p.grad = x.to(torch.bfloat16)
        if step >= 3:
            assert a[0].grad.dtype == torch.float32
        oa.step()
        ob.step()
    # Until step 3 both are the same; after it a steps on unrounded float32 gradients: if its kernel
    # still read them as bfloat16 the result would be garbage, not merely a rounding away.
    ma = torch.cat([oa.state[p]["master_param"].flatten() for p in a])
    mb = torch.cat([ob.state[p]["master_param"].flatten() for p in b])
    assert torch.isfinite(ma).all()
    diff = (ma - mb).abs().max().item()
    assert 0 < diff < 1e-3, f"float32 and bfloat16 gradients gave masters {diff:.3g} apart"


def test_contiguous_gradients_with_odd_strides_on_size_one_dimensions(reading):
    """torch calls a tensor contiguous whatever the strides of its size-1 dimensions (and any empty
    tensor contiguous): such gradients are read in place, every step, as torch reads them."""
    torch.manual_seed(0)
    shapes = [(1, 5), (3, 1, 4), (0, 3), (7,)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    opt = oft.AdamW(ours, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(2)

    def odd(x):  # the same values, a size-1 dimension given stride 1000
        if x.dim() < 2 or 1 not in x.shape:
            return x
        strides = tuple(1000 if n == 1 else st for n, st in zip(x.shape, x.stride()))
        y = torch.empty(x.numel() * 1000 + 1).as_strided(x.shape, strides)
        y.copy_(x)
        assert y.is_contiguous() and y.stride() != x.stride()
        return y
    for step in range(6):
        for p, q in zip(ours, ref):
            x = odd(torch.randn(p.shape, generator=g))
            p.grad, q.grad = x, x.clone()
        opt.step()
        ref_opt.step()
    # New gradients of that layout only move pointers (1), they do not rebuild the tables (2)
    for p in ours:
        p.grad = odd(torch.randn(p.shape, generator=g))
    assert opt._watch.check(opt.state) == 1
    for p, q, s in zip(ours, ref, start):
        assert torch.allclose(p, q, rtol=0, atol=TOL), (p.shape, (p - q).abs().max())
        if p.numel():
            assert (q - s).abs().max() > 1000 * TOL, "training barely moved the parameters"
