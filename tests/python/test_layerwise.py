"""optfuse.torch.Lamb and Lars against timm.optim.Lamb and Lars (for-loop, foreach=False): 20 steps of
the zero_grad loop on a small MLP over a grid of their options, state dicts both ways, an lr
scheduler, bitwise repeatability, and the errors for what optfuse refuses. Skipped with a reason
where timm is not installed (scripts/setup.sh installs it)."""
import pytest
import torch

import optfuse
import optfuse.torch as oft
from conftest import make_model, rel_diff, train, twin

try:
    import timm.optim as timm_optim
except ImportError as e:  # timm, or torchvision which it imports
    timm_optim = None
    TIMM_MISSING = f"timm.optim cannot be imported ({e}): it is the reference (scripts/setup.sh installs it)"
if timm_optim is not None:
    import inspect

    import timm
    if "corrected_weight_decay" not in inspect.signature(timm_optim.Lamb).parameters:
        TIMM_MISSING = (f"timm {timm.__version__} predates the Lamb options optfuse follows (decoupled_decay, "
                        "corrected_weight_decay); scripts/setup.sh installs the newest")
        timm_optim = None
needs_timm = pytest.mark.skipif(timm_optim is None, reason=TIMM_MISSING if timm_optim is None else "")

STEPS = 20
F32_TOL = 1e-6
CUDA_F32_TOL = 2e-6

GRID = [
    ("Lamb", dict(lr=1e-2)),
    ("Lamb", dict(lr=1e-2, weight_decay=0.1, trust_clip=True)),
    ("Lamb", dict(lr=1e-2, max_grad_norm=None)),
    ("Lamb", dict(lr=1e-2, max_grad_norm=0.05)),  # clipping active on every step
    ("Lamb", dict(lr=1e-2, weight_decay=0.0)),  # no adaptation
    ("Lamb", dict(lr=1e-2, weight_decay=0.0, always_adapt=True, bias_correction=False)),
    ("Lamb", dict(lr=1e-2, grad_averaging=False, betas=(0.8, 0.99), eps=1e-8)),
    ("Lamb", dict(lr=1e-2, weight_decay=0.1, decoupled_decay=True)),
    ("Lamb", dict(lr=1e-2, weight_decay=0.1, decoupled_decay=True, corrected_weight_decay=True)),
    ("Lars", dict(lr=0.5)),
    ("Lars", dict(lr=0.5, weight_decay=0.01)),
    ("Lars", dict(lr=0.5, weight_decay=0.01, momentum=0.9)),
    ("Lars", dict(lr=0.5, weight_decay=0.01, momentum=0.9, nesterov=True, trust_clip=True)),
    ("Lars", dict(lr=0.5, momentum=0.9, dampening=0.1, always_adapt=True, trust_coeff=0.01)),
]


def reference(name, params, kw):
    cls = getattr(timm_optim, name)
    import inspect
    loop = {"foreach": False} if "foreach" in inspect.signature(cls).parameters else {}  # older timm: loop only
    return cls(params, **loop, **kw)


def case_id(case):
    name, kw = case
    return name + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


@needs_timm
@pytest.mark.parametrize("case", GRID, ids=[case_id(c) for c in GRID])
def test_matches_timm(case, device):
    name, kw = case
    ours_model = make_model(device)
    ref_model = twin(ours_model)
    train(ours_model, getattr(oft, name)(ours_model.parameters(), **kw), STEPS, device)
    train(ref_model, reference(name, ref_model.parameters(), kw), STEPS, device)
    assert rel_diff(ours_model, ref_model) <= (CUDA_F32_TOL if device.type == "cuda" else F32_TOL)


def two_groups(model, **second):
    params = list(model.parameters())
    return [{"params": params[:2]}, {"params": params[2:], **second}]


@needs_timm
@pytest.mark.parametrize("name,second", [("Lamb", dict(weight_decay=0.0, lr=5e-3)),
                                         ("Lamb", dict(decoupled_decay=True, trust_clip=True)),
                                         ("Lars", dict(weight_decay=0.1, lr=0.2))])
def test_groups_with_other_options_match_timm(name, second, device):
    # Lamb's gradient norm spans every group, whatever options each group has.
    kw = dict(weight_decay=0.01) if name == "Lars" else {}
    ours_model = make_model(device)
    ref_model = twin(ours_model)
    train(ours_model, getattr(oft, name)(two_groups(ours_model, **second), **kw), STEPS, device)
    train(ref_model, reference(name, two_groups(ref_model, **second), kw), STEPS, device)
    assert rel_diff(ours_model, ref_model) <= (CUDA_F32_TOL if device.type == "cuda" else F32_TOL)


@needs_timm
@pytest.mark.parametrize("name,kw", [("Lamb", dict(lr=1e-2, weight_decay=0.1)), ("Lars", dict(lr=0.5, momentum=0.9, weight_decay=0.01))])
def test_state_dict_both_ways(name, kw, device):
    # timm -> optfuse after 7 steps, 8 more; and optfuse -> timm after 7 steps, 8 more: both equal 15 timm steps.
    full = make_model(device)
    a, b = twin(full), twin(full)
    train(full, reference(name, full.parameters(), kw), 15, device)

    ta = reference(name, a.parameters(), kw)
    train(a, ta, 7, device)
    oa = getattr(oft, name)(a.parameters(), **kw)
    oa.load_state_dict(ta.state_dict())
    train(a, oa, 8, device, start=7)
    assert rel_diff(a, full) <= 2e-6

    ob = getattr(oft, name)(b.parameters(), **kw)
    train(b, ob, 7, device)
    sd = ob.state_dict()
    if name == "Lamb":
        assert all(float(g["step"]) == 7 for g in sd["param_groups"])
        assert set(sd["state"][0]) == {"exp_avg", "exp_avg_sq"}
    else:
        assert set(sd["state"][0]) == {"momentum_buffer"}
    tb = reference(name, b.parameters(), kw)
    tb.load_state_dict(sd)
    train(b, tb, 8, device, start=7)
    assert rel_diff(b, full) <= 2e-6


def test_loads_state_dicts_of_older_timm_releases(device):
    # timm before 1.0.20 wrote no decoupled_decay / corrected_weight_decay / max_lr_snapshot / caution keys.
    model = make_model(device)
    first = oft.Lamb(model.parameters(), lr=1e-2)
    train(model, first, 3, device)
    sd = first.state_dict()
    for g in sd["param_groups"]:
        for key in ("caution", "decoupled_decay", "corrected_weight_decay", "max_lr_snapshot", "foreach"):
            del g[key]
    again = oft.Lamb(model.parameters(), lr=1e-2)
    again.load_state_dict(sd)
    train(model, again, 2, device, start=3)
    assert again.param_groups[0]["max_lr_snapshot"] == 1e-2
    assert float(again.state_dict()["param_groups"][0]["step"]) == 5


@needs_timm
def test_scheduler_in_the_loop(device):
    ours_model = make_model(device)
    ref_model = twin(ours_model)
    ours = oft.Lamb(ours_model.parameters(), lr=1e-2)
    ref = reference("Lamb", ref_model.parameters(), dict(lr=1e-2))
    train(ours_model, ours, STEPS, device, scheduler=torch.optim.lr_scheduler.StepLR(ours, 5, 0.5))
    train(ref_model, ref, STEPS, device, scheduler=torch.optim.lr_scheduler.StepLR(ref, 5, 0.5))
    assert rel_diff(ours_model, ref_model) <= (CUDA_F32_TOL if device.type == "cuda" else F32_TOL)
    assert ours.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 4)


@pytest.mark.parametrize("name", ["Lamb", "Lars"])
def test_bitwise_repeatable(name, device):
    models = [make_model(device) for _ in range(2)]
    for m in models:
        train(m, getattr(oft, name)(m.parameters(), weight_decay=0.1), 5, device)
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available here: the CUDA-vs-CPU check needs a GPU")
@pytest.mark.parametrize("case", GRID, ids=[case_id(c) for c in GRID])
def test_cuda_matches_cpu(case):
    # Without timm (the H200 has none): CUDA against optfuse's CPU backend, which matches timm above.
    name, kw = case
    cpu_model = make_model(torch.device("cpu"))
    cuda_model = twin(cpu_model).cuda()
    train(cpu_model, getattr(oft, name)(cpu_model.parameters(), **kw), STEPS, torch.device("cpu"))
    train(cuda_model, getattr(oft, name)(cuda_model.parameters(), **kw), STEPS, torch.device("cuda"))
    assert rel_diff(cuda_model.cpu(), cpu_model) <= CUDA_F32_TOL


def test_refusals():
    model = make_model(torch.device("cpu"))
    with pytest.raises(optfuse.OptfuseError, match="caution"):
        opt = oft.Lamb(model.parameters(), caution=True)
        train(model, opt, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="max_grad_norm"):
        oft.Lamb(model.parameters(), max_grad_norm=0)
    with pytest.raises(ValueError, match="Nesterov"):
        oft.Lars(model.parameters(), nesterov=True)


def test_explain_shows_the_passes():
    text = optfuse.explain("lamb()")
    assert "3 pass(es) over memory" in text
    # the norm pass writes m and v, the update reads them back instead of the gradient (float32)
    assert "total bytes per element: 44" in text
    assert "states written ahead by phase 2" in text
    assert "sum_squares/tensor" in text
    assert "total bytes per element: 40" in optfuse.explain("lamb(max_grad_norm=0)")
    assert "2 pass(es) over memory" in optfuse.explain("lars(weight_decay=0.1, momentum=0.9)")
