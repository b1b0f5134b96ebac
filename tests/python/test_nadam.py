"""optfuse.torch.NAdam against torch.optim.NAdam (foreach=False), and the core's uniform states it
stands on: mu_product is one float64 per internal group, kept across steps in the scalar table,
committed only where a step is not skipped, seeded from and written back to torch's per-parameter
0-dim tensors. (torch's optim_db grid for NAdam runs in test_optim_db.py; state-dict round trips
and fuse() under an lr schedule in test_torch_parity.py.)"""
import copy

import numpy as np
import pytest
import torch

import optfuse
import optfuse.torch as oft
from conftest import loss_of, make_model, rel_diff, twin

F32_TOL = 1e-6
CUDA_F32_TOL = 2e-6


def tol(device):
    return CUDA_F32_TOL if device.type == "cuda" else F32_TOL


def mu_products(opt):
    return {i: float(st["mu_product"]) for i, st in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.1, decoupled_weight_decay=True, momentum_decay=6e-3)],
                         ids=["default", "decoupled"])
def test_thirty_steps_with_zero_grad_and_an_lr_scheduler(kw, device):
    model = make_model(device)
    ref_model = twin(model)
    ours = oft.NAdam(model.parameters(), lr=1e-2, **kw)
    ref = torch.optim.NAdam(ref_model.parameters(), lr=1e-2, foreach=False, **kw)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.7) for o in (ours, ref)]
    for s in range(30):
        for m, o, sch in ((model, ours, scheds[0]), (ref_model, ref, scheds[1])):
            o.zero_grad()
            loss_of(m, s, device, torch.float32).backward()
            o.step()
            sch.step()
        assert rel_diff(model, ref_model) <= tol(device), f"step {s}"
    assert rel_diff(ref_model, make_model(device)) > 1e-2
    a, b = ours.state_dict()["state"], ref.state_dict()["state"]
    for i in b:
        assert torch.equal(a[i]["step"], b[i]["step"])
        assert a[i]["mu_product"].dtype == b[i]["mu_product"].dtype == torch.float32
        assert torch.equal(a[i]["mu_product"], b[i]["mu_product"].cpu()), (i, a[i]["mu_product"], b[i]["mu_product"])
    assert float(b[0]["mu_product"]) < 1e-3  # the product moved far from its init value


def test_a_skipped_step_keeps_mu_product(device):
    """found_inf (a GradScaler's overflow): the core does not commit mu_product or the step; torch's
    GradScaler does not call step() at all. Both continue identically."""
    model = make_model(device)
    ref_model = twin(model)
    ours = oft.NAdam(model.parameters(), lr=1e-2)
    ref = torch.optim.NAdam(ref_model.parameters(), lr=1e-2, foreach=False)
    skip = torch.ones(1, device=device)
    go = torch.zeros(1, device=device)
    scale = torch.ones(1, device=device)
    for s in range(8):
        skipped = s in (2, 5, 6)
        for m, o in ((model, ours), (ref_model, ref)):
            o.zero_grad()
            loss_of(m, s, device, torch.float32).backward()
        before = mu_products(ours) if s else None
        ours.step(grad_scale=scale, found_inf=skip if skipped else go)
        if not skipped:
            ref.step()
        else:
            assert mu_products(ours) == before, f"step {s} was skipped but mu_product changed"
        assert rel_diff(model, ref_model) <= tol(device), f"step {s}"
    assert mu_products(ours) == mu_products(ref)
    assert float(ours.state_dict()["state"][0]["step"]) == 5


def test_grad_scaler_skip_keeps_mu_product():
    """torch.amp.GradScaler on CPU: an inf gradient skips the step; mu_product and step stay."""
    model = make_model(torch.device("cpu"))
    ref_model = twin(model)
    ours = oft.NAdam(model.parameters(), lr=1e-2)
    ref = torch.optim.NAdam(ref_model.parameters(), lr=1e-2, foreach=False)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) for _ in range(2)]
    for s in range(6):
        for m, o, sc in ((model, ours, scalers[0]), (ref_model, ref, scalers[1])):
            o.zero_grad()
            loss = loss_of(m, s, torch.device("cpu"), torch.float32)
            if s == 3:
                loss = loss * float("inf")
            sc.scale(loss).backward()
            sc.step(o)
            sc.update()
        if s == 3:
            assert float(ours.state_dict()["state"][0]["step"]) == 3
        assert rel_diff(model, ref_model) <= F32_TOL, f"step {s}"
    assert mu_products(ours) == mu_products(ref)


def test_parameters_of_one_group_with_different_mu_products(device):
    """A state dict where parameters of one torch group (same step) disagree on mu_product: each keeps
    its own (the engine splits the internal group), as torch's per-parameter tensors do."""
    model = make_model(device)
    ref = torch.optim.NAdam(model.parameters(), lr=1e-2, foreach=False)
    for s in range(3):
        ref.zero_grad()
        loss_of(model, s, device, torch.float32).backward()
        ref.step()
    sd = copy.deepcopy(ref.state_dict())
    sd["state"][1]["mu_product"] = sd["state"][1]["mu_product"] * 0.5
    sd["state"][3]["mu_product"] = sd["state"][3]["mu_product"] * 0.25
    ref_model = twin(model)
    ref2 = torch.optim.NAdam(ref_model.parameters(), lr=1e-2, foreach=False)
    ref2.load_state_dict(copy.deepcopy(sd))
    ours = oft.NAdam(model.parameters(), lr=1e-2)
    ours.load_state_dict(sd)
    for s in range(3, 8):
        for m, o in ((model, ours), (ref_model, ref2)):
            o.zero_grad()
            loss_of(m, s, device, torch.float32).backward()
            o.step()
        assert rel_diff(model, ref_model) <= tol(device), f"step {s}"
    got, want = mu_products(ours), mu_products(ref2)
    assert got == want
    assert len(set(got.values())) == 3
    engine = next(iter(ours._engines.values()))
    assert len(engine.groups) == 3  # (group 0, step 3) split by mu_product


def test_a_parameter_added_later_starts_its_own_mu_product(device):
    model, ref_model = make_model(device), make_model(device)
    extra, ref_extra = (torch.nn.Parameter(torch.linspace(-1, 1, 7, device=device)) for _ in range(2))
    opts = []
    for m, e, cls in ((model, extra, oft.NAdam), (ref_model, ref_extra, torch.optim.NAdam)):
        kw = {} if cls is oft.NAdam else dict(foreach=False)
        opt = cls(m.parameters(), lr=1e-2, **kw)
        for s in range(8):
            if s == 4:
                opt.add_param_group({"params": [e], "lr": 0.02, "momentum_decay": 0.01})
            opt.zero_grad()
            loss = loss_of(m, s, device, torch.float32) + (e * e).sum() * (s >= 4)
            loss.backward()
            opt.step()
        opts.append(opt)
    ours, ref = opts
    assert rel_diff(model, ref_model) <= tol(device)
    assert (extra - ref_extra).abs().max().item() <= 1e-6
    assert mu_products(ours) == mu_products(ref)


def test_core_uniform_state_from_python():
    """A Python rule with a uniform state: acc <- acc * f + t, update = -acc_old * g."""
    r = optfuse.Rule("accumulate").hyper("f", 0.5).uniform_state("acc", 2.0)
    r.update(lambda b: (b.set_uniform_state("acc", b.uniform_state("acc") * b.hyper("f") + b.step()),
                        -b.uniform_state("acc") * b.update())[1])
    opt = optfuse.Optimizer([r], "cpu")
    assert opt.uniform_state_specs == [("acc", "accumulate.acc", 2.0)]
    p = np.full(5, 10.0, dtype=np.float32)
    g = np.ones(5, dtype=np.float32)
    opt.set_tensors([(p, g, [], 0)])
    for want_p, want_acc in ((8.0, 2.0), (6.0, 3.0), (3.0, 4.5)):
        opt.step()
        assert p[0] == want_p
        assert opt.uniform_state(0, "acc") == want_acc
    opt.add_group()
    assert opt.uniform_state(0, "acc") == 4.5 and opt.uniform_state(1, "acc") == 2.0
    opt.set_uniform_state(1, "accumulate.acc", 3.0)
    assert opt.uniform_state(1, "acc") == 3.0
    with pytest.raises(optfuse.OptfuseError, match="unknown uniform state"):
        opt.uniform_state(0, "nope")
    assert "mu_product" in optfuse.explain("nadam()")
