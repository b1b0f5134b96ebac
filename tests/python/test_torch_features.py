"""The torch front end beyond the update math: state_dict in both directions, lr schedulers without
recompiling, GradScaler, param groups, parameters without gradients, non-contiguous gradients,
fuse(), Fused with rules written in Python, and the errors."""
import copy

import pytest
import torch

import optfuse
import optfuse.torch as oft
from conftest import HAS_CUDA, batch, loss_of, make_model, rel_diff, train, twin

TOL = 1e-6


def engines(opt):
    return [e.core for e in opt._engines.values()]


# --- state_dict ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,kw", [
    ("AdamW", dict(lr=1e-2, weight_decay=0.0)),
    ("Adam", dict(lr=1e-2, amsgrad=True)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1)),
    ("RMSprop", dict(lr=1e-2, momentum=0.9, centered=True)),
    ("Adagrad", dict(lr=0.05, lr_decay=0.01)),
])
def test_state_dict_round_trips_both_ways(name, kw, device):
    straight = make_model(device)
    ours_m, torch_m = twin(straight), twin(straight)
    train(straight, getattr(torch.optim, name)(straight.parameters(), foreach=False, **kw), 10, device)

    # ours for 5 steps -> torch for 5
    ours = getattr(oft, name)(ours_m.parameters(), **kw)
    train(ours_m, ours, 5, device)
    sd = copy.deepcopy(ours.state_dict())
    ref_sd = torch.optim.Adam([torch.zeros(1, requires_grad=True)]).state_dict()  # format check only
    assert set(sd) == set(ref_sd)
    m2 = twin(ours_m)
    t_opt = getattr(torch.optim, name)(m2.parameters(), foreach=False, **kw)
    t_opt.load_state_dict(sd)
    train(m2, t_opt, 5, device, start=5)
    assert rel_diff(m2, straight) <= TOL

    # torch for 5 steps -> ours for 5
    t_opt = getattr(torch.optim, name)(torch_m.parameters(), foreach=False, **kw)
    train(torch_m, t_opt, 5, device)
    ours2 = getattr(oft, name)(torch_m.parameters(), **kw)
    ours2.load_state_dict(copy.deepcopy(t_opt.state_dict()))
    train(torch_m, ours2, 5, device, start=5)
    assert rel_diff(torch_m, straight) <= TOL


def test_state_dict_format_is_torchs(device):
    m = make_model(device)
    ours = oft.AdamW(m.parameters(), lr=1e-2, amsgrad=True)
    m2 = twin(m)
    ref = torch.optim.AdamW(m2.parameters(), lr=1e-2, amsgrad=True, foreach=False)
    train(m, ours, 3, device)
    train(m2, ref, 3, device)
    a, b = ours.state_dict(), ref.state_dict()
    assert a["param_groups"][0].keys() == b["param_groups"][0].keys()
    for i in b["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        assert a["state"][i]["step"].dtype == b["state"][i]["step"].dtype
        assert a["state"][i]["step"].device == b["state"][i]["step"].device
        assert float(a["state"][i]["step"]) == 3.0
    sgd_m = make_model(device)
    sgd = oft.SGD(sgd_m.parameters(), lr=0.1, momentum=0.9)
    train(sgd_m, sgd, 2, device)
    assert set(sgd.state_dict()["state"][0]) == {"momentum_buffer"}


def test_ours_to_ours_round_trip_is_bitwise(device):
    a = make_model(device)
    b = twin(a)
    oa = oft.Adam(a.parameters(), lr=1e-2)
    train(a, oa, 10, device)
    ob = oft.Adam(b.parameters(), lr=1e-2)
    train(b, ob, 5, device)
    sd = copy.deepcopy(ob.state_dict())
    ob2 = oft.Adam(b.parameters(), lr=1e-2)
    ob2.load_state_dict(sd)
    train(b, ob2, 5, device, start=5)
    assert rel_diff(a, b) == 0.0


# --- schedulers, groups, missing grads -------------------------------------------------------

@pytest.mark.parametrize("sched", ["StepLR", "LambdaLR", "OneCycleLR"])
def test_lr_scheduler_pushes_hypers_without_recompiling(sched, device):
    def make_sched(opt):
        if sched == "StepLR":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        if sched == "LambdaLR":
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=20)  # also cycles betas

    m = make_model(device)
    m2 = twin(m)
    ours = oft.AdamW(m.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=False)
    s1, s2 = make_sched(ours), make_sched(ref)
    train(m, ours, 1, device, scheduler=s1)
    cores = engines(ours)
    train(m, ours, 19, device, start=1, scheduler=s1)
    train(m2, ref, 20, device, scheduler=s2)
    assert engines(ours) == cores and all(a is b for a, b in zip(engines(ours), cores))
    assert rel_diff(m, m2) <= 2.5e-6  # AdamW's decoupled weight decay: see test_torch_parity.py
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


def test_param_groups_with_different_lr_and_weight_decay(device):
    m = make_model(device)
    m2 = twin(m)

    def groups(model):
        return [{"params": [model[0].weight, model[2].weight], "lr": 1e-2, "weight_decay": 0.1},
                {"params": [model[0].bias, model[2].bias], "lr": 3e-3, "weight_decay": 0.0}]

    ours = oft.Adam(groups(m), lr=1e-3)
    ref = torch.optim.Adam(groups(m2), lr=1e-3, foreach=False)
    train(m, ours, 20, device)
    train(m2, ref, 20, device)
    assert rel_diff(m, m2) <= TOL


def _train_with_holes(model, opt, steps, device, extra=None):
    """Some parameters have no gradient on some steps; a new group joins at step 5."""
    for s in range(steps):
        opt.zero_grad()
        loss = loss_of(model, s, device, torch.float32)
        if extra is not None and s >= 5:
            loss = loss + (extra * extra).sum()
        loss.backward()
        if s % 3 == 1:
            model[2].bias.grad = None
        if s % 4 == 2:
            model[0].weight.grad = None
        opt.step()
        if s == 4 and extra is not None:
            opt.add_param_group({"params": [extra], "lr": 5e-3})
            if isinstance(opt, torch.optim.Adagrad) and not opt.state[extra]:
                # torch 2.11's Adagrad (the H200 image's) creates state only in __init__ (add_param_group leaves
                # none, and its step() then fails): give the reference what newer torch gives it.
                opt.state[extra] = {"step": torch.tensor(0.0), "sum": torch.zeros_like(extra)}


@pytest.mark.parametrize("name", ["Adam", "SGD", "Adagrad", "RMSprop"])
def test_parameters_without_grads_and_add_param_group(name, device):
    kw = {"SGD": dict(lr=0.05, momentum=0.9, dampening=0.2)}.get(name, dict(lr=1e-2))
    m = make_model(device)
    m2 = twin(m)
    e1 = torch.ones(3, device=device, requires_grad=True)
    e2 = e1.detach().clone().requires_grad_(True)
    ours = getattr(oft, name)(m.parameters(), **kw)
    ref = getattr(torch.optim, name)(m2.parameters(), foreach=False, **kw)
    _train_with_holes(m, ours, 20, device, e1)
    _train_with_holes(m2, ref, 20, device, e2)
    assert rel_diff(m, m2) <= TOL
    assert (e1 - e2).abs().max().item() <= TOL
    if name != "SGD":
        steps = {i: float(s["step"]) for i, s in ours.state_dict()["state"].items()}
        assert steps == {i: float(s["step"]) for i, s in ref.state_dict()["state"].items()}
        assert len(set(steps.values())) > 1  # the per-parameter steps really differ


def test_non_contiguous_gradients(device):
    m = make_model(device)
    m2 = twin(m)
    ours = oft.Adam(m.parameters(), lr=1e-2)
    ref = torch.optim.Adam(m2.parameters(), lr=1e-2, foreach=False)
    for model, opt in ((m, ours), (m2, ref)):
        for s in range(10):
            opt.zero_grad()
            loss_of(model, s, device, torch.float32).backward()
            w = model[0].weight
            w.grad = w.grad.t().contiguous().t()  # same values, transposed layout
            assert not w.grad.is_contiguous()
            opt.step()
    assert rel_diff(m, m2) <= TOL


def test_grads_kept_between_steps_take_the_fast_path(device):
    m = make_model(device)
    opt = oft.SGD(m.parameters(), lr=0.01)
    train(m, opt, 2, device)
    calls = []
    orig = opt._rebuild
    opt._rebuild = lambda: (calls.append(1), orig())[1]
    for s in range(3):
        opt.zero_grad(set_to_none=False)
        loss_of(m, s, device, torch.float32).backward()
        opt.step()
    assert calls == []


# --- GradScaler ---------------------------------------------------------------------------------

def _scaler(device):
    try:
        return torch.amp.GradScaler(device.type, init_scale=1024.0, growth_interval=1000)
    except Exception as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch.amp.GradScaler('{device.type}') is not available in this torch: {e}")


def _train_scaled(model, opt, scaler, steps, device, inf_at):
    scales = []
    for s in range(steps):
        opt.zero_grad()
        scaler.scale(loss_of(model, s, device, torch.float32)).backward()
        if s == inf_at:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_grad_scaler_skips_inf_step(device):
    m = make_model(device)
    m2 = twin(m)
    ours = oft.AdamW(m.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=False)
    # Told True only when GradScaler.step asks (then it hands the kernel grad_scale and found_inf);
    # anyone else (Lightning's clipping check) is told False.
    assert not ours._step_supports_amp_scaling
    sc1, sc2 = _scaler(device), _scaler(device)
    _train_scaled(m, ours, sc1, 3, device, inf_at=None)
    before = [p.detach().clone() for p in m.parameters()]
    s_inf = _train_scaled(m, ours, sc1, 1, device, inf_at=0)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())), "the inf step changed parameters"
    assert s_inf == [512.0]
    assert float(ours.state_dict()["state"][0]["step"]) == 3.0
    _train_scaled(m, ours, sc1, 4, device, inf_at=None)
    # the same run with torch's for-loop AdamW (GradScaler unscales, then skips the step itself)
    _train_scaled(m2, ref, sc2, 3, device, inf_at=None)
    _train_scaled(m2, ref, sc2, 1, device, inf_at=0)
    _train_scaled(m2, ref, sc2, 4, device, inf_at=None)
    assert rel_diff(m, m2) <= 2.5e-6
    assert float(ours.state_dict()["state"][0]["step"]) == 7.0 == float(ref.state_dict()["state"][0]["step"])


def test_step_takes_grad_scale_and_found_inf(device):
    m = make_model(device)
    m2 = twin(m)
    ours = oft.SGD(m.parameters(), lr=0.1)
    ref = torch.optim.SGD(m2.parameters(), lr=0.1, foreach=False)
    for model in (m, m2):
        model.zero_grad()
        loss_of(model, 0, device, torch.float32).backward()
    for p in m.parameters():
        p.grad.mul_(8.0)
    scale = torch.tensor(8.0, device=device)
    ours.step(grad_scale=scale, found_inf=torch.zeros(1, device=device))
    ref.step()
    assert rel_diff(m, m2) <= TOL
    before = [p.detach().clone() for p in m.parameters()]
    ours.step(grad_scale=scale, found_inf=torch.ones(1, device=device))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


# --- fuse() ---------------------------------------------------------------------------------------

FUSABLE = [
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("Adam", dict(lr=1e-2, amsgrad=True)),
    ("AdamW", dict(lr=1e-2, weight_decay=0)),
    ("Adagrad", dict(lr=0.05)),
    ("RMSprop", dict(lr=1e-2, centered=True, momentum=0.5)),
]


@pytest.mark.parametrize("name,kw", FUSABLE, ids=[n for n, _ in FUSABLE])
def test_fuse_mid_training(name, kw, device):
    m = make_model(device)
    m2 = twin(m)
    a = getattr(torch.optim, name)(m.parameters(), foreach=False, **kw)
    b = getattr(torch.optim, name)(m2.parameters(), foreach=False, **kw)
    sched = torch.optim.lr_scheduler.StepLR(b, step_size=3, gamma=0.5)
    sched_a = torch.optim.lr_scheduler.StepLR(a, step_size=3, gamma=0.5)
    train(m, a, 5, device, scheduler=sched_a)
    train(m2, b, 5, device, scheduler=sched)
    fused = oft.fuse(b)
    assert isinstance(fused, getattr(oft, name)) and isinstance(fused, torch.optim.Optimizer)
    assert fused.param_groups[0] is b.param_groups[0]  # the scheduler attached to b keeps working
    train(m, a, 10, device, start=5, scheduler=sched_a)
    train(m2, fused, 10, device, start=5, scheduler=sched)
    assert rel_diff(m2, m) <= TOL


def test_fuse_rejects_what_it_cannot_do():
    m = make_model(torch.device("cpu"))
    with pytest.raises(optfuse.OptfuseError, match="LBFGS"):
        oft.fuse(torch.optim.LBFGS(m.parameters()))
    with pytest.raises(optfuse.OptfuseError, match="SparseAdam"):
        oft.fuse(torch.optim.SparseAdam(m.parameters()))
    assert type(oft.fuse(torch.optim.NAdam(m.parameters()))) is oft.NAdam  # a drop-in since uniform states
    # what a drop-in takes from torch's classes (torch's own class steps differentiable groups and
    # sparse gradients; complex parameters through their real views), fuse() takes too
    assert type(oft.fuse(torch.optim.Adam(m.parameters(), differentiable=True))) is oft.Adam
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    assert type(oft.fuse(torch.optim.SGD(emb.parameters(), lr=0.1))) is oft.SGD
    c = torch.zeros(3, dtype=torch.complex64, requires_grad=True)
    assert type(oft.fuse(torch.optim.Adam([c]))) is oft.Adam

    class Hand(torch.optim.Optimizer):  # no drop-in: traced, and a trace runs outside autograd
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1, differentiable=True))

        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    p.data.add_(p.grad, alpha=-g["lr"])
    with pytest.raises(optfuse.OptfuseError, match="differentiable"):
        oft.fuse(Hand(m.parameters()))


# --- errors of the optimizers ---------------------------------------------------------------------

def test_errors_are_clear():
    assert issubclass(optfuse.OptfuseError, ValueError)
    assert issubclass(optfuse.BackendUnavailable, RuntimeError)
    m = make_model(torch.device("cpu"))
    with pytest.raises(optfuse.OptfuseError, match="integer|int32|float32, float64"):
        oft.SGD([torch.zeros(2, dtype=torch.int32)], lr=0.1)
    with pytest.raises(RuntimeError, match="Adafactor does not support complex"):
        opt = oft.Adafactor([torch.zeros(2, 2, dtype=torch.complex64, requires_grad=True)])
        opt.param_groups[0]["params"][0].grad = torch.ones(2, 2, dtype=torch.complex64)
        opt.step()
    with pytest.raises(ValueError, match="learning rate"):
        oft.Adam(m.parameters(), lr=-1.0)  # torch's own validation
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = oft.Adam(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):  # torch's Adam's own error (it steps them)
        opt.step()


def test_foreach_fused_capturable_accepted_and_ignored(device):
    m = make_model(device)
    m2 = twin(m)
    ours = oft.Adam(m.parameters(), lr=1e-2, foreach=True, capturable=False, fused=None)
    ref = torch.optim.Adam(m2.parameters(), lr=1e-2, foreach=False)
    train(m, ours, 5, device)
    train(m2, ref, 5, device)
    assert rel_diff(m, m2) <= TOL
    assert ours.param_groups[0]["foreach"] is True


# --- Fused: any chain, rules in Python --------------------------------------------------------------

def scale_by_sign():
    return optfuse.Rule("scale_by_sign").hyper("strength", 1.0, optfuse.Range.non_negative()).update(
        lambda b: optfuse.sign(b.update()) * b.hyper("strength"))


def test_fused_with_a_rule_written_in_python(device):
    m = make_model(device)
    m2 = twin(m)
    chain = optfuse.chain(scale_by_sign(), optfuse.make_builtin("scale_by_learning_rate", lr=1e-2))
    opt = oft.Fused(chain, m.parameters())
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["strength"] == 1.0
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for s in range(6):
        opt.zero_grad()
        loss_of(m, s, device, torch.float32).backward()
        opt.step()
        sched.step()
        # the same math by hand on the twin
        m2.zero_grad()
        loss_of(m2, s, device, torch.float32).backward()
        with torch.no_grad():
            for p in m2.parameters():
                p.add_(torch.sign(p.grad), alpha=-(1e-2 * 0.5 ** (s // 2)))  # StepLR's lr for step s
    assert rel_diff(m, m2) <= TOL


def test_fused_spec_text_matches_clip_and_adamw(device):
    m = make_model(device)
    m2 = twin(m)
    opt = oft.Fused("chain(clip_by_global_norm(0.1), adamw(lr=1e-2, weight_decay=0))", m.parameters())
    ref = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0, foreach=False)
    for s in range(10):
        for model, o in ((m, opt), (m2, ref)):
            o.zero_grad()
            loss_of(model, s, device, torch.float32).backward()
            if o is ref:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, foreach=False)
            o.step()
    assert rel_diff(m, m2) <= 1e-5  # clip coefficient: float64 sum here, torch's per-tensor float32 norms
    assert set(opt.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_bfloat16_and_float32_parameters_in_one_optimizer(device):
    a = torch.randn(64, device=device, requires_grad=True)
    b = torch.randn(32, device=device, dtype=torch.bfloat16, requires_grad=True)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ours = oft.Adam([a, b], lr=1e-2)
    ref = torch.optim.Adam([a2, b2], lr=1e-2, foreach=False)
    for s in range(5):
        for x, y, o in ((a, b, ours), (a2, b2, ref)):
            o.zero_grad()
            ((x * x).sum() + (y.float() ** 2).sum()).backward()
            o.step()
    assert (a - a2).abs().max().item() <= TOL * a2.abs().max().item()
    assert (b.float() - b2.float()).abs().max().item() <= 5e-2 * b2.float().abs().max().item()
    assert len(ours._engines) == 1  # one kernel for both dtypes


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA is not available here: the mixed-device case needs a GPU")
def test_cpu_and_cuda_parameters_get_one_engine_each():
    a = torch.randn(8, requires_grad=True)
    b = torch.randn(8, device="cuda", requires_grad=True)
    opt = oft.SGD([a, b], lr=0.1)
    (a.sum() + b.sum()).backward()
    opt.step()
    assert len(opt._engines) == 2
    assert torch.allclose(a.detach(), a.detach())


def test_step_hooks_closure_and_pickle(device):
    import pickle

    m = make_model(device)
    opt = oft.Adam(m.parameters(), lr=1e-2)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))

    def closure():
        opt.zero_grad()
        loss = loss_of(m, 0, device, torch.float32)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert seen == ["pre", "post"] and loss.item() > 0
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    m2 = twin(m)
    ref = torch.optim.Adam(m2.parameters(), lr=1e-2, foreach=False)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(m, opt, 3, device, start=1)
    train(m2, ref, 3, device, start=1)
    assert rel_diff(m, m2) <= TOL


def test_fused_chain_without_hyperparameters(device):
    m = make_model(device)
    before = [p.detach().clone() for p in m.parameters()]
    rule = optfuse.Rule("minus_grad").update(lambda b: -b.update())
    opt = oft.Fused([rule], m.parameters())
    train(m, opt, 1, device)
    assert all(not torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert "step" in opt.state_dict()["state"][0]
