"""optfuse.torch.Muon against torch.optim.Muon, and MuonWithAuxAdam against torch's Muon + AdamW.

Tolerance (NS_ABS, why the bound is what it is). Both sides run the same bfloat16 operations in
the same order: the momentum pass rounds as torch's lerp kernels do (fma form), the Newton-Schulz
iteration converts to bf16, divides by the clamped Frobenius norm and runs ns_steps quintic
iterations with bf16 products accumulated in float32, and the apply pass rounds as
p.mul_(1 - lr*wd); p.add_(O, alpha=-adjusted_lr) does. What differs is only the matrix-product
*implementation*: the core's batched GEMMs (cuBLAS; OpenBLAS sgemm on the CPU) or torch.bmm /
baddbmm over a stack of matrices, instead of torch's mm / addmm per matrix. A GEMM that sums the
same float32 products in another order rounds some bf16 entries of G, U or X the other way, and
the iterations carry that on. Measured max |dO| per matrix (O's entries are at most ~0.6 here):
  - H200, torch 2.11: torch's own batched bmm against its per-matrix mm, 24x12 and 12x24 matrices:
    up to 2.3e-2 (6 bf16 ulps); 0 for 24x24, 128x128, 256x64, 64x256;
  - CPU, torch 2.15: the core's OpenBLAS products against torch's mm: 0 for 24x12 .. 24x24,
    3.9e-3 to 7.8e-3 for 128x128, 256x64, 768x768 (5 and 6 steps).
NS_ABS = 3e-2 covers those. A parameter moves by adjusted_lr * O per step, so after STEPS steps
optfuse and torch may be STEPS * adjusted_lr * NS_ABS apart element-wise before feedback (a
parameter difference changes the next gradients, and Newton-Schulz amplifies a change of its input
along small singular directions). Measured worst against that bound: 0.8 of it (the grid's
ns_steps=6 configuration on the H200, core products, 3.4e-4), 0.4 on the CPU. The element-wise
passes are bitwise torch's.

The training runs make a fresh gradient every step (zero_grad, forward, backward, step) on a
bias-free MLP whose hidden matrices share shapes (so buckets hold several matrices):
12 -> 24 -> 24 -> 24 -> 5.
"""
import collections
import copy
import math

import pytest
import torch

import optfuse.torch as oft
from conftest import HAS_CUDA, NO_CUDA_REASON, SUMMARY, batch
from optfuse.torch._muon import _Bucket

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)
TorchMuon = getattr(torch.optim, "Muon", None)
pytestmark = pytest.mark.skipif(TorchMuon is None, reason=f"torch {torch.__version__} has no torch.optim.Muon")

@pytest.fixture(autouse=True, params=["core", "torch"])
def matrix_phase(request, monkeypatch):
    """Every test runs with each matrix phase Muon can take: the core's (optfuse._core.NewtonSchulz:
    cuBLAS, OpenBLAS on the CPU; the default on CUDA) and torch's batched bmm (the default on the CPU)."""
    if request.param == "core":
        from optfuse import _core
        params = getattr(request.node, "callspec", None)
        device = str(params.params.get("device", "cpu")) if params else "cpu"
        ok, why = _core.gemm_available("cuda" if device.startswith("cuda") else "cpu")
        if not ok and not (device.startswith("cuda") and not HAS_CUDA):  # (CUDA tests skip below anyway)
            pytest.skip(f"the core's matrix phase cannot run on {device} here: {why}")
    monkeypatch.setenv("OPTFUSE_MUON_MATMUL", request.param)
    return request.param


STEPS = 10
NS_ABS = 3e-2           # see the module docstring
ADAMW_REL = 1e-6        # optfuse AdamW vs torch AdamW (test_optim_db.py's float32 tolerance)
NS_DEFAULT = ((3.4445, -4.7750, 2.0315), 5, 1e-7)


def make_mlp(device, dtype=torch.float32, seed=0, bias=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24, bias=bias), torch.nn.Tanh(),
                                torch.nn.Linear(24, 24, bias=bias), torch.nn.Tanh(),
                                torch.nn.Linear(24, 24, bias=bias), torch.nn.Tanh(),
                                torch.nn.Linear(24, 5, bias=bias))
    return model.to(device=device, dtype=dtype)


def train(model, opt, steps, device, start=0, scheduler=None, dtype=torch.float32):
    for s in range(start, start + steps):
        opt.zero_grad()
        x, y = batch(s, device, dtype)
        torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def max_abs(a, b):
    return max((x.detach().float() - y.detach().float()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


def max_adjusted_lr(model, lr, fn):
    from optfuse.torch._muon import adjusted_lr_ratio
    return float(lr) * max(adjusted_lr_ratio(fn, p.shape) for p in model.parameters() if p.ndim == 2)


def bound(model, kwargs, steps=STEPS):
    return steps * max_adjusted_lr(model, kwargs.get("lr", 1e-3), kwargs.get("adjust_lr_fn")) * NS_ABS


def buffers_diff(ours, ref):
    a, b = ours.state_dict()["state"], ref.state_dict()["state"]
    assert a.keys() == b.keys()
    out = 0.0
    for i in b:
        assert set(a[i]) == set(b[i]) == {"momentum_buffer"}
        out = max(out, (a[i]["momentum_buffer"].float() - b[i]["momentum_buffer"].float()).abs().max().item())
    return out


# ---------------------------------------------------------------- torch's optim_db grid
common_optimizers = pytest.importorskip(
    "torch.testing._internal.common_optimizers",
    reason="torch's optim_db needs the expecttest package (scripts/setup.sh installs it)")
MUON_INFO = next((i for i in common_optimizers.optim_db if i.optim_cls.__name__ == "Muon"), None)


def test_grid_matches_torch(device, matrix_phase, record_property):
    """Every configuration of torch's optim_db grid for Muon, 10 steps, new gradients every step."""
    inputs = MUON_INFO.optim_inputs_func(device=device, dtype=torch.float32)
    assert len(inputs) >= 7  # the grid itself, not a remnant of it (7 configurations in torch 2.11, 8 in 2.15)
    lines, worst = [], 0.0
    for inp in inputs:
        assert inp.params is None
        kw = inp.kwargs
        if torch.is_tensor(kw.get("lr")):
            kw = dict(kw, lr=kw["lr"].to(device))
        ref_model, ours_model = make_mlp(device), make_mlp(device)
        start = make_mlp(device)
        ref = TorchMuon(ref_model.parameters(), **copy.deepcopy(kw))
        ours = oft.Muon(ours_model.parameters(), **copy.deepcopy(kw))
        assert ours.param_groups[0].keys() == ref.param_groups[0].keys()
        train(ref_model, ref, STEPS, device)
        train(ours_model, ours, STEPS, device)
        d, tol = max_abs(ours_model, ref_model), bound(ref_model, kw)
        moved = max_abs(ref_model, start)
        bd = buffers_diff(ours, ref)
        worst = max(worst, d)
        lines.append(f"  {inp.desc!r}: max|dp| {d:.3g} (bound {tol:.3g}, moved {moved:.3g}), max|dbuf| {bd:.3g}")
        assert d <= tol, lines[-1]
        assert moved > 10 * tol, f"{inp.desc}: training moved the parameters by only {moved:.3g}"
        # the buffers see the gradients of parameters that may differ by `tol`: same bound, in units
        # of the gradient (a gradient entry here is at most ~1)
        assert bd <= tol / max_adjusted_lr(ref_model, kw.get("lr", 1e-3), kw.get("adjust_lr_fn")) * STEPS, lines[-1]
    record_property(SUMMARY, f"optim_db Muon on {device.type} ({matrix_phase} matrix phase): {len(inputs)} "
                    f"configurations, max |p_ours - p_torch| = {worst:.3g}")  # printed at the end (conftest)
    print("\n".join(lines))  # captured: shown with -s or -rP


def test_grid_error_inputs_refused_like_torch(device):
    errors = MUON_INFO.optim_error_inputs_func(device=device, dtype=torch.float32)
    counts = collections.Counter()
    for err in errors:
        inp = err.optimizer_error_input
        params = inp.params if inp.params is not None else [torch.nn.Parameter(torch.randn(2, 3, device=device))]
        make = (lambda: oft.Muon(params, **copy.deepcopy(inp.kwargs)))
        if err.error_on == common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR:
            ctx = (pytest.warns if issubclass(err.error_type, Warning) else pytest.raises)(err.error_type,
                                                                                          match=err.error_regex)
            with ctx:
                make()
            counts["construction"] += 1
        else:
            opt = make()
            with pytest.raises(err.error_type, match=err.error_regex):
                opt.step()
            counts["step"] += 1
    assert sum(counts.values()) == len(errors) and counts["step"] >= 1


# ---------------------------------------------------------------- errors, arguments
@pytest.mark.parametrize("shape", [(3,), (2, 3, 4), ()])
def test_non_2d_parameters_refused_with_torchs_error(shape):
    p = torch.nn.Parameter(torch.randn(shape))
    with pytest.raises(ValueError) as theirs:
        TorchMuon([p])
    with pytest.raises(ValueError) as ours:
        oft.Muon([p])
    assert str(ours.value) == str(theirs.value)
    assert "Muon only supports 2D parameters" in str(ours.value)


def test_defaults_and_signature_match_torch():
    p = torch.nn.Parameter(torch.randn(3, 4))
    assert oft.Muon([p]).defaults == TorchMuon([p]).defaults
    for bad in (dict(lr=-1.0), dict(momentum=-0.1), dict(weight_decay=-1.0), dict(adjust_lr_fn="nope")):
        with pytest.raises(ValueError) as theirs:
            TorchMuon([p], **bad)
        with pytest.raises(ValueError) as ours:
            oft.Muon([p], **bad)
        assert str(ours.value) == str(theirs.value)


def test_ns_settings_errors_at_step_like_torch():
    for group, msg in ((dict(ns_steps=100), "Number of steps must be less than 100"),
                       (dict(ns_coefficients=(1.0, 2.0)), "Coefficients must be a tuple of exactly 3 values")):
        p = torch.nn.Parameter(torch.randn(3, 4))
        p.grad = torch.randn(3, 4)
        before = p.detach().clone()
        opt = oft.Muon([p], **group)
        with pytest.raises(ValueError, match=msg):
            opt.step()
        assert torch.equal(p.detach(), before)  # nothing moved


def test_float64_parameters_refused():
    with pytest.raises(oft.OptfuseError, match="float32, float16 or bfloat16"):
        oft.Muon([torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))])


# ---------------------------------------------------------------- the matrix phase
def _torch_ns(G, coefficients, steps, eps):
    from torch.optim._muon import _zeropower_via_newtonschulz
    import inspect
    extra = {"use_addmm": True} if "use_addmm" in inspect.signature(_zeropower_via_newtonschulz).parameters else {}
    return _zeropower_via_newtonschulz(G, coefficients, steps, eps, **extra)


def _run_matrix_phase(X):
    """X (B, m, n) float32 through the matrix phase optfuse.torch.Muon runs (the engine the
    matrix_phase fixture chose: the core's or torch's batched bmm), as a new tensor."""
    bucket = _Bucket(X.device, X.dtype, tuple(X.shape[1:]), NS_DEFAULT + (True,), X.shape[0])
    bucket.scratch.copy_(X)
    bucket.orthogonalise()
    return bucket.scratch


@pytest.mark.parametrize("shape", [(24, 12), (12, 24), (24, 24), (128, 128), (256, 64), (64, 256)])
def test_batched_newton_schulz_equals_per_matrix(device, shape, matrix_phase):
    """The batched matrix phase against torch's own per-matrix function, matrix by matrix: within
    NS_ABS (a GEMM's summation order); the measured difference is printed."""
    torch.manual_seed(1)
    X = torch.randn((6,) + shape, device=device)
    X[2] *= 1e-3  # scales differ across the batch: each matrix has its own norm
    X[4].zero_()  # a zero update: the clamp to eps, no NaN
    got = _run_matrix_phase(X)
    assert got.dtype == torch.float32 and got.shape == X.shape
    assert torch.equal(got, got.bfloat16().float())  # bf16 values
    diffs = []
    for i in range(X.shape[0]):
        ref = _torch_ns(X[i], *NS_DEFAULT)
        diffs.append((got[i] - ref.float()).abs().max().item())
    assert torch.isfinite(got).all()
    assert got[4].abs().max().item() == 0
    print(f"{matrix_phase} matrix phase vs torch per matrix, {shape} on {device.type}: max |dO| per matrix {diffs}")
    assert max(diffs) <= NS_ABS


def test_batched_newton_schulz_is_orthogonalising():
    """A sanity check of the math itself: singular values land in torch's (0.5, 1.5) band."""
    torch.manual_seed(2)
    X = torch.randn(4, 64, 32)
    s = torch.linalg.svdvals(_run_matrix_phase(X))
    assert s.min().item() > 0.5 and s.max().item() < 1.5


# ---------------------------------------------------------------- the element-wise passes
def test_momentum_and_apply_passes_exact_with_given_gradients(device):
    """Gradients given directly (not from a model), so the momentum buffers do not depend on the
    matrix phase: buffers bitwise torch's on the CPU (the pass rounds as torch's fma-form lerp);
    parameters within one step's NS bound per step, measured 0 here. Same-shape matrices in one
    bucket, a tall and a wide one, weight decay large enough to matter, Nesterov on and off."""
    torch.manual_seed(3)
    shapes = [(16, 8), (8, 16), (16, 8), (16, 16), (16, 8)]
    for kw in (dict(lr=0.05, weight_decay=0.3), dict(lr=0.05, weight_decay=0.3, nesterov=False, momentum=0.3)):
        init = [torch.randn(s, device=device) for s in shapes]
        a = [torch.nn.Parameter(t.clone()) for t in init]
        b = [torch.nn.Parameter(t.clone()) for t in init]
        ref, ours = TorchMuon(a, **kw), oft.Muon(b, **kw)
        for step in range(STEPS):
            grads = [torch.randn(s, device=device) for s in shapes]
            for x, y, g in zip(a, b, grads):
                x.grad, y.grad = g.clone(), g.clone()
            ref.step()
            ours.step()
            for x, y in zip(a, b):
                bx, by = ref.state[x]["momentum_buffer"], ours.state[y]["momentum_buffer"]
                if device.type == "cpu":
                    assert torch.equal(bx, by)
                else:  # torch's CUDA lerp is nvcc-contracted into the same fmas; allow one ulp
                    assert torch.allclose(bx, by, rtol=2 ** -23, atol=0)
        d = max((x - y).abs().max().item() for x, y in zip(a, b))
        print(f"given gradients {kw} on {device.type}: max|dp| {d:.3g}")
        assert d <= STEPS * kw["lr"] * math.sqrt(2) * NS_ABS


def test_parameters_without_gradient_are_skipped_and_rejoin():
    """As torch: a parameter without .grad keeps its value and buffer; it rejoins when it has one."""
    ref_model, ours_model = make_mlp("cpu"), make_mlp("cpu")
    ref, ours = TorchMuon(ref_model.parameters(), lr=0.02), oft.Muon(ours_model.parameters(), lr=0.02)
    for s in range(6):
        for model, opt in ((ref_model, ref), (ours_model, ours)):
            opt.zero_grad()
            x, y = batch(s, "cpu")
            torch.nn.functional.mse_loss(model(x), y).backward()
            if s in (2, 3):
                model[2].weight.grad = None
            opt.step()
    assert max_abs(ours_model, ref_model) <= bound(ref_model, dict(lr=0.02), steps=6)
    assert buffers_diff(ours, ref) <= 6 * NS_ABS


# ---------------------------------------------------------------- state dicts, schedulers
def test_state_dict_round_trip_and_torch_interchange(device):
    kw = dict(lr=0.02, weight_decay=0.05)
    ours_model = make_mlp(device)
    ours = oft.Muon(ours_model.parameters(), **kw)
    train(ours_model, ours, 5, device)
    sd = ours.state_dict()
    assert all(set(s) == {"momentum_buffer"} for s in sd["state"].values())
    assert sd["param_groups"][0].keys() == TorchMuon(make_mlp(device).parameters(), **kw).state_dict()[
        "param_groups"][0].keys()

    # reload into a fresh optfuse Muon: continues bitwise like the original
    again_model = copy.deepcopy(ours_model)
    again = oft.Muon(again_model.parameters(), **kw)
    again.load_state_dict(copy.deepcopy(sd))
    # ... and into torch.optim.Muon: continues like the original within the bound
    torch_model = copy.deepcopy(ours_model)
    theirs = TorchMuon(torch_model.parameters(), **kw)
    theirs.load_state_dict(copy.deepcopy(sd))
    train(ours_model, ours, 5, device, start=5)
    train(again_model, again, 5, device, start=5)
    train(torch_model, theirs, 5, device, start=5)
    assert max_abs(again_model, ours_model) == 0
    assert max_abs(torch_model, ours_model) <= bound(ours_model, kw, steps=5)

    # a torch.optim.Muon state dict loaded into optfuse's
    ref_model = make_mlp(device)
    ref = TorchMuon(ref_model.parameters(), **kw)
    train(ref_model, ref, 5, device)
    mine_model = copy.deepcopy(ref_model)
    mine = oft.Muon(mine_model.parameters(), **kw)
    mine.load_state_dict(copy.deepcopy(ref.state_dict()))
    train(ref_model, ref, 5, device, start=5)
    train(mine_model, mine, 5, device, start=5)
    d = max_abs(mine_model, ref_model)
    print(f"torch state dict loaded into optfuse Muon on {device.type}: max|dp| after 5 more steps {d:.3g}")
    assert d <= bound(ref_model, kw, steps=5)
    assert buffers_diff(mine, ref) <= 5 * NS_ABS


def test_lr_scheduler_and_tensor_lr(device):
    for lr in (0.05, torch.tensor(0.05)):
        ref_model, ours_model = make_mlp(device), make_mlp(device)
        ref = TorchMuon(ref_model.parameters(), lr=copy.deepcopy(lr))  # a scheduler fills a tensor lr in place
        ours = oft.Muon(ours_model.parameters(), lr=copy.deepcopy(lr))
        sched_ref = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
        sched_ours = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.5)
        train(ref_model, ref, STEPS, device, scheduler=sched_ref)
        train(ours_model, ours, STEPS, device, scheduler=sched_ours)
        assert float(ours.param_groups[0]["lr"]) == float(ref.param_groups[0]["lr"]) == pytest.approx(0.05 * 0.5 ** 5)
        assert max_abs(ours_model, ref_model) <= bound(ref_model, dict(lr=0.05))
        # and the schedule mattered: a run without it ends elsewhere
        flat_model = make_mlp(device)
        train(flat_model, oft.Muon(flat_model.parameters(), lr=0.05), STEPS, device)
        assert max_abs(flat_model, ours_model) > 5 * bound(ref_model, dict(lr=0.05))


def test_bfloat16_parameters(device):
    """bf16 parameters. The passes round where torch's kernels do (buffer, Nesterov mix, decayed
    parameter; on the CPU alpha rounded to bf16, and alpha * u too for transposed updates), and
    with given gradients the result is bitwise torch's on the CPU (test above, in float32; checked
    by hand in bf16). Not in every element: torch's CPU add_ rounds alpha * u to bf16 in its scalar
    tail loop (the last numel % vector-width elements) but not in its vector loop, which an
    element-wise rule cannot tell apart; one such ulp (measured: 1 element of the 5x24 matrix at
    step 3) and the bf16 forward/backward carry it on. So, as the bf16 parity tests of the other
    optimizers (docs/python.md): optfuse's bf16 run must be no farther from the float32 run than
    torch's own bf16 run is (up to 25% + the NS bound), and within 5e-2 of torch's bf16 run
    relative to the weights (measured on this CPU: 1.2e-2 absolute, weights up to 0.34)."""
    kw = dict(lr=0.02)
    runs = {}
    for name, cls, dtype in (("torch32", TorchMuon, torch.float32), ("torch16", TorchMuon, torch.bfloat16),
                             ("ours16", oft.Muon, torch.bfloat16)):
        model = make_mlp(device, dtype)
        train(model, cls(model.parameters(), **kw), STEPS, device, dtype=dtype)
        runs[name] = model
    d = max_abs(runs["ours16"], runs["torch16"])
    ours_f32, torch_f32 = max_abs(runs["ours16"], runs["torch32"]), max_abs(runs["torch16"], runs["torch32"])
    wmax = max(p.abs().max().item() for p in runs["torch32"].parameters())
    print(f"bfloat16 on {device.type}: max|dp| vs torch bf16 {d:.3g}; from float32: ours {ours_f32:.3g}, "
          f"torch's {torch_f32:.3g}")
    assert ours_f32 <= 1.25 * torch_f32 + bound(runs["torch32"], kw)
    assert d <= 5e-2 * wmax


# ---------------------------------------------------------------- MuonWithAuxAdam
def _aux_groups(model, muon_kw, adam_kw):
    hidden = [p for p in model.parameters() if p.ndim == 2]
    other = [p for p in model.parameters() if p.ndim != 2]
    return [dict(params=hidden, use_muon=True, **muon_kw), dict(params=other, use_muon=False, **adam_kw)]


MUON_KW = dict(lr=0.02, weight_decay=0.01)
ADAM_KW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.01)


class _Both:
    """Several optimizers stepped as one."""

    def __init__(self, opts):
        self.opts = opts

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()

    def step(self):
        for o in self.opts:
            o.step()


def train_given_gradients(model, opt, steps, device, seed=5):
    """zero_grad, then a new seeded random gradient tensor for every parameter, then step: the loop
    without a model's feedback, so a difference in one parameter does not reach the others."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        opt.step()


def test_aux_adam_equals_its_parts_and_torch(device):
    """MuonWithAuxAdam == optfuse Muon + optfuse AdamW stepped separately (bitwise: the same kernels),
    training a model. Against torch.optim.Muon + torch.optim.AdamW, with given gradients (a model's
    would carry the Muon part's Newton-Schulz differences into the AdamW parameters' gradients): the
    Muon part within the NS bound, the AdamW part within ADAMW_REL relative (optfuse's AdamW is not
    bitwise torch's: its lerp op rounds the product before adding, where torch's lerp kernels are an
    fma; 1-2 ulp, measured 3e-8 abs)."""
    models = [make_mlp(device, bias=True) for _ in range(4)]
    aux = oft.MuonWithAuxAdam(_aux_groups(models[0], MUON_KW, ADAM_KW))
    g1 = _aux_groups(models[1], MUON_KW, ADAM_KW)
    parts = [oft.Muon(g1[0]["params"], **MUON_KW), oft.AdamW(g1[1]["params"], **ADAM_KW)]
    train(models[0], aux, STEPS, device)
    train(models[1], _Both(parts), STEPS, device)
    assert max_abs(models[0], models[1]) == 0

    aux = oft.MuonWithAuxAdam(_aux_groups(models[2], MUON_KW, ADAM_KW))
    g3 = _aux_groups(models[3], MUON_KW, ADAM_KW)
    torch_parts = [TorchMuon(g3[0]["params"], **MUON_KW), torch.optim.AdamW(g3[1]["params"], foreach=False, **ADAM_KW)]
    train_given_gradients(models[2], aux, STEPS, device)
    train_given_gradients(models[3], _Both(torch_parts), STEPS, device)
    w = [(a, b) for a, b in zip(models[2].parameters(), models[3].parameters()) if a.ndim == 2]
    v = [(a, b) for a, b in zip(models[2].parameters(), models[3].parameters()) if a.ndim != 2]
    dw = max((a - b).abs().max().item() for a, b in w)
    dv = max((a - b).abs().max().item() for a, b in v) / max(b.abs().max().item() for _, b in v)
    print(f"MuonWithAuxAdam vs torch on {device.type}: Muon part max|dp| {dw:.3g}, AdamW part rel {dv:.3g}")
    assert dw <= bound(models[3], MUON_KW)
    assert dv <= ADAMW_REL
    # the state is torch's format per parameter
    sd = aux.state_dict()
    keys = [set(s) for _, s in sorted(sd["state"].items())]
    assert keys.count({"momentum_buffer"}) == 4 and keys.count({"step", "exp_avg", "exp_avg_sq"}) == 4
    assert [g["use_muon"] for g in sd["param_groups"]] == [True, False]


def test_aux_adam_state_dict_round_trip_and_scheduler(device):
    model = make_mlp(device, bias=True)
    opt = oft.MuonWithAuxAdam(_aux_groups(model, MUON_KW, ADAM_KW))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    train(model, opt, 4, device, scheduler=sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(MUON_KW["lr"] / 5)
    assert opt.param_groups[1]["lr"] == pytest.approx(ADAM_KW["lr"] / 5)
    sd = copy.deepcopy(opt.state_dict())
    assert all(float(s["step"]) == 4 for s in sd["state"].values() if "step" in s)

    other = copy.deepcopy(model)
    opt2 = oft.MuonWithAuxAdam(_aux_groups(other, dict(lr=1.0), dict(lr=1.0)))  # overwritten by the load
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    train(model, opt, 4, device, start=4)
    train(other, opt2, 4, device, start=4)
    assert max_abs(model, other) == 0
    sd2 = opt2.state_dict()
    assert all(float(s["step"]) == 8 for s in sd2["state"].values() if "step" in s)

    with pytest.raises(ValueError, match="use_muon"):
        bad = copy.deepcopy(sd)
        bad["param_groups"][0]["use_muon"] = False
        opt2.load_state_dict(bad)


def test_aux_adam_needs_use_muon():
    p = torch.nn.Parameter(torch.randn(3, 4))
    with pytest.raises(ValueError, match="use_muon"):
        oft.MuonWithAuxAdam([dict(params=[p])])
    with pytest.raises(ValueError, match="2D parameters"):
        oft.MuonWithAuxAdam([dict(params=[torch.nn.Parameter(torch.randn(3))], use_muon=True)])


# ---------------------------------------------------------------- CPU and CUDA agree
@requires_cuda
def test_cpu_and_cuda_paths_agree():
    kw = dict(lr=0.02, weight_decay=0.05)
    cpu_model, cuda_model = make_mlp("cpu"), make_mlp("cuda")
    train(cpu_model, oft.Muon(cpu_model.parameters(), **kw), STEPS, "cpu")
    train(cuda_model, oft.Muon(cuda_model.parameters(), **kw), STEPS, "cuda")
    d = max((a.detach() - b.detach().cpu()).abs().max().item()
            for a, b in zip(cpu_model.parameters(), cuda_model.parameters()))
    print(f"optfuse Muon CPU vs CUDA: max|dp| {d:.3g}")
    # two GEMM implementations (torch's CPU BLAS, cuBLAS) and two forward/backward passes
    assert d <= bound(cpu_model, kw)


def test_grad_scaler_unscales_and_skips_like_torch(device):
    """torch.amp.GradScaler with Muon takes torch's standard path (Muon, like torch.optim.Muon, does
    not take grad_scale/found_inf itself): the scaler unscales the gradients in place and steps only
    when they are finite. optfuse.Muon then matches torch.optim.Muon step for step, an inf in one
    step's gradients skips it for both, and both scalers end at the same, lowered scale."""
    import torch.nn.functional as F
    ref_model, ours_model = make_mlp(device), make_mlp(device)
    ref = torch.optim.Muon(ref_model.parameters(), lr=0.02)
    ours = oft.Muon(ours_model.parameters(), lr=0.02)
    scalers = [torch.amp.GradScaler(device.type, init_scale=2.0 ** 8) for _ in range(2)]
    for s in range(STEPS):
        for model, opt, scaler in ((ref_model, ref, scalers[0]), (ours_model, ours, scalers[1])):
            opt.zero_grad()
            x, y = batch(s, device)
            scaler.scale(F.mse_loss(model(x), y)).backward()
            if s == 3:
                next(model.parameters()).grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() < 2.0 ** 8  # the inf step was seen and skipped
    assert max_abs(ours_model, make_mlp(device)) > 1e-3  # training moved the weights
    assert max_abs(ours_model, ref_model) <= bound(ours_model, dict(lr=0.02))
    assert buffers_diff(ours, ref) <= NS_ABS


@requires_cuda
def test_cuda_graph_capture_is_refused_clearly():
    """Capturing a Muon step would replay the capture-time hyperparameters for ever (they are pushed
    from the host each step): refused with a clear error, and eager steps work afterwards."""
    model = make_mlp(torch.device("cuda"))
    opt = oft.Muon(model.parameters(), lr=0.02)
    train(model, opt, 2, torch.device("cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with pytest.raises(oft.OptfuseError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph, stream=side):
                opt.step()
    torch.cuda.current_stream().wait_stream(side)
    train(model, opt, 1, torch.device("cuda"), start=2)  # eager steps still work


# ---------------------------------------------------------------- the core's muon chain
def test_core_muon_chain_matches_torch_with_given_gradients(device):
    """optfuse.MatrixChainOptimizer("muon(...)") (the C++ chain: part 1, the core's matrix phase,
    part 2) on torch tensors through DLPack, against torch.optim.Muon with the same new gradient
    tensors every step: within the NS bound (its element math rounds like optfuse's built-in lerp
    and multiply-then-add, within an ulp of torch's fused forms)."""
    import optfuse
    ok, why = optfuse._core.gemm_available(device.type)
    if not ok:
        pytest.skip(f"the core's matrix phase cannot run on {device.type} here: {why}")
    torch.manual_seed(4)
    shapes = [(24, 40), (40, 24), (24, 40), (16, 16)]
    init = [torch.randn(s, device=device) * 0.1 for s in shapes]
    ours = [t.clone() for t in init]
    bufs = [torch.zeros_like(t) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    torch_opt = TorchMuon(ref, **kw)
    opt = optfuse.MatrixChainOptimizer("muon(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr=1)", device.type)
    assert opt.state_names == ["momentum_buffer"]
    assert "matrix: newton_schulz" in opt.describe()
    gen = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
        torch_opt.zero_grad()
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        torch_opt.step()
        opt.set_tensors([(p, g, [b]) for p, g, b in zip(ours, grads, bufs)])
        opt.step(None if device.type == "cpu" else torch.cuda.current_stream().cuda_stream)
    assert opt.step_count(0) == STEPS
    d = max((a - b.detach()).abs().max().item() for a, b in zip(ours, ref))
    db = max((a - torch_opt.state[p]["momentum_buffer"]).abs().max().item() for a, p in zip(bufs, ref))
    moved = max((a - b).abs().max().item() for a, b in zip(ours, init))
    bound_here = STEPS * 0.02 * 0.2 * math.sqrt(40) * NS_ABS
    print(f"core muon chain vs torch.optim.Muon on {device.type}: max|dp| {d:.3g} (bound {bound_here:.3g}, moved "
          f"{moved:.3g}), max|dbuf| {db:.3g}")
    assert d <= bound_here
    assert db <= 1e-5  # the buffers see the same gradients: float32 lerp roundings only
    assert moved > 10 * d


def test_core_muon_chain_refuses_bad_input():
    import numpy as np
    import optfuse
    if not optfuse._core.gemm_available("cpu")[0]:
        pytest.skip("no CPU GEMM library here")
    opt = optfuse.MatrixChainOptimizer("muon()", "cpu")
    p = np.zeros((4, 6), np.float32)
    with pytest.raises(optfuse.OptfuseError, match="2-D matrices"):
        opt.set_tensors([(np.zeros(24, np.float32), np.zeros(24, np.float32), [np.zeros(24, np.float32)])])
    with pytest.raises(optfuse.OptfuseError, match="states must be a list of 1"):
        opt.set_tensors([(p, p.copy(), [])])
    with pytest.raises(optfuse.OptfuseError, match="read-only"):
        ro = p.copy()
        ro.flags.writeable = False
        opt.set_tensors([(ro, p.copy(), [p.copy()])])
    with pytest.raises(optfuse.OptfuseError, match="MatrixChainOptimizer"):
        optfuse.Optimizer("muon()", "cpu")
    with pytest.raises(optfuse.OptfuseError, match="no hyperparameter 'betas'"):
        opt.set_hyper(0, "betas", 0.9)
