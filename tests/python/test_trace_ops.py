"""fuse() of optimizers that use ops the tracer maps onto optfuse's IR since issue 33 (optfuse.torch._trace):
sigmoid/tanh/relu (composed of exp), torch.full & co. (a filled tensor: one value), sums, means and
p-norms of a whole tensor (Op::Sum, Op::MaxAbs, the element count Op::Shape), reductions along dim= of a
matrix (row and column values), cosine_similarity (per tensor or per row), sizes used as numbers
(p.size(1): Op::Shape), and math that differs between vectors and matrices (a select on is_matrix). Each
traced optimizer runs the loop users write (zero_grad, new gradients every step), 20 steps, float32, and
must match its original within 1e-6 of the parameter scale; what the IR cannot express is refused with
the construct named. Third-party classes the issue names (timm, pytorch-optimizer) at the end."""
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import optfuse
import optfuse.torch as oft
from conftest import make_model, rel_diff, train, twin

STEPS = 20
TOL = 1e-6


class _Momentum(torch.optim.Optimizer):
    """m = 0.9 m + g; p -= lr * how(p, g, m): the op under test in `how`."""

    how = None

    def __init__(self, params, lr=0.05, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if "m" not in st:
                    st["m"] = torch.zeros_like(p)
                st["m"].mul_(g["beta"]).add_(p.grad)
                p.add_(type(self).how(p, p.grad, st["m"]), alpha=-g["lr"])


def _cls(how, name="Op"):
    return type(name, (_Momentum,), {"how": staticmethod(how)})


def _rows(x):
    """A per-row value as (rows, 1, ...): broadcasts over the parameter's rows."""
    return x.view(-1, *([1] * 1))


def _gc(g):
    """Gradient centralization (pytorch-optimizer's Ranger): minus the mean over every dimension but the first."""
    return g - g.mean(dim=tuple(range(1, g.dim())), keepdim=True) if g.dim() > 1 else g


def _row_cos_scaled(p, g, m):
    if p.dim() < 2:
        return m
    cos = F.cosine_similarity(g.view(g.size(0), -1), p.view(p.size(0), -1), dim=1, eps=1e-8)
    return m * (1 + _rows(cos))


def _adamp_like(p, g, m):
    """timm AdamP's projection: a Python branch on the largest per-row cosine against delta / sqrt(columns)."""
    if p.dim() < 2:
        return m
    view = p.view(p.size(0), -1)
    cos = F.cosine_similarity(g.view(g.size(0), -1), view, dim=1, eps=1e-8).abs_()
    if cos.max() < 1.5 / math.sqrt(view.size(1)):
        p_n = p / view.norm(p=2, dim=1).add_(1e-8).reshape(-1, 1)
        return m - p_n * (p_n * m).sum(dim=1).reshape(-1, 1)
    return m


MATCH = {
    # element-wise ops composed of IR ops
    "sigmoid": lambda p, g, m: torch.sigmoid(m) - 0.5,
    "sigmoid_": lambda p, g, m: (m - g).abs_().sigmoid_().mul_(m),  # DiffGrad's friction coefficient
    "tanh": lambda p, g, m: torch.tanh(3 * m),
    "relu": lambda p, g, m: torch.relu(m) - 0.5 * torch.relu(-m),
    "full": lambda p, g, m: m * torch.full(p.shape, 0.5),
    "full-0dim": lambda p, g, m: m.clamp(min=torch.full((), -0.2), max=torch.full((), 0.2)),
    "full_like": lambda p, g, m: torch.full_like(p, 0.3) * m,
    "new_ones": lambda p, g, m: p.new_ones(p.shape) * m,
    # whole-tensor reductions
    "sum": lambda p, g, m: m / (1 + g.sum().abs()),
    "abs-sum": lambda p, g, m: m / (1 + g.abs().sum()),
    "mean": lambda p, g, m: m - m.mean(),
    "mean-of-square": lambda p, g, m: m / (1 + 10 * g.pow(2).mean().sqrt()),  # an RMS (StableAdamW's)
    "norm-p1": lambda p, g, m: m / (1 + g.norm(p=1)),
    "norm-p4": lambda p, g, m: m / (g.norm(p=4) + 1e-3),  # ApolloDQN's
    "vector_norm-ord3": lambda p, g, m: m / (torch.linalg.vector_norm(g, ord=3) + 1e-3),
    "norm-inf": lambda p, g, m: m / (g.norm(p=float("inf")) + 1e-3),
    "abs-max": lambda p, g, m: m / (g.abs().max() + 1e-3),
    "norm-keepdim": lambda p, g, m: m / (g.norm(2, None, True) + 1e-3),
    "norm-of-filled": lambda p, g, m: m * (1 + torch.zeros_like(p).norm()),
    "numel": lambda p, g, m: m / (1 + 10 * g.norm() / p.numel() ** 0.5),
    "numel-branch": lambda p, g, m: m * 0.5 if p.numel() > 100 else m,
    "size": lambda p, g, m: m / math.sqrt(p.size(-1)),  # columns of a matrix, the count of a vector
    "shape-product": lambda p, g, m: m * (p.shape[0] / p.numel()),
    # along dimensions: rows and columns of a matrix
    "gradient-centralization": lambda p, g, m: _gc(m),
    "column-mean": lambda p, g, m: m - m.mean(dim=0, keepdim=True),
    "row-norm": lambda p, g, m: m / (m.norm(dim=-1, keepdim=True) + 1e-3),
    "column-sum-broadcast": lambda p, g, m: m / (1 + m.abs().sum(dim=0)),  # (cols,) broadcasts as (1, cols)
    "row-sum-of-squares": lambda p, g, m: m / (1 + (m * m).sum(dim=-1, keepdim=True)),
    # cosine similarity: per tensor (a (1, numel) view) and per row; the AdamP projection
    "cosine-layer": lambda p, g, m: m * (1 + F.cosine_similarity(g.view(1, -1), p.view(1, -1), dim=1)),
    "cosine-rows": _row_cos_scaled,
    "adamp-projection": _adamp_like,
    # conditions combined (FAdam's (rms > 0) & (eps2 * rms < eps)), nan_to_num (MSVAG's)
    "and": lambda p, g, m: torch.where((g > 0) & (m < 0.5), m, 0.5 * m),
    "or-not": lambda p, g, m: torch.where(~((g > 0.1) | (m < -0.2)), m, -m),
    "logical_and": lambda p, g, m: torch.where(torch.logical_and(g > 0, torch.logical_not(m > 1)), m, 0.1 * m),
    "nan_to_num": lambda p, g, m: torch.nan_to_num(m / (g * 0.0), nan=0.25, posinf=1.0, neginf=-1.0) * 0.1 + m,
    # masked_fill (FTRL's), F.normalize over a dimension (TAM's: columns of a matrix, the whole of a vector)
    "masked_fill": lambda p, g, m: m.clone().masked_fill_(m.abs() <= 0.3, 0.0),
    "normalize-dim0": lambda p, g, m: F.normalize(m, p=2.0, dim=0) * 0.1 + m,
    "normalize-rows": lambda p, g, m: F.normalize(m, dim=-1) * 0.1 + m,
    "normalize-of-zeros": lambda p, g, m: F.normalize(torch.zeros_like(m), dim=0) + m,
    "nan_to_num-out": lambda p, g, m: torch.nan_to_num((m - m) / (g - g), nan=0.5, out=torch.empty_like(m)) * m,
}


@pytest.mark.parametrize("op", list(MATCH), ids=list(MATCH))
def test_traced_op_matches(op):
    device = torch.device("cpu")
    make = lambda ps: _cls(MATCH[op])(ps)  # noqa: E731
    model = make_model(device)
    ref_model = twin(model)
    ours = oft.fuse(make(model.parameters()))
    assert type(ours).__name__ == "Traced"
    ref = make(ref_model.parameters())
    train(model, ours, STEPS, device)
    train(ref_model, ref, STEPS, device)
    assert rel_diff(model, make_model(device)) > 1e-3  # it trained
    d = rel_diff(model, ref_model)
    assert d <= TOL, f"{op}: {d:.3g}"


def test_adamp_projection_is_exercised():
    """The projection test above is not vacuous: some matrices take the branch and others not, and the
    result differs from never projecting."""
    model = make_model(torch.device("cpu"))
    taken = []

    def probe(p, g, m):
        if p.dim() >= 2:
            view = p.view(p.size(0), -1)
            cos = F.cosine_similarity(g.view(g.size(0), -1), view, dim=1, eps=1e-8).abs()
            taken.append(bool(cos.max() < 1.5 / math.sqrt(view.size(1))))
        return _adamp_like(p, g, m)

    a, b = twin(model), twin(model)
    train(a, _cls(probe)(a.parameters()), STEPS, torch.device("cpu"))
    train(b, _cls(lambda p, g, m: m)(b.parameters()), STEPS, torch.device("cpu"))
    assert True in taken and False in taken, taken
    assert rel_diff(a, b) > 1e-4


def test_matrix_only_math_is_a_select_on_is_matrix():
    """One param group, other math for matrices than for vectors: one rule, selected per tensor."""
    ours = oft.fuse(_cls(lambda p, g, m: _gc(m))(make_model(torch.device("cpu")).parameters()))
    text = oft.explain(ours)
    print(text)
    assert "is_matrix" in text.lower() or "ismatrix" in text.lower(), text


class _ThreeD(_Momentum):
    pass


@pytest.mark.parametrize("how,shape,match", [
    # a per-row value broadcast by position against (rows, cols): per column in torch, not the IR's row value
    (lambda p, g, m: m * m.norm(dim=1) if p.dim() == 2 else m, (6, 6), r"per-row value of shape \(4,\)"),
    # along dimensions of a 3-d parameter that are not its last (rows) or the one before (columns)
    (lambda p, g, m: m - m.mean(dim=(1, 2), keepdim=True), (3, 5, 6), r"mean\(\) with dim=\(1, 2\).*rows \(the last"),
    (lambda p, g, m: m / (1 + g.max()), (6, 6), r"max\(\).*no max/min reduction"),
    (lambda p, g, m: m / (1 + g.norm(p=float("-inf"))), (6, 6), r"norm\(p=-inf\).*smallest"),
    (lambda p, g, m: m * F.cosine_similarity(g.view(g.size(0), -1), p.view(p.size(0), -1), dim=1).max(),
     (6, 6), r"largest of per-row values .* other than in a comparison"),
    # the first dimension of a 4-d parameter: not a size the IR has per tensor
    (lambda p, g, m: m / math.sqrt(p.size(0)), (3, 4, 5, 6), r"dimension 0 of a tensor of shape \(3, 4, 4, 4\)"),
    (lambda p, g, m: m * torch.linalg.norm(p, ord=2), (6, 6), r"linalg.norm\(ord=2\).*matrix norm"),
], ids=["row-broadcast-as-column", "dims-of-3d", "max", "norm-minus-inf", "rowmax-as-value", "size-of-4d",
        "spectral"])
def test_refused_naming_the_construct(how, shape, match):
    p = torch.nn.Parameter(torch.randn(shape))
    with pytest.raises(optfuse.OptfuseError, match=f"Op cannot be fused: .*{match}"):
        oft.fuse(_cls(how)([p]))


# --- third-party classes the issue names (scripts/setup.sh installs timm and pytorch-optimizer)

def _kw(cls, **kw):
    if "foreach" in inspect.signature(cls).parameters:
        kw["foreach"] = False
    return kw


def _named(mod, names):
    try:
        m = __import__(mod, fromlist=["_"])
    except ImportError:
        return []
    return [(f"{mod}.{n}", getattr(m, n)) for n in names if hasattr(m, n)]


NAMED = (_named("timm.optim", ("MADGRAD", "AdamP", "SGDP", "Mars", "SGDW"))
         + _named("pytorch_optimizer", ("DiffGrad", "AdaBound", "AdaMod", "AdamP", "SGDP", "ApolloDQN", "StableAdamW",
                                        "LARS")))
EXTRA = [("timm.optim.SGDW-momentum", "timm.optim", "SGDW", dict(momentum=0.9)),
         ("timm.optim.AdamP-nesterov-wd", "timm.optim", "AdamP", dict(nesterov=True, weight_decay=0.01))]


def _run_third_party(cls, extra):
    device = torch.device("cpu")
    model = make_model(device)
    ref_model = twin(model)
    ours = oft.fuse(cls(model.parameters(), **_kw(cls, lr=1e-2, **extra)))
    ref = cls(ref_model.parameters(), **_kw(cls, lr=1e-2, **extra))
    train(model, ours, STEPS, device)
    train(ref_model, ref, STEPS, device)
    assert rel_diff(ref_model, make_model(device)) > 1e-3
    return rel_diff(model, ref_model), ours


@pytest.mark.skipif(not NAMED, reason="neither timm nor pytorch-optimizer is installed (scripts/setup.sh installs both)")
@pytest.mark.parametrize("name,cls", NAMED, ids=[n for n, _ in NAMED])
def test_issue_33_classes_match(name, cls):
    """Refused before (sigmoid_, torch.full, cosine_similarity, norm(p=4), mean(), KeyError 'x0', other
    math for vectors and matrices): now traced, and equal to the original over 20 steps."""
    d, ours = _run_third_party(cls, {})
    assert type(ours).__name__ == "Traced", type(ours)
    assert d <= TOL, f"{name}: {d:.3g}"


@pytest.mark.parametrize("name,mod,cls,extra", EXTRA, ids=[e[0] for e in EXTRA])
def test_issue_33_options_match(name, mod, cls, extra):
    """timm SGDW with momentum (its buffer is None on the momentum == 0 path: 'NoneType' object has no
    attribute 'data_ptr' before), AdamP with nesterov and weight decay."""
    m = pytest.importorskip(mod)
    d, _ = _run_third_party(getattr(m, cls), extra)
    assert d <= TOL, f"{name}: {d:.3g}"


@pytest.mark.parametrize("name,match", [
    ("Ranger", r"'%' of a hyperparameter- or step-dependent value \(by 6.0\) at .*ranger.py"),
    ("MADGRAD", r"an argument of type list at .*madgrad.py"),
])
def test_issue_33_still_refused_naming_the_construct(name, match):
    P = pytest.importorskip("pytorch_optimizer")
    cls = getattr(P, name)
    with pytest.raises(optfuse.OptfuseError, match=f"{name} cannot be fused: {match}"):
        oft.fuse(cls(make_model(torch.device("cpu")).parameters(), **_kw(cls, lr=1e-2)))


@pytest.mark.parametrize("name,kw,state,file", [
    ("RMSpropTF", dict(foreach=False), "momentum_buffer", "rmsprop_tf.py"),  # momentum 0: no buffer made
    ("MADGRAD", dict(momentum=0.0), "x0", "madgrad.py"),                     # momentum 0: no x0 made
], ids=["RMSpropTF", "MADGRAD-momentum0"])
def test_refused_naming_a_state_read_on_another_path(name, kw, state, file):
    """A state the first step creates only when an option is set, read on the path where the option is
    set later (the original would raise KeyError there): refused naming the read, not a bare KeyError."""
    T = pytest.importorskip("timm.optim")
    with pytest.raises(optfuse.OptfuseError, match=f"{name} cannot be fused: the step reads '{state}' at .*{file}"):
        oft.fuse(getattr(T, name)(make_model(torch.device("cpu")).parameters(), lr=1e-2, **kw))
