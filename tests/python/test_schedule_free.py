"""optfuse.torch.AdamWScheduleFree against the schedulefree package's AdamWScheduleFree (the
reference, installed by scripts/setup.sh): 20 steps with new gradients every step (zero_grad, then
.grad assigned), two param groups with different lr, over a grid of warmup_steps, weight_decay, r
and weight_lr_power, with train()/eval() switches mid-run, a parameter that joins late and skips
steps, and state dicts loaded both ways.

Tolerance: max |p_ours - p_ref| / max |p_ref| (the parameter scale) <= 1e-6 on CPU, 2e-6 on CUDA,
for the parameters and both states after every step. Both do the same float32 operations in the
same order (exp_avg_sq as mul + addcmul, lerp then add for y, the per-step scalars in float64 and
rounded once to float32); what is left is torch's CPU kernels contracting a multiply-add where
optfuse rounds twice. The group's schedule (k, lr_max, weight_sum, scheduled_lr) is computed on the
host by the same Python float arithmetic: equal exactly. Measured on CPU (torch 2.15): at most
1.9e-7 over GRID; a kernel given ckp1 = 1/t, or counting steps per parameter instead of per group,
fails by 8e-4 and 1.2e-3.
"""
import copy
import inspect
import itertools

import pytest
import torch

import optfuse
import optfuse.torch as oft
from optfuse.torch._precision import _PRECISION
from conftest import DEVICES

schedulefree = pytest.importorskip("schedulefree", reason="schedulefree is not installed (scripts/setup.sh installs it)")

STEPS = 20
CPU_TOL = 1e-6
CUDA_TOL = 2e-6
SCHEDULE_KEYS = ("k", "train_mode", "weight_sum", "lr_max", "scheduled_lr")
SHAPES = [(7, 5), (5,), (3, 4, 2), (1,), (6,)]


def _tol(device):
    return CUDA_TOL if torch.device(device).type == "cuda" else CPU_TOL


def _params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def _groups(params, opts):
    """Two groups with different lr: the first three tensors and the last two."""
    return [dict(params=params[:3], lr=1e-2, **opts), dict(params=params[3:], lr=3e-3, **opts)]


def _grads(step, device):
    """Step `step`'s gradients (None: no gradient this step). Parameter 4 gets its first gradient at
    step 3 (its z starts then, at the group's k = 3) and none at steps 8 and 9."""
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(s, generator=g).to(device) for s in SHAPES]
    if step < 3 or step in (8, 9):
        out[4] = None
    return out


def _set_grads(opt, params, grads):
    opt.zero_grad()
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g.clone()  # the reference divides .grad in place: each gets its own


def _scale_diff(a, b):
    num = max((x.detach().float() - y.detach().float()).abs().max().item() for x, y in zip(a, b))
    den = max(y.detach().float().abs().max().item() for y in b)
    return num / den


def _check(ours, ref, pa, pb, device, what):
    tol = _tol(device)
    d = _scale_diff(pa, pb)
    assert d <= tol, f"{what}: parameters differ by {d:.3g} of their scale"
    for key in ("z", "exp_avg_sq"):
        have = [ours.state[p][key] for p in pa if key in ours.state[p]]
        want = [ref.state[p][key] for p in pb if key in ref.state[p]]
        assert len(have) == len(want), f"{what}: {key} exists for {len(have)} parameters, reference {len(want)}"
        if want:
            d = _scale_diff(have, want)
            assert d <= tol, f"{what}: {key} differs by {d:.3g} of its scale"
    for go, gr in zip(ours.param_groups, ref.param_groups):
        for key in SCHEDULE_KEYS:
            assert go[key] == gr[key], f"{what}: group key {key}: {go[key]!r} vs reference {gr[key]!r}"


def _pair(device, opts, foreach=True):
    pa, pb = _params(device), _params(device)
    ours = oft.AdamWScheduleFree(_groups(pa, opts))
    ref = schedulefree.AdamWScheduleFree(_groups(pb, opts), foreach=foreach)
    return ours, ref, pa, pb


def _run(ours, ref, pa, pb, device, steps, start=0, switch_at=()):
    """Steps both side by side, checking after every step; at each step in switch_at, eval() (the
    parameters become x: compared too) and train() again."""
    for s in range(start, start + steps):
        grads = _grads(s, device)
        _set_grads(ours, pa, grads)
        _set_grads(ref, pb, grads)
        ours.step()
        ref.step()
        _check(ours, ref, pa, pb, device, f"step {s + 1}")
        if s + 1 in switch_at:
            ours.eval()
            ref.eval()
            _check(ours, ref, pa, pb, device, f"eval() after step {s + 1}")
            ours.train()
            ref.train()
            _check(ours, ref, pa, pb, device, f"train() after step {s + 1}")


GRID = [dict(warmup_steps=w, weight_decay=wd, r=r, weight_lr_power=pw)
        for w, wd, r, pw in itertools.product((0, 5), (0.0, 0.1), (0.0, 1.0), (2.0, 0.0))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opts", GRID, ids=lambda o: "w{warmup_steps}-wd{weight_decay}-r{r}-p{weight_lr_power}".format(**o))
def test_matches_reference(device, opts):
    ours, ref, pa, pb = _pair(device, opts)
    ours.train()
    ref.train()
    _run(ours, ref, pa, pb, device, STEPS, switch_at=(6, 13))
    ours.eval()
    ref.eval()
    _check(ours, ref, pa, pb, device, "eval() at the end")
    assert ours.param_groups[0]["k"] == STEPS
    # the parameters really moved (a test of the test)
    assert _scale_diff(_params(device), pb) > 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference_for_loop(device):
    """The reference's per-parameter path (foreach=False) gives the same numbers."""
    ours, ref, pa, pb = _pair(device, dict(warmup_steps=5, weight_decay=0.1, r=1.0), foreach=False)
    ours.train()
    ref.train()
    _run(ours, ref, pa, pb, device, STEPS, switch_at=(10,))


def _copy_params(dst, src):
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("save_in", ["train", "eval"])
def test_state_dict_loads_both_ways(device, save_in):
    """Run both 8 steps; then the reference's state dict into a fresh optfuse optimizer and ours
    into a fresh reference; all four continue 12 steps and stay together."""
    opts = dict(warmup_steps=5, weight_decay=0.1, r=1.0)
    ours, ref, pa, pb = _pair(device, opts)
    ours.train()
    ref.train()
    _run(ours, ref, pa, pb, device, 8, switch_at=(4,))
    if save_in == "eval":  # the reference's advice: eval() before saving
        ours.eval()
        ref.eval()
    sd_ours, sd_ref = copy.deepcopy(ours.state_dict()), copy.deepcopy(ref.state_dict())
    # the same format: state keys, group keys, schedule values
    assert set(sd_ours["state"]) == set(sd_ref["state"])
    for i in sd_ref["state"]:
        assert set(sd_ours["state"][i]) == set(sd_ref["state"][i]) == {"z", "exp_avg_sq"}
    for go, gr in zip(sd_ours["param_groups"], sd_ref["param_groups"]):
        assert set(go) == set(gr)
        assert {k: go[k] for k in SCHEDULE_KEYS} == {k: gr[k] for k in SCHEDULE_KEYS}

    # theirs -> a fresh optfuse optimizer; ours -> a fresh reference (both on copies of the parameters)
    pc, pd = _params(device, seed=1), _params(device, seed=2)
    _copy_params(pc, pb)
    _copy_params(pd, pa)
    ours2 = oft.AdamWScheduleFree(_groups(pc, opts))
    ours2.load_state_dict(copy.deepcopy(sd_ref))
    ref2 = schedulefree.AdamWScheduleFree(_groups(pd, opts))
    ref2.load_state_dict(copy.deepcopy(sd_ours))
    for o in (ours, ref, ours2, ref2):
        o.train()
    _check(ours2, ref, pc, pb, device, "theirs loaded into ours")
    _check(ours, ref2, pa, pd, device, "ours loaded into theirs")
    for s in range(8, STEPS):
        grads = _grads(s, device)
        for o, ps in ((ours, pa), (ref, pb), (ours2, pc), (ref2, pd)):
            _set_grads(o, ps, grads)
            o.step()
        _check(ours2, ref, pc, pb, device, f"theirs loaded into ours, step {s + 1}")
        _check(ours, ref2, pa, pd, device, f"ours loaded into theirs, step {s + 1}")
    for o in (ours, ref, ours2, ref2):
        o.eval()
    _check(ours2, ref, pc, pb, device, "theirs loaded into ours, eval()")
    _check(ours, ref2, pa, pd, device, "ours loaded into theirs, eval()")


@pytest.mark.parametrize("device", DEVICES)
def test_fuse_takes_over_a_running_reference(device):
    """fuse() of a schedulefree.AdamWScheduleFree mid-run is this class, with the same groups and
    state, and continues as the reference would."""
    opts = dict(warmup_steps=5, weight_decay=0.1)
    pa, pb = _params(device), _params(device)
    a = schedulefree.AdamWScheduleFree(_groups(pa, opts))
    ref = schedulefree.AdamWScheduleFree(_groups(pb, opts))
    a.train()
    ref.train()
    for s in range(6):
        grads = _grads(s, device)
        for o, ps in ((a, pa), (ref, pb)):
            _set_grads(o, ps, grads)
            o.step()
    ours = oft.fuse(a)
    assert type(ours) is oft.AdamWScheduleFree
    assert ours.param_groups[0] is a.param_groups[0]
    _run(ours, ref, pa, pb, device, STEPS - 6, start=6, switch_at=(12,))


def test_arguments_match_the_reference():
    sig, ref_sig = inspect.signature(oft.AdamWScheduleFree), inspect.signature(schedulefree.AdamWScheduleFree)
    # the reference's arguments, in its order, then optfuse's precision options (keyword-only)
    ours = list(sig.parameters)
    assert ours[:len(ref_sig.parameters)] == list(ref_sig.parameters)
    extra = ours[len(ref_sig.parameters):]
    assert sorted(extra) == sorted(_PRECISION), extra
    assert all(sig.parameters[k].kind is inspect.Parameter.KEYWORD_ONLY for k in extra)
    for name, p in ref_sig.parameters.items():
        assert sig.parameters[name].default == p.default, name
    p, q = [torch.nn.Parameter(torch.zeros(3))], [torch.nn.Parameter(torch.zeros(3))]
    assert oft.AdamWScheduleFree(p).defaults == schedulefree.AdamWScheduleFree(q).defaults
    assert "AdamWScheduleFree" in oft.__all__


def test_step_outside_train_mode_is_refused_as_the_reference_does():
    p, q = [torch.nn.Parameter(torch.zeros(3))], [torch.nn.Parameter(torch.zeros(3))]
    ours, ref = oft.AdamWScheduleFree(p), schedulefree.AdamWScheduleFree(q)
    p[0].grad = torch.ones(3)
    q[0].grad = torch.ones(3)
    with pytest.raises(Exception) as ref_err:
        ref.step()
    with pytest.raises(Exception) as err:
        ours.step()
    assert str(err.value) == str(ref_err.value)
    assert ours.param_groups[0]["k"] == 0


def test_closure_and_no_rebuild_per_step():
    """step(closure) returns the loss; the per-step values (ckp1, the step) are pushed numbers, so
    the compiled engine stays the same from step to step."""
    p = [torch.nn.Parameter(torch.randn(4))]
    opt = oft.AdamWScheduleFree(p, lr=1e-2)
    opt.train()

    def closure():
        opt.zero_grad()
        loss = (p[0] ** 2).sum()
        loss.backward()
        return loss

    assert torch.is_tensor(opt.step(closure))
    engines = dict(opt._engines)
    for _ in range(3):
        opt.step(closure)
    assert all(opt._engines[k] is e for k, e in engines.items())


def test_grad_scaler_skips_the_whole_step():
    """GradScaler unscales and skips step() itself (as for the reference): an inf gradient leaves
    the parameters and the group's schedule untouched."""
    p = [torch.nn.Parameter(torch.randn(4))]
    opt = oft.AdamWScheduleFree(p, lr=1e-2)
    opt.train()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = p[0].detach().clone()
    scaler.scale((p[0] * torch.tensor([1.0, 2.0, float("inf"), 3.0])).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p[0], before) and opt.param_groups[0]["k"] == 0
    opt.zero_grad()
    scaler.scale(p[0].sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert opt.param_groups[0]["k"] == 1 and not torch.equal(p[0], before)


def test_low_precision_options():
    """master_weights=True: train()/eval() move the float32 master and the bfloat16 parameter
    follows; remainders and Kahan compensation are refused with the reason."""
    torch.manual_seed(0)
    p = [torch.nn.Parameter(torch.randn(64).bfloat16())]
    opt = oft.AdamWScheduleFree(p, lr=1e-2, master_weights=True)
    opt.train()
    for _ in range(3):
        p[0].grad = torch.randn(64).bfloat16()
        opt.step()
    st = opt.state[p[0]]
    master = st["master_param"].clone()
    opt.eval()
    assert torch.equal(st["master_param"], master.lerp(st["z"], 1 - 1 / 0.9))
    assert torch.equal(p[0], st["master_param"].bfloat16())
    for bad in (dict(master_weights="remainders"), dict(kahan=True)):
        with pytest.raises(optfuse.OptfuseError, match="AdamWScheduleFree"):
            oft.AdamWScheduleFree([torch.nn.Parameter(torch.zeros(2).bfloat16())], **bad)
        plain = oft.AdamWScheduleFree([torch.nn.Parameter(torch.zeros(2).bfloat16())])
        with pytest.raises(optfuse.OptfuseError, match="AdamWScheduleFree: (master_weights|kahan)"):
            plain.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(2).bfloat16())], **bad))
        assert len(plain.param_groups) == 1  # the refused group is not kept


def test_step_hooks_run_the_schedule():
    """With step hooks (or the profiler) step() takes torch's hook wrapper: it runs this class's
    step, schedule included."""
    ours, ref, pa, pb = _pair("cpu", dict(warmup_steps=2))
    seen = []
    ours.register_step_post_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["k"]))
    ours.train()
    ref.train()
    _run(ours, ref, pa, pb, "cpu", 3)
    assert seen == [1, 2, 3]
