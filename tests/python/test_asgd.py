"""optfuse.torch.ASGD's eta and mu against torch.optim.ASGD (foreach=False): they are uniform states
of the rule averaged_sgd (one float64 per internal group, float32 values as torch's tensors), read by
each step and committed where it is not skipped, seeded from and written back to torch's
per-parameter 0-dim tensors. What that makes exact: a skipped GradScaler step while a scheduler
changes a Python-number lr, lambd, alpha or t0 changed mid-run, parameters of one group whose etas
disagree, parameters added later. (torch's optim_db grid for ASGD runs in test_optim_db.py;
state-dict round trips and fuse() under an lr schedule in test_torch_parity.py; training loops with
schedulers and parameters that skip steps in test_training_loop_dropins.py; torch.compile in
test_compile.py.)"""
import copy

import pytest
import torch

import optfuse
import optfuse.torch as oft
from conftest import loss_of, make_model, rel_diff, twin

F32_TOL = 1e-6
CUDA_F32_TOL = 2e-6
KW = dict(lr=0.05, lambd=0.3, alpha=0.6, t0=2)  # eta shrinks visibly; averaging (mu < 1) from step 4


def tol(device):
    return CUDA_F32_TOL if device.type == "cuda" else F32_TOL


def scalars(opt):
    """Every parameter's (step, eta, mu) from state_dict(), as Python floats."""
    return {i: (float(st["step"]), float(st["eta"]), float(st["mu"])) for i, st in opt.state_dict()["state"].items()}


def assert_same(model, ref_model, ours, ref, device, what=""):
    assert rel_diff(model, ref_model) <= tol(device), what
    a, b = ours.state_dict()["state"], ref.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in b:
        assert list(a[i]) == list(b[i]) == ["step", "eta", "mu", "ax"], (i, list(a[i]))
        for k in ("step", "eta", "mu"):
            assert a[i][k].dtype == b[i][k].dtype and a[i][k].device == b[i][k].device, (what, i, k)
            assert torch.equal(a[i][k], b[i][k]), f"{what}: parameter {i}: {k} {a[i][k]} != torch's {b[i][k]}"
        scale = max(b[i]["ax"].abs().max().item(), 1e-30)
        assert (a[i]["ax"] - b[i]["ax"]).abs().max().item() <= 1e-5 * scale, (what, i)


def pair(device, **kw):
    model = make_model(device)
    ref_model = twin(model)
    kw = {**KW, **kw}
    return model, ref_model, oft.ASGD(model.parameters(), **kw), torch.optim.ASGD(ref_model.parameters(),
                                                                                  foreach=False, **kw)


def test_a_skipped_step_keeps_eta_and_mu_while_a_scheduler_changes_lr(device):
    """found_inf (a GradScaler's overflow) on steps after which the lr (a Python number) changes:
    torch does not step, so eta and mu stay those of the last step taken, computed with that step's
    lr; the core does not commit them either. (The lr-bookkeeping this replaced took the skipped
    step's lr for the next eta: it could not tell the step was skipped without a device sync.)"""
    model, ref_model, ours, ref = pair(device)
    skip, go, scale = torch.ones(1, device=device), torch.zeros(1, device=device), torch.ones(1, device=device)
    for s in range(12):
        skipped = s in (3, 6, 7)
        for m, o in ((model, ours), (ref_model, ref)):
            o.zero_grad()
            loss_of(m, s, device, torch.float32).backward()
        before = scalars(ours)
        ours.step(grad_scale=scale, found_inf=skip if skipped else go)
        if skipped:
            assert scalars(ours) == before, f"step {s} was skipped but step, eta or mu changed"
        else:
            ref.step()
        for o in (ours, ref):
            o.param_groups[0]["lr"] = KW["lr"] * 0.7 ** (s + 1)  # a scheduler stepped every iteration
        assert_same(model, ref_model, ours, ref, device, f"step {s}")
    assert scalars(ours)[0][0] == 9
    assert 0 < scalars(ref)[0][2] < 1, "averaging never started"


def test_grad_scaler_skip_with_an_lr_scheduler():
    """torch.amp.GradScaler on CPU and a StepLR stepped every iteration: an inf loss skips the step
    (step, eta and mu stay), the scheduler still moves lr; both continue identically."""
    device = torch.device("cpu")
    model, ref_model, ours, ref = pair(device)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) for _ in range(2)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.8) for o in (ours, ref)]
    for s in range(8):
        for m, o, sc, sch in ((model, ours, scalers[0], scheds[0]), (ref_model, ref, scalers[1], scheds[1])):
            o.zero_grad()
            loss = loss_of(m, s, device, torch.float32)
            if s == 3:
                loss = loss * float("inf")
            sc.scale(loss).backward()
            sc.step(o)
            sc.update()
            sch.step()
        assert_same(model, ref_model, ours, ref, device, f"step {s}")
    assert scalars(ours)[0][0] == 7


@pytest.mark.parametrize("key,value", [("lambd", 0.05), ("alpha", 0.9), ("t0", 0)])
def test_lambd_alpha_t0_changed_mid_run(key, value, device):
    """torch's eta and mu of the step after a change still come from the old values (computed at
    the end of the step before); so do the uniform states."""
    model, ref_model, ours, ref = pair(device, t0=5)
    for s in range(9):
        if s == 4:
            for o in (ours, ref):
                o.param_groups[0][key] = value
        for m, o in ((model, ours), (ref_model, ref)):
            o.zero_grad()
            loss_of(m, s, device, torch.float32).backward()
            o.step()
        assert_same(model, ref_model, ours, ref, device, f"step {s}")


def test_parameters_of_one_group_with_different_etas(device):
    """A state dict where parameters of one torch group (same step) disagree on eta and mu: each keeps
    its own (the engine splits the internal group), as torch's per-parameter tensors do."""
    model = make_model(device)
    first = torch.optim.ASGD(model.parameters(), foreach=False, **KW)
    for s in range(3):
        first.zero_grad()
        loss_of(model, s, device, torch.float32).backward()
        first.step()
    sd = copy.deepcopy(first.state_dict())
    sd["state"][1]["eta"] = sd["state"][1]["eta"] * 0.5
    sd["state"][3]["eta"] = sd["state"][3]["eta"] * 2
    sd["state"][3]["mu"] = torch.full_like(sd["state"][3]["mu"], 0.25)
    ref_model = twin(model)
    ref = torch.optim.ASGD(ref_model.parameters(), foreach=False, **KW)
    ref.load_state_dict(copy.deepcopy(sd))
    ours = oft.ASGD(model.parameters(), **KW)
    ours.load_state_dict(sd)
    for s in range(3, 8):
        for m, o in ((model, ours), (ref_model, ref)):
            o.zero_grad()
            loss_of(m, s, device, torch.float32).backward()
            o.step()
        if s == 3:
            engine = next(iter(ours._engines.values()))
            assert len(engine.groups) == 3  # (group 0, step 3) split by (eta, mu)
        assert_same(model, ref_model, ours, ref, device, f"step {s}")


@pytest.fixture(params=["views", "device-like"])
def ustate_views(request, monkeypatch):
    """"views": as CPU engines run, opt.state's eta and mu are views refreshed after every step;
    "device-like": as CUDA engines run, they are written only on state_dict() (the engines keep
    the values), so a rebuild must take the engines' values, not the stale tensors in opt.state
    (the bug the H200 found: a rebuild at a new param group restarted eta from lr)."""
    if request.param == "device-like":
        from optfuse.torch._binding import TableBinding
        monkeypatch.setattr(TableBinding, "_bind_uniform_states", lambda self: setattr(self, "_ustate_bufs", []))
    return request.param


def test_parameters_that_join_later(device, ustate_views):
    """A param group added after 4 steps (its own lr), and a parameter of the first group that gets
    its first gradient at step 6: each starts at eta = its group's lr of then, mu = 1, as in torch."""
    opts, models, extras = [], [], []
    for cls in (oft.ASGD, torch.optim.ASGD):
        m = make_model(device)
        extra = torch.nn.Parameter(torch.linspace(-1, 1, 7, device=device))
        late = torch.nn.Parameter(torch.linspace(2, 0, 5, device=device))
        opt = cls([*m.parameters(), late], **KW, **({} if cls is oft.ASGD else dict(foreach=False)))
        for s in range(10):
            if s == 4:
                opt.add_param_group({"params": [extra], "lr": 0.02, "t0": 0})
            opt.param_groups[0]["lr"] = KW["lr"] * 0.9 ** s
            opt.zero_grad()
            loss = loss_of(m, s, device, torch.float32)
            if s >= 4:
                loss = loss + (extra * extra).sum()
            if s >= 6:  # before, late has no gradient at all (not a zero one): it does not step
                loss = loss + (late ** 3).sum()
            loss.backward()
            opt.step()
        opts.append(opt)
        models.append(m)
        extras.append((extra, late))
    ours, ref = opts
    assert_same(models[0], models[1], ours, ref, device)
    for a, b in zip(*extras):
        assert (a - b).abs().max().item() <= 1e-6
    st = scalars(ref)
    assert st[4][0] == 4 and st[5][0] == 6 and st[5][2] < 1  # late and extra stepped, extra averages


def test_the_rule_keeps_eta_and_mu_as_uniform_states():
    plan = optfuse.explain("asgd(lr=0.05)")
    assert "averaged_sgd.eta (init 0.05)" in plan and "averaged_sgd.mu (init 1)" in plan, plan
    assert "eta_lr" not in plan
    opt = oft.ASGD([torch.nn.Parameter(torch.ones(3))], lr=0.05)
    assert "eta_lr" not in opt._hypers(opt.param_groups[0])
    assert oft.ASGD._graph_step  # under torch.compile, the custom op (test_compile.py)
