"""The loop users write (zero_grad() every step, forward, backward, step(), scheduler.step()) for
the drop-ins RAdam, Adamax, Adadelta, Rprop and ASGD, against torch's for-loop implementation
(foreach=False) on a deep copy of the same model: with lr schedulers (lr as a number and as a
tensor that the scheduler fills in place), and with parameters that lack a gradient on some steps.

The helpers and tolerances are test_training_loop.py's (assert_same_training: parameters within
1e-6 relative, or up to 10x that while as faithful to float64 math as torch's own float32 run;
state within 1e-4 of torch's relative to each tensor's largest element; steps exact).
"""
import pytest
import torch

import optfuse.torch as oft
from conftest import twin
from test_training_loop import (STEPS, _drop_some_grads, assert_same_training, case_id,
                                check_scheduler_fills_a_tensor_lr, check_training_loop_with_lr_scheduler, loop,
                                loss_with_holes, make_holey_model, make_scheduler, torch_cls, torch_run)

CASES = [
    ("RAdam", dict(lr=1e-2, weight_decay=0.1)),
    ("RAdam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)),
    ("Adamax", dict(lr=1e-2, weight_decay=0.1)),
    ("Adadelta", dict(lr=0.5, rho=0.8, weight_decay=0.01)),
    ("Rprop", dict(lr=1e-3, etas=(0.4, 1.3))),  # torch's Rprop reads lr only on a parameter's first step
    ("ASGD", dict(lr=0.05, lambd=0.1, t0=10, weight_decay=0.01)),  # eta from the previous step's lr
]


@pytest.mark.parametrize("sched", ["StepLR", "CosineAnnealingLR"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_training_loop_with_lr_scheduler(case, sched, device):
    check_training_loop_with_lr_scheduler(case, sched, device)


@pytest.mark.parametrize("sched", ["StepLR", "CosineAnnealingLR"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_scheduler_fills_a_tensor_lr(case, sched, device):
    """lr given as a tensor on the parameters' device: the scheduler fill_()s it, the kernel reads it."""
    name, kw = case
    check_scheduler_fills_a_tensor_lr(name, kw, sched, device, device)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_training_loop_parameters_without_grad_on_some_steps(case, device):
    name, kw = case
    model = make_holey_model(device)
    start, ref_model = twin(model), twin(model)
    ours = getattr(oft, name)(model.parameters(), **kw)
    ref = torch_cls(name)(ref_model.parameters(), foreach=False, **kw)
    loop(model, ours, device, extra=loss_with_holes, after_backward=_drop_some_grads)
    loop(ref_model, ref, device, extra=loss_with_holes, after_backward=_drop_some_grads)
    assert_same_training(model, ref_model, ours, ref, device, start, f64=torch_run(name, kw, device, holes=True))
    steps = {i: float(st["step"]) for i, st in ref.state_dict()["state"].items()}
    assert len(set(steps.values())) == 3, f"expected three different step counts, torch has {steps}"
    assert max(steps.values()) == STEPS


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_parameters_without_grad_on_some_steps_with_lr_scheduler(case, device):
    """ASGD is the one that needs this: a parameter that skipped steps keeps the eta of its own last
    step, computed with an lr that a scheduler has changed since."""
    name, kw = case
    model = make_holey_model(device)
    start, ref_model = twin(model), twin(model)
    ours = getattr(oft, name)(model.parameters(), **kw)
    ref = torch_cls(name)(ref_model.parameters(), foreach=False, **kw)
    loop(model, ours, device, extra=loss_with_holes, after_backward=_drop_some_grads,
         scheduler=make_scheduler("StepLR", ours))
    loop(ref_model, ref, device, extra=loss_with_holes, after_backward=_drop_some_grads,
         scheduler=make_scheduler("StepLR", ref))
    assert ref.param_groups[0]["lr"] < 0.5 * kw["lr"]
    assert_same_training(model, ref_model, ours, ref, device, start,
                         f64=torch_run(name, kw, device, holes=True, sched="StepLR"))


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_resume_from_torch_with_parameters_of_different_histories(case, device):
    """torch trains 22 steps (parameters skipping steps, lr schedule), optfuse loads its state dict
    and trains 8 more: the same as torch training all 30 (ASGD: each parameter's eta, computed with
    the lr of its own last step, is taken from its state)."""
    name, kw = case
    straight = make_holey_model(device)
    start, model = twin(straight), twin(straight)
    ref = torch_cls(name)(straight.parameters(), foreach=False, **kw)
    sched = make_scheduler("StepLR", ref)
    loop(straight, ref, device, extra=loss_with_holes, after_backward=_drop_some_grads, scheduler=sched)

    first = torch_cls(name)(model.parameters(), foreach=False, **kw)
    first_sched = make_scheduler("StepLR", first)
    half = 22  # StepLR halves lr from step 21 on, which the aux parameter skips (21 % 3 == 0)
    loop(model, first, device, steps=half, extra=loss_with_holes, after_backward=_drop_some_grads,
         scheduler=first_sched)
    if name == "ASGD":  # some etas come from the group's lr now, some from an older one: one lr would not do
        g = first.param_groups[0]
        from_lr_now = [float(st["eta"]) == float(torch.tensor(
            g["lr"] / (1 + kw["lambd"] * g["lr"] * float(st["step"])) ** kw.get("alpha", 0.75), dtype=torch.float32))
            for st in first.state_dict()["state"].values()]
        assert any(from_lr_now) and not all(from_lr_now), from_lr_now
    ours = getattr(oft, name)(model.parameters(), **kw)
    ours.load_state_dict(first.state_dict())
    ours_sched = make_scheduler("StepLR", ours)
    ours_sched.load_state_dict(first_sched.state_dict())
    loop(model, ours, device, steps=STEPS - half, start=half, extra=loss_with_holes,
         after_backward=_drop_some_grads, scheduler=ours_sched)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert_same_training(model, straight, ours, ref, device, start,
                         f64=torch_run(name, kw, device, holes=True, sched="StepLR"))
