"""optfuse.torch.distributed.ZeRO around Muon, MuonWithAuxAdam and Adafactor on CPU ranks over gloo.

Newton-Schulz orthogonalises whole matrices and Adafactor factors them, so each rank owns whole
parameters (shards cut at tensor starts only) and steps them with the wrapped class; the parameters
are then all-gathered. Another rule chain with row and column values is refused.
On 1, 2 and 3 processes, given the same (averaged) gradients on every rank, the parameters after 8
steps and the consolidated state dict (also reloaded into a new ZeRO mid-run) equal the unsharded
optimizer's, and each rank holds only its matrices' state. Stage 2 (no DDP: each rank's own
gradients, reduce-scattered into the owners' averaged shards): on 2 and 3 processes the parameters
and state are bitwise those of the unsharded optimizer stepped on the same local gradients averaged
the same way, also under a GradScaler with an inf in one rank's gradients (every rank skips alike).
Sharded (DCP) checkpoints: saved by 2 or 3 ranks, loaded by 1, 2 or 3, training continues bitwise
as the unsharded optimizer's.
Processes start with torch.multiprocessing, rendezvous through a file, and are bounded by timeouts."""
import copy
import os
from datetime import timedelta

import pytest
import torch
import dcp_roundtrip
from ranks import report, spawn_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

STEPS = 8
LABELS = ("Muon", "MuonWithAuxAdam", "Adafactor")


def make_model():
    # the same model on every rank; two 32 x 32 matrices (one Newton-Schulz batch unsharded); a conv
    # weight of 3 dimensions (Adafactor factors it matrix by matrix; Muon's split leaves it to AdamW)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 32, bias=False),
                               torch.nn.Linear(32, 32), torch.nn.Linear(32, 24, bias=False),
                               torch.nn.Conv1d(8, 8, 3, padding=1, bias=False))  # (8, 24) read as (channels, length)


def split(model):
    params = list(model.parameters())
    return [p for p in params if p.dim() == 2], [p for p in params if p.dim() != 2]


def make(oft, label, model):
    matrices, others = split(model)
    if label == "Muon":
        return oft.Muon(matrices, lr=0.02, weight_decay=0.01)
    if label == "Adafactor":  # matrices factored, vectors not: whole parameters per rank too
        return oft.Adafactor(model.parameters(), lr=0.01, weight_decay=0.01)
    return oft.MuonWithAuxAdam([dict(params=matrices, use_muon=True, lr=0.02, weight_decay=0.01),
                                dict(params=others, use_muon=False, lr=1e-3, weight_decay=0.01)])


def same_grads(model, ref_model, s):
    """Step s's gradients, the same on every rank (as DDP's averaged ones) and for the reference."""
    g = torch.Generator().manual_seed(s)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()


def same(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def worker(rank, world, init_file, out_dir):
    import optfuse
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    for label in LABELS:
        model = make_model()
        ref_model = copy.deepcopy(model)
        zero, ref = ZeRO(make(oft, label, model)), make(oft, label, ref_model)
        for s in range(STEPS):
            if s == STEPS // 2:  # the consolidated state dict into a new ZeRO mid-run
                sd = zero.state_dict()
                mid_state_equal = same(sd["state"], ref.state_dict()["state"])
                zero = ZeRO(make(oft, label, model))
                zero.load_state_dict(sd)
            same_grads(model, ref_model, s)
            zero.step()
            ref.step()
        full = sum(v.numel() for st in ref.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        out[label] = dict(params_equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())),
                          moved=any(not torch.equal(p, q) for p, q in zip(model.parameters(), make_model().parameters())),
                          state_equal=same(zero.state_dict()["state"], ref.state_dict()["state"]),
                          mid_state_equal=mid_state_equal, local=zero.local_state_numel(), full=full)
    # clip_grad_norm_ (the owned gradients scaled before the step) against torch's clip: to rounding
    model = make_model()
    ref_model = copy.deepcopy(model)
    zero, ref = ZeRO(make(oft, "MuonWithAuxAdam", model)), make(oft, "MuonWithAuxAdam", ref_model)
    norms = []
    for s in range(STEPS):
        same_grads(model, ref_model, s)
        norms.append((float(zero.clip_grad_norm_(1.0)), float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0))))
        zero.step()
        ref.step()
    out["clip"] = dict(norms=norms, rel_err=max(float((p - q).abs().max() / q.abs().max())
                                                for p, q in zip(model.parameters(), ref_model.parameters())))
    if world == 1:  # another chain with row and column values: refused, not stepped as flat vectors
        try:
            zero = ZeRO(oft.Fused("adafactor(lr=0.01)", make_model().parameters()))
            for p in zero.param_groups[0]["params"]:
                p.grad = torch.ones_like(p)
            zero.step()
            out["fused matrix plan"] = "no error"
        except optfuse.OptfuseError as e:
            out["fused matrix plan"] = str(e)
    report(out_dir, rank, out)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_zero_of_muon_owns_whole_matrices_and_equals_the_unsharded_optimizer(world, tmp_path):
    results = spawn_ranks(worker, world, tmp_path)
    for rank, res in enumerate(results):
        for label in LABELS:
            r = res[label]
            assert r["moved"], (label, "training did not move the parameters: the comparison would be vacuous")
            assert r["params_equal"] and r["state_equal"] and r["mid_state_equal"], (world, rank, label, r)
            if world > 1:  # only the owned matrices' state (whole matrices: not exactly 1/N)
                assert r["local"] < r["full"], (world, rank, label, r)
        assert sum(res[label]["local"] for res in results) == results[0][label]["full"], label
        clip = res["clip"]
        assert all(abs(a - b) <= 1e-6 * b and b > 1.0 for a, b in clip["norms"]), clip["norms"]  # the clip acts
        assert clip["rel_err"] <= 1e-5, clip
    if world == 1:
        assert "matrix plan" in results[0]["fused matrix plan"], results[0]["fused matrix plan"]


DCP_STEPS = 4


def dcp_worker(rank, world, init_file, out_dir, phase, ckpt_dir):
    """phase "save": train DCP_STEPS, save ZeRO's state with DCP and (rank 0) the unsharded reference.
    phase "load": a new ZeRO of this world size loads it and both continue DCP_STEPS."""
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    for label in LABELS:
        ckpt = os.path.join(ckpt_dir, label)
        model = make_model()
        ref_model = copy.deepcopy(model)
        start = 0
        if phase == "load":
            saved = dcp_roundtrip.load_weights(ckpt, model, ref_model)
            start = DCP_STEPS
        zero, ref = ZeRO(make(oft, label, model)), make(oft, label, ref_model)
        if phase == "load":
            dcp_roundtrip.load_optimizers(ckpt, zero, ref, saved)
            out[label + " loaded"] = same(zero.state_dict()["state"], saved["ref"]["state"])
        before = [p.detach().clone() for p in model.parameters()]
        for s in range(start, start + DCP_STEPS):
            same_grads(model, ref_model, s)
            zero.step()
            ref.step()
        out[label] = dict(params_equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())),
                          state_equal=same(zero.state_dict()["state"], ref.state_dict()["state"]),
                          moved=any(not torch.equal(p, b) for p, b in zip(model.parameters(), before)))
        if phase == "save":
            dcp_roundtrip.save(ckpt, zero, ref, model, rank)
    report(out_dir, rank, out)


@pytest.mark.parametrize("saved_by,loaded_by", [(2, 1), (2, 3), (3, 2)])
def test_dcp_checkpoint_of_muon_reshards_and_training_continues_bitwise(saved_by, loaded_by, tmp_path):
    for phase, rank, res in dcp_roundtrip.run(dcp_worker, saved_by, loaded_by, tmp_path):
        for label in LABELS:
            assert res[label] == dict(params_equal=True, state_equal=True, moved=True), (phase, rank, label, res[label])
            if phase == "load":
                assert res[label + " loaded"] is True, (rank, label, "the loaded state is not the saved one")


def averaged(grads, world):
    """The local gradients averaged over the ranks as stage 2 does for Muon (sum, then / world),
    through an all_reduce of a buffer in ZeRO's layout for whole matrices (one bucket, cut at tensor
    starts; rank r's part in row r): gloo's sum order depends on the layout at 3 ranks."""
    from optfuse.torch.distributed import shard_ranges
    sizes = [g.numel() for g in grads]
    ranges = shard_ranges(sizes, world, sum(sizes) + 1)
    flat = torch.cat([g.reshape(-1) for g in grads])
    buf = torch.zeros(world, max(b - a for a, b in ranges), dtype=flat.dtype)
    for r, (a, b) in enumerate(ranges):
        buf[r, :b - a] = flat[a:b]
    dist.all_reduce(buf)
    buf.div_(world)
    flat = torch.cat([buf[r, :b - a] for r, (a, b) in enumerate(ranges)])
    return [t.view_as(g) for t, g in zip(flat.split(sizes), grads)]


def stage2_worker(rank, world, init_file, out_dir):
    import torch.nn.functional as F
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}

    def local_backward(model, s, scaler=None, nan=False):
        g = torch.Generator().manual_seed(1000 * rank + s)  # this rank's own batch
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 24, generator=g)
        loss = F.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if nan and rank == world - 1:  # only this rank's local gradients
            model[0].weight.grad.view(-1)[5] = float("nan")

    for label in LABELS:
        model = make_model()
        ref_model = copy.deepcopy(model)
        zero, ref = ZeRO(make(oft, label, model), stage=2), make(oft, label, ref_model)
        freed = True
        for s in range(STEPS):
            zero.zero_grad()
            local_backward(model, s)
            for q, g in zip(ref_model.parameters(), averaged([p.grad for p in model.parameters()], world)):
                q.grad = g
            zero.step()
            ref.step()
            freed = freed and all(p.grad is None for g in zero.param_groups for p in g["params"])  # spent: freed
        out[label] = dict(params_equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())),
                          moved=any(not torch.equal(p, q) for p, q in zip(model.parameters(), make_model().parameters())),
                          state_equal=same(zero.state_dict()["state"], ref.state_dict()["state"]), freed=freed)
    # Under GradScaler: at step 3 one rank's local gradients hold a NaN; reduce_gradients() before
    # scaler.step makes every rank's check see it, so every rank skips and backs its scale off alike.
    model = make_model()
    ref_model = copy.deepcopy(model)
    zero, ref = ZeRO(make(oft, "MuonWithAuxAdam", model), stage=2), make(oft, "MuonWithAuxAdam", ref_model)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3) for _ in range(2)]
    scales, skipped = [], None
    for s in range(STEPS):
        zero.zero_grad()
        local_backward(model, s, scaler=scalers[0], nan=s == 3)
        for q, g in zip(ref_model.parameters(), averaged([p.grad for p in model.parameters()], world)):
            q.grad = g
        zero.reduce_gradients()
        before = [p.detach().clone() for p in model.parameters()]
        scalers[0].step(zero)
        scalers[0].update()
        scalers[1].scale(torch.zeros(()))
        scalers[1].step(ref)  # torch's standard path: unscale_, its own inf check, step
        scalers[1].update()
        ref.zero_grad()
        scales.append((float(scalers[0].get_scale()), float(scalers[1].get_scale())))
        if s == 3:
            skipped = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    out["gradscaler"] = dict(params_equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())),
                             scales=scales, skipped=skipped)
    report(out_dir, rank, out)


@pytest.mark.parametrize("world", [2, 3])
def test_zero2_of_muon_is_bitwise_the_unsharded_optimizer_on_averaged_gradients(world, tmp_path):
    results = spawn_ranks(stage2_worker, world, tmp_path)
    for rank, res in enumerate(results):
        for label in LABELS:
            assert res[label] == dict(params_equal=True, moved=True, state_equal=True, freed=True), (world, rank, label, res[label])
        r = res["gradscaler"]
        assert r["params_equal"] and r["skipped"] is True, (world, rank, r)
        assert all(a == b for a, b in r["scales"]) and r["scales"][3][0] < r["scales"][2][0], r["scales"]  # backed off alike
