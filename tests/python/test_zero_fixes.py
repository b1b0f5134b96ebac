"""ZeRO against torch.optim on what issue 30 found (2 gloo CPU ranks, spawned as in test_zero.py):
0-dim parameters (a learnable temperature) under optimizers whose constructor makes state (Adagrad)
or that keep per-parameter scalars (ASGD's eta and mu, NAdam's mu_product), also across a
consolidated state dict and a sharded (DCP) checkpoint; a parameter's storage replaced after ZeRO was built (`p.data =
p.data.clone()`: re-cut on the new storage; another shape or dtype: a clear error, nothing changed);
`_step_supports_amp_scaling` True only for GradScaler.step."""
from datetime import timedelta

import pytest
import torch
from ranks import report, spawn_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

STEPS = 6


class Scaled(torch.nn.Module):
    """A linear layer between two learnable 0-dim scalars (a temperature, a logit scale)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))
        self.lin = torch.nn.Linear(6, 5)
        self.scale = torch.nn.Parameter(torch.tensor(-0.25))


def grads(model, step):
    g = torch.Generator().manual_seed(step)  # the same gradients on every rank (as after DDP's average)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def worst(a, b):
    """The largest difference between the parameters of two models, relative to the parameter scale."""
    return max(float((p - q).detach().abs().max()) / max(float(q.detach().abs().max()), 1e-3)
               for p, q in zip(a.parameters(), b.parameters()))


def same_state(ours, theirs):
    """The largest relative difference between two torch-format states (None: different keys)."""
    if ours.keys() != theirs.keys():
        return None
    diff = 0.0
    for i in ours:
        if ours[i].keys() != theirs[i].keys():
            return None
        for k in ours[i]:
            x, y = torch.as_tensor(ours[i][k]).double(), torch.as_tensor(theirs[i][k]).double()
            if x.shape != y.shape:
                return None
            diff = max(diff, float((x - y).abs().max()) / max(float(y.abs().max()), 1e-3) if x.numel() else 0.0)
    return diff


ZERO_DIM_CASES = [("Adagrad", dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
                  ("Adam", dict(lr=0.05)), ("ASGD", dict(lr=0.05, t0=2)), ("NAdam", dict(lr=0.05))]


def zero_dim_worker(rank, world, init_file, out_dir):
    import torch.distributed.checkpoint as dcp
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    runs = [(stage, name, kw, "consolidated") for stage in (1, 2) for name, kw in ZERO_DIM_CASES]
    runs += [(stage, name, kw, "dcp") for stage in (1, 2) for name, kw in ZERO_DIM_CASES[::2]]
    for stage, name, kw, how in runs:
        model, ref_model = Scaled(), Scaled()
        zero = ZeRO(getattr(oft, name)(model.parameters(), **kw), stage=stage)
        ref = getattr(torch.optim, name)(ref_model.parameters(), **kw)
        diff = 0.0
        for s in range(STEPS):
            if s == STEPS // 2:  # a checkpoint into a new ZeRO, whose optimizer made state
                if how == "consolidated":
                    sd = zero.state_dict()
                    zero = ZeRO(getattr(oft, name)(model.parameters(), **kw), stage=stage)
                    zero.load_state_dict(sd)
                else:  # sharded (DCP), saved and loaded by the same ranks
                    ckpt = f"{out_dir}/ckpt-{stage}-{name}"
                    dcp.save(zero.sharded_state_dict(), checkpoint_id=ckpt)
                    zero = ZeRO(getattr(oft, name)(model.parameters(), **kw), stage=stage)
                    sd = zero.sharded_state_dict(like=dcp.FileSystemReader(ckpt).read_metadata())
                    dcp.load(sd, checkpoint_id=ckpt)
                    zero.load_sharded_state_dict(sd)
            for p, q, g in zip(model.parameters(), ref_model.parameters(), grads(model, s)):
                p.grad, q.grad = g.clone(), g.clone()
            zero.step()
            ref.step()
            diff = max(diff, worst(model, ref_model))
        out[f"stage {stage} {name} {how}"] = dict(
            param=diff, state=same_state(zero.state_dict()["state"], ref.state_dict()["state"]),
            moved=worst(model, Scaled()) > 1e-3)
    report(out_dir, rank, out)


def test_zero_dim_parameters_match_torch_step_for_step(tmp_path):
    for rank, res in enumerate(spawn_ranks(zero_dim_worker, 2, tmp_path, timeout=300)):
        for label, r in res.items():
            assert r["moved"], (rank, label)
            assert r["param"] <= 1e-6 and r["state"] is not None and r["state"] <= 1e-6, (rank, label, r)


def storage_worker(rank, world, init_file, out_dir):
    """p.data = p.data.clone() between steps: the next steps update the new storage, as torch.optim's;
    the old one is left alone. p.data of another dtype: refused, parameters and state unchanged."""
    import optfuse
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    cases = [("AdamW", oft.AdamW, torch.optim.AdamW, dict(lr=0.05)),
             ("Adafactor", oft.Adafactor, torch.optim.Adafactor, dict(lr=0.05))]
    for stage in (1, 2):
        for name, ours, theirs, kw in cases:
            model, ref_model = Scaled(), Scaled()
            zero = ZeRO(ours(model.parameters(), **kw), stage=stage)
            ref = theirs(ref_model.parameters(), **kw)
            diff, old_kept = 0.0, True
            for s in range(STEPS):
                if s in (2, 4):  # every parameter (step 2) or one (step 4) moves to new storage
                    moved = list(model.parameters()) if s == 2 else [model.lin.weight]
                    old = [(p.data, p.data.clone()) for p in moved]
                    for p in moved:
                        p.data = p.data.clone()
                for p, q, g in zip(model.parameters(), ref_model.parameters(), grads(model, s)):
                    p.grad, q.grad = g.clone(), g.clone()
                if s == 4:  # (stage 2: reduced before the step notices the new storage; a clip of 1)
                    zero.clip_grad_norm_(1e9)
                zero.step()
                ref.step()
                if s in (2, 4):
                    old_kept = old_kept and all(torch.equal(a, b) for a, b in old)
                diff = max(diff, worst(model, ref_model))
            # another dtype: refused on every rank before anything changes
            before = [p.detach().clone() for p in model.parameters()]
            state_before = zero.state_dict()["state"]
            weight = model.lin.weight.data
            model.lin.weight.data = weight.double()
            for p, g in zip(model.parameters(), grads(model, 99)):
                p.grad = g.to(p.dtype)
            try:
                zero.step()
                message = "stepped"
            except optfuse.OptfuseError as e:
                message = str(e)
            model.lin.weight.data = weight
            unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            model.lin.weight.grad = model.lin.weight.grad.float()
            out[f"stage {stage} {name}"] = dict(param=diff, old_kept=old_kept, message=message, unchanged=unchanged,
                                                state_unchanged=same_state(zero.state_dict()["state"],
                                                                           state_before) == 0.0)
    report(out_dir, rank, out)


def test_parameter_storage_replaced_after_zero_was_built(tmp_path):
    for rank, res in enumerate(spawn_ranks(storage_worker, 2, tmp_path, timeout=300)):
        for label, r in res.items():
            assert r["param"] <= 1e-6 and r["old_kept"], (rank, label, r)
            assert r["message"].startswith("ZeRO: parameter 2 of group 0 was replaced by a tensor of shape (5, 6), "
                                           "torch.float64"), (rank, label, r["message"])
            assert r["unchanged"] and r["state_unchanged"], (rank, label, r)


def amp_worker(rank, world, init_file, out_dir):
    """_step_supports_amp_scaling: False for anyone but GradScaler.step (Lightning's bf16 clipping
    check), which still hands found_inf to step(); stage 1 of whole parameters: False for it too."""
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    for label, make, stage in [("AdamW stage 1", oft.AdamW, 1), ("AdamW stage 2", oft.AdamW, 2),
                               ("Adafactor stage 1", oft.Adafactor, 1), ("Adafactor stage 2", oft.Adafactor, 2)]:
        model = Scaled()
        zero = ZeRO(make(model.parameters(), lr=0.01), stage=stage)
        seen = []
        inner_step = zero._step_impl

        def spy(*a, _inner=inner_step, _zero=zero, **k):
            seen.append(getattr(_zero, "found_inf", None) is not None)
            return _inner(*a, **k)

        zero._step_impl = spy
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.zeros(()))  # (its scale made, as scaling the loss would)
        for p, g in zip(model.parameters(), grads(model, 0)):
            p.grad = g
        scaler.step(zero)
        scaler.update()
        out[label] = dict(asked=bool(zero._step_supports_amp_scaling),
                          attr=bool(getattr(zero, "_step_supports_amp_scaling", False)), found_inf_given=seen)
    report(out_dir, rank, out)


def test_step_supports_amp_scaling_only_for_gradscaler(tmp_path):
    for rank, res in enumerate(spawn_ranks(amp_worker, 2, tmp_path, timeout=200)):
        for label, r in res.items():
            assert not r["asked"] and not r["attr"], (rank, label, r)
            takes = label != "Adafactor stage 1"
            assert r["found_inf_given"] == [takes], (rank, label, r)
