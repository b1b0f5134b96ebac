"""torch's own optimizer test grid against every optfuse.torch drop-in.

torch.testing._internal.common_optimizers.optim_db lists, per torch.optim class, the constructor
configurations torch tests itself with (OptimizerInfo.optim_inputs_func) and the inputs its
constructor must refuse (optim_error_inputs_func). For every class with an optfuse.torch drop-in
this runs each configuration, 20 steps on conftest's MLP with new gradients every step (zero_grad,
forward, backward, step), optfuse's class against torch's for-loop implementation (foreach=False):
max|p_ours - p_torch| / max|p_torch| <= 1e-6 on CPU (2e-6 on CUDA, see test_torch_parity.py), and
state_dict()['state'] with torch's keys, equal steps and every state tensor within 1e-4 of torch's
relative to its largest element.

Besides each configuration as given, the implementation flags torch's grid crosses it with
(OptimizerInfo.supported_impls) and the inputs optfuse cannot take:
  foreach=True, fused=True   accepted and ignored (the kernel is always fused): must match torch's
                             for-loop implementation like the configuration as given;
  differentiable=True        must raise OptfuseError (optfuse steps outside autograd);
  complex parameters         must raise OptfuseError (classes whose torch version takes them);
  capturable=True on CPU     torch refuses to step it; optfuse (always capturable) must match
                             torch's for-loop implementation without it;
  a combination torch's own constructor refuses must be refused by optfuse's with the same
  exception type (none in this torch version's CPU grid).
A configuration whose parameters torch's grid supplies itself (OptimizerInput.params) would be
skipped with its reason printed; none of this torch version's has any. Every outcome is counted
in a line per class in the summaries at the end of the run (conftest.SUMMARY); -s shows the table.
"""
import collections
import copy

import pytest
import torch

import optfuse.torch as oft
from conftest import SUMMARY, make_model, rel_diff, train

common_optimizers = pytest.importorskip(
    "torch.testing._internal.common_optimizers",
    reason="torch's optim_db needs the expecttest package (scripts/setup.sh installs it)")
optim_db = common_optimizers.optim_db
OptimizerErrorEnum = common_optimizers.OptimizerErrorEnum

STEPS = 20
F32_TOL = 1e-6
CUDA_F32_TOL = 2e-6  # torch's CUDA kernels contract multiply-adds into FMAs; optfuse's do not
# capturable=True on CUDA: torch computes the step-dependent scalars (bias corrections, RAdam's
# rectification) as float32 tensors on the device, optfuse in float64 (measured on the H200:
# RAdam 5.2e-6 after 20 steps)
CUDA_CAPTURABLE_TOL = 1e-5
STATE_TOL = 1e-4     # state tensors, relative to their own largest element (as test_training_loop.py)
DROP_INS = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "RAdam", "NAdam", "Adamax", "Adadelta", "Rprop", "ASGD",
            "Adafactor"]


def _infos():
    by_name = {info.optim_cls.__name__: info for info in optim_db}
    missing = [n for n in DROP_INS if n not in by_name]
    assert not missing, f"torch's optim_db has no entry for {missing}"
    return [by_name[n] for n in DROP_INS]


INFOS = _infos()


def test_every_drop_in_is_in_the_grid():
    """The grid below covers every optfuse.torch class that replaces a torch.optim class."""
    replacing = sorted(n for n in oft.__all__
                       if isinstance(getattr(oft, n), type) and issubclass(getattr(oft, n), oft.FusedOptimizer)
                       and hasattr(torch.optim, n))
    assert replacing == sorted(DROP_INS)


def _run(cls, kwargs, device):
    model = make_model(device)
    opt = cls(model.parameters(), **copy.deepcopy(kwargs))
    train(model, opt, STEPS, device)
    return model, opt


def _complex_difference(torch_cls, ours_cls, kw, device, steps=5):
    """Where optfuse and torch differ on a complex parameter after `steps` steps (None: nowhere)."""
    torch.manual_seed(0)
    start = torch.randn(3, 4, dtype=torch.complex64, device=device)
    p, q = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ref_kw = {k: v for k, v in kw.items() if k not in ("fused", "foreach", "capturable")}
    try:
        ref = torch_cls([q], foreach=False, **copy.deepcopy(ref_kw))
    except TypeError:
        ref = torch_cls([q], **copy.deepcopy(ref_kw))
    ours = ours_cls([p], **copy.deepcopy(kw))
    g = torch.Generator(device=device).manual_seed(1)
    for _ in range(steps):
        x = torch.randn(3, 4, dtype=torch.complex64, device=device, generator=g)
        p.grad, q.grad = x, x.clone()
        ours.step()
        ref.step()
    d = float((p - q).abs().max()) / max(float(q.abs().max()), 1e-30)
    if not d <= 1e-5:
        return f"a complex parameter differs from torch's by {d:.3g} (relative)"
    return None


def _state_mismatch(ours, ref):
    """Where optfuse's state_dict()['state'] differs from torch's: keys, steps (exactly) or a state
    tensor by more than STATE_TOL relative to its own largest element (None if nowhere)."""
    a, b = ours.state_dict()["state"], ref.state_dict()["state"]
    if a.keys() != b.keys():
        return f"state entries for parameters {sorted(a)}, torch's for {sorted(b)}"
    for i, theirs in b.items():
        if a[i].keys() != theirs.keys():
            return f"parameter {i}: state keys {sorted(a[i])}, torch's {sorted(theirs)}"
        for k, v in theirs.items():
            mine = a[i][k]
            if k == "step":
                if float(mine) != float(v):
                    return f"parameter {i}: step {float(mine)} != torch's {float(v)}"
                continue
            scale = max(v.detach().float().abs().max().item(), 1e-30)
            err = (mine.detach().float() - v.detach().float()).abs().max().item() / scale
            if not err <= STATE_TOL:
                return f"parameter {i}: state {k!r} differs from torch's by {err:.3g} (relative)"
    return None


def _variants(info, kwargs, device):
    """(name, kwargs for optfuse, expected outcome) for one configuration of the grid."""
    out = [("as given", dict(kwargs), "match")]
    impls = info.supported_impls
    if "foreach" in impls and "foreach" not in kwargs:
        out.append(("foreach=True", dict(kwargs, foreach=True), "match"))
    if "fused" in impls and device.type in info.supports_fused_on and "fused" not in kwargs:
        out.append(("fused=True", dict(kwargs, fused=True), "match"))
    if "differentiable" in impls:
        # (stepped by torch's own class: autograd through the step)
        out.append(("differentiable=True", dict(kwargs, differentiable=True), "match"))
    if info.has_capturable_arg and device.type == "cpu" and not kwargs.get("capturable"):
        out.append(("capturable=True on CPU", dict(kwargs, capturable=True), "match"))
    if info.supports_complex:
        out.append(("complex parameters", dict(kwargs), "match:complex"))
    return out


@pytest.mark.parametrize("info", INFOS, ids=[i.optim_cls.__name__ for i in INFOS])
def test_optim_db_configurations_match_torch(info, device, record_property):
    name = info.optim_cls.__name__
    ours_cls = getattr(oft, name)
    base_tol = CUDA_F32_TOL if device.type == "cuda" else F32_TOL
    inputs = info.optim_inputs_func(device=device, dtype=torch.float32)
    assert inputs, f"torch's grid has no configuration for {name}"
    counts = collections.Counter()
    lines, failures = [], []
    for inp in inputs:
        if inp.params is not None:
            counts["skipped"] += 1
            lines.append(f"  SKIP {inp.desc!r}: the configuration brings its own parameters ({inp.params!r})")
            continue
        for variant, kw, expect in _variants(info, inp.kwargs, device):
            label = f"{inp.desc!r} [{variant}] {kw}"
            if expect == "match:complex":  # (stepped through their real views, as torch does)
                err = _complex_difference(info.optim_cls, ours_cls, kw, device)
                if err is not None:
                    failures.append(f"{label}: {err}")
                else:
                    counts["matched"] += 1
                    lines.append(f"  OK {label}")
                continue
            try:  # a combination torch's own constructor refuses: the drop-in must refuse it alike
                info.optim_cls([torch.zeros(2, device=device, requires_grad=True)], **copy.deepcopy(kw))
            except Exception as e:  # noqa: BLE001
                with pytest.raises(type(e)):
                    ours_cls(make_model(device).parameters(), **copy.deepcopy(kw))
                counts["refused as torch"] += 1
                lines.append(f"  REFUSED (as torch: {type(e).__name__}: {e}) {label}")
                continue
            ref_kw = {k: v for k, v in kw.items() if k not in ("fused", "foreach")}
            ref_kw["foreach"] = False
            if device.type == "cpu":
                ref_kw.pop("capturable", None)  # torch refuses capturable=True with CPU parameters
            try:  # (differentiable=True on leaf parameters: torch's step raises; optfuse's must alike)
                ref_model, ref = _run(info.optim_cls, ref_kw, device)
            except Exception as e:  # noqa: BLE001
                with pytest.raises(type(e)):
                    _run(ours_cls, kw, device)
                counts["raised as torch"] += 1
                lines.append(f"  RAISED (as torch: {type(e).__name__}: {e}) {label}")
                continue
            try:
                ours_model, ours = _run(ours_cls, kw, device)
            except Exception as e:  # noqa: BLE001 - reported below with the configuration
                failures.append(f"{label}: optfuse raised {type(e).__name__}: {e}")
                continue
            d = rel_diff(ours_model, ref_model)
            tol = CUDA_CAPTURABLE_TOL if device.type == "cuda" and kw.get("capturable") else base_tol
            moved = rel_diff(ref_model, make_model(device))
            state = _state_mismatch(ours, ref)
            if not d <= tol:
                failures.append(f"{label}: parameters differ from torch's by {d:.3g} (relative), tolerance {tol:g}")
            elif not moved > 100 * base_tol:  # (the plain tolerance: a small lr moves little)
                failures.append(f"{label}: training moved the parameters by only {moved:.3g}: a vacuous comparison")
            elif state is not None:
                failures.append(f"{label}: {state}")
            else:
                counts["passed"] += 1
                lines.append(f"  PASS {label}: {d:.2g} (moved {moved:.2g})")
    summary = (f"optim_db {name} on {device.type}: {len(inputs)} configurations, "
               + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    record_property(SUMMARY, summary)  # printed after the run by conftest's terminal summary
    print("\n".join(lines))  # captured: shown with -s or -rP
    assert not failures, "\n".join(failures)
    # every configuration of torch's grid, as given, is one of the passes
    assert counts["passed"] >= len(inputs) - counts["skipped"]


def _error_params(inp, device):
    if inp.params is not None:
        return inp.params
    return [torch.nn.Parameter(torch.randn(2, 3, device=device))]


@pytest.mark.parametrize("info", INFOS, ids=[i.optim_cls.__name__ for i in INFOS])
def test_optim_db_error_inputs_are_refused_like_torch(info, device, record_property):
    """torch's grid of invalid constructor inputs: optfuse raises (or warns) what torch does."""
    name = info.optim_cls.__name__
    ours_cls = getattr(oft, name)
    errors = info.optim_error_inputs_func(device=device, dtype=torch.float32)
    if not errors:  # torch defines some classes' error inputs for the CPU only (NAdam's on CUDA: none)
        pytest.skip(f"torch's optim_db has no error inputs for {name} on {device.type}")
    counts = collections.Counter()
    for err in errors:
        inp = err.optimizer_error_input
        make = (lambda cls: cls(_error_params(inp, device), **copy.deepcopy(inp.kwargs)))
        if err.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
            if issubclass(err.error_type, Warning):
                with pytest.warns(err.error_type, match=err.error_regex):
                    make(ours_cls)
                counts["warned as torch"] += 1
            else:
                with pytest.raises(err.error_type, match=err.error_regex):
                    make(ours_cls)
                counts["raised as torch"] += 1
        else:  # STEP_ERROR: none in this torch version for these classes; checked the same way
            opt = make(ours_cls)
            ctx = (pytest.warns(err.error_type, match=err.error_regex) if issubclass(err.error_type, Warning)
                   else pytest.raises(err.error_type, match=err.error_regex))
            with ctx:
                opt.step()
            counts["step error as torch"] += 1
    record_property(SUMMARY, f"optim_db errors {name} on {device.type}: {len(errors)} inputs, "
                    + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    assert sum(counts.values()) == len(errors)
