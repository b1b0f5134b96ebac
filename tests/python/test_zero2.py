"""optfuse.torch.distributed.ZeRO stage 2 and sharded (DCP) checkpoints on CPU ranks over gloo.

Stage 2: no DDP; every rank backpropagates its own batch and ZeRO reduce-scatters the local gradients
into the owners' shards (averaged: summed over ranks, then divided by the world size). On 1, 2 and 3
processes the parameters and the consolidated state are bitwise those of an unsharded optimizer of
the same class stepped on the same local gradients averaged the same way, computed here with an
all_reduce of the local gradients. The all_reduce's buffer has ZeRO's layout (rank r's shard in row r
of a [world, n] buffer): gloo adds up each element in an order that depends on where it sits in the
buffer, so at 3 ranks another layout rounds some sums differently (at 1 and 2 ranks any layout gives
the same sums). Cases: AdamW, Adam, SGD with momentum, Lamb (per-tensor norms and a global clip
exchanged across ranks), Fused clip and skip_if_nonfinite chains (a NaN in one rank's local
gradients skips the step on every rank), torch.optim.AdamW under torch.amp.GradScaler (also with an
inf in one rank's local gradients: every rank skips and keeps the same scale), a consolidated state
dict reloaded mid-run, the full gradients freed after each step.

DCP: the sharded optimizer state saved with torch.distributed.checkpoint by 2 ranks (and 3) and
loaded by 1, 2 and 3 ranks; training continues bitwise equal to the unsharded optimizer continued
from the same point. Processes start with torch.multiprocessing, rendezvous through a file, and are
bounded by timeouts."""
import copy
import os
from datetime import timedelta

import pytest
import torch
import dcp_roundtrip
from ranks import report, spawn_ranks
from test_zero import same_state  # noqa: E402  (one definition of the state comparison)

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

STEPS = 8
NAN_STEP = 3
CASES = [  # (label, class or Fused spec, options)
    ("AdamW", "AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW all_reduce", "AdamW", dict(lr=1e-2, weight_decay=0.1)),  # the fallback of backends without reduce_scatter
    ("Adam", "Adam", dict(lr=1e-2, amsgrad=True)),
    ("SGD", "SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("Lamb", "Lamb", dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)),
    ("clip + adamw", "chain(clip_by_global_norm(max_norm=0.05), adamw(lr=0.01))", dict(max_norm=0.02)),
    ("skip_if_nonfinite + sgd", "chain(skip_if_nonfinite(), sgd(lr=0.05, momentum=0.9))", {}),
]


def make_model(dtype=torch.float32):
    torch.manual_seed(0)  # the same model on every rank
    # 21000 + 40040 elements: with 2 or 3 ranks the shard boundaries (at multiples of the 16384-element
    # chunk into a tensor) fall inside the weights
    return torch.nn.Sequential(torch.nn.Linear(20, 1000), torch.nn.Tanh(), torch.nn.Linear(1000, 40)).to(dtype)


def make_opt(oft, name, params, kw):
    return oft.Fused(name, params, **kw) if name.startswith("chain(") else getattr(oft, name)(params, **kw)


def data(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 20, generator=g), torch.randn(8, 40, generator=g)


def averaged(grads, world):
    """The local gradients averaged over the ranks as ZeRO does (sum, then / world, in their dtype),
    through an all_reduce of a buffer in ZeRO's layout (see the module docstring)."""
    from optfuse import _core
    from optfuse.torch.distributed import shard_ranges
    ranges = shard_ranges([g.numel() for g in grads], world, _core.chunk_elements("cpu"))
    flat = torch.cat([g.reshape(-1) for g in grads])
    n = max(b - a for a, b in ranges)
    buf = torch.zeros(world, n, dtype=flat.dtype)
    for r, (a, b) in enumerate(ranges):
        buf[r, :b - a] = flat[a:b]
    dist.all_reduce(buf)
    buf.div_(world)
    flat = torch.cat([buf[r, :b - a] for r, (a, b) in enumerate(ranges)])
    return [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)]


def backward_local(model, rank, s, nan_at=None, scaler=None):
    import torch.nn.functional as F
    x, y = data(rank, s)
    dtype = next(model.parameters()).dtype
    loss = F.mse_loss(model(x.to(dtype)), y.to(dtype))
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if s == nan_at and rank == dist.get_world_size() - 1:  # only this rank's local gradients
        model[0].weight.grad.view(-1)[5] = float("nan")


def ref_grads(model, ref_model, world):
    for q, g in zip(ref_model.parameters(), averaged([p.grad for p in model.parameters()], world)):
        q.grad = g


def equal_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def init(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))


def stage2_worker(rank, world, init_file, out_dir):
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO
    init(rank, world, init_file)
    out = {}
    for label, name, kw in CASES:
        model = make_model()
        ref_model = copy.deepcopy(model)
        zero = ZeRO(make_opt(oft, name, model.parameters(), kw), stage=2)
        ref = make_opt(oft, name, ref_model.parameters(), kw)
        fallback = label.endswith("all_reduce")
        zero._reduce_scatter = False if fallback else None
        nan_at = NAN_STEP if "nonfinite" in name else None
        res = dict(freed=True, kept=True, skipped=None)
        for s in range(STEPS):
            if s == STEPS // 2:  # a consolidated state dict into a new ZeRO mid-run
                sd = zero.state_dict()
                zero = ZeRO(make_opt(oft, name, model.parameters(), kw), stage=2)
                zero.load_state_dict(sd)
                zero._reduce_scatter = False if fallback else None
            zero.zero_grad()
            backward_local(model, rank, s, nan_at)
            ref_grads(model, ref_model, world)
            before = [p.detach().clone() for p in model.parameters()]
            zero.step()
            ref.step()
            ref.zero_grad()
            res["freed"] &= all(p.grad is None for p in model.parameters())
            res["kept"] &= all(p.grad is not None for p in model.parameters())
            if s == nan_at:
                res["skipped"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        res.update(reduce_scatter=zero._reduce_scatter, params_equal=equal_params(model, ref_model),
                   moved=not equal_params(model, make_model()),
                   state_equal=same_state(zero.state_dict()["state"], ref.state_dict()["state"]),
                   local_state=zero.local_state_numel())
        out[label] = res
    # torch.optim.AdamW (fused by ZeRO) under GradScaler, against optfuse's AdamW unsharded. At
    # INF_STEP one rank's local gradients hold an inf: with reduce_gradients() before scaler.step
    # every rank skips and backs its scale off alike.
    for label, explicit in (("gradscaler", False), ("gradscaler inf", True)):
        model = make_model()
        ref_model = copy.deepcopy(model)
        zero = ZeRO(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False), stage=2)
        ref = oft.AdamW(ref_model.parameters(), lr=1e-2)
        scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3) for _ in range(2)]
        scales, skipped = [], None
        for s in range(STEPS):
            zero.zero_grad()
            backward_local(model, rank, s, nan_at=NAN_STEP if explicit else None, scaler=scalers[0])
            ref_grads(model, ref_model, world)  # the scaled, averaged gradients (inf where a rank had one)
            if explicit:
                zero.reduce_gradients()
            before = [p.detach().clone() for p in model.parameters()]
            scalers[0].step(zero)
            scalers[0].update()
            scalers[1].scale(torch.zeros(()))
            scalers[1].step(ref)  # its own check of the averaged gradients
            scalers[1].update()
            ref.zero_grad()
            scales.append(float(scalers[0].get_scale()))
            assert scales[-1] == float(scalers[1].get_scale()), (s, scales[-1], scalers[1].get_scale())
            if explicit and s == NAN_STEP:
                skipped = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        out[label] = dict(params_equal=equal_params(model, ref_model), moved=not equal_params(model, make_model()),
                          scales=scales, skipped=skipped)
    report(out_dir, rank, out)


DCP_CASES = [
    ("AdamW", "AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("Lamb", "Lamb", dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)),
    ("clip + adamw", "chain(clip_by_global_norm(max_norm=0.05), adamw(lr=0.01))", dict(max_norm=0.02)),
    ("AdamW master_weights bf16", "AdamW", dict(lr=1e-2, master_weights=True)),
]
DCP_STEPS = 4


def dcp_case_model(label):
    return make_model(torch.bfloat16 if "bf16" in label else torch.float32)


def dcp_worker(rank, world, init_file, out_dir, phase, ckpt_dir):
    """phase "save": train DCP_STEPS, save ZeRO's state with DCP and (rank 0) the unsharded reference.
    phase "load": a new ZeRO of this world size loads it and both continue DCP_STEPS."""
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO
    init(rank, world, init_file)
    out = {}
    for label, name, kw in DCP_CASES:
        ckpt = os.path.join(ckpt_dir, label.replace(" ", "_"))
        model = dcp_case_model(label)
        ref_model = copy.deepcopy(model)
        start = 0
        if phase == "load":
            saved = dcp_roundtrip.load_weights(ckpt, model, ref_model)
            start = DCP_STEPS
        zero = ZeRO(make_opt(oft, name, model.parameters(), kw), stage=2)
        ref = make_opt(oft, name, ref_model.parameters(), kw)
        if phase == "load":
            dcp_roundtrip.load_optimizers(ckpt, zero, ref, saved)
            out[label + " loaded"] = same_state(zero.state_dict()["state"], saved["ref"]["state"])
        for s in range(start, start + DCP_STEPS):
            zero.zero_grad()
            backward_local(model, rank, s)
            ref_grads(model, ref_model, world)
            zero.step()
            ref.step()
            ref.zero_grad()
        out[label] = dict(params_equal=equal_params(model, ref_model),
                          state_equal=same_state(zero.state_dict()["state"], ref.state_dict()["state"]))
        if phase == "save":
            dcp_roundtrip.save(ckpt, zero, ref, model, rank)
    report(out_dir, rank, out)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_zero2_is_bitwise_the_unsharded_optimizer_on_averaged_gradients(world, tmp_path):
    results = spawn_ranks(stage2_worker, world, tmp_path)
    for rank, res in enumerate(results):
        for label, _, _ in CASES:
            r = res[label]
            assert r["moved"], (label, "training did not move the parameters: the comparison would be vacuous")
            assert r["params_equal"] and r["state_equal"], (world, rank, label, r)
            if world > 1:
                assert r["freed"], (label, "full gradients were kept after the step")
            else:  # one rank: the gradients are its averaged shard, kept until zero_grad (no per-step free)
                assert r["kept"], (label, "one rank freed its gradients")
            if world > 1:  # the forced fallback took it; the others found out (gloo has reduce_scatter in torch 2.15)
                assert r["reduce_scatter"] is False if label.endswith("all_reduce") else r["reduce_scatter"] in (
                    True, False), (label, r["reduce_scatter"])
            if "nonfinite" in label:
                assert r["skipped"] is True, (world, rank, "the NaN step was not skipped on every rank")
        for label in ("gradscaler", "gradscaler inf"):
            r = res[label]
            assert r["params_equal"] and r["moved"], (world, rank, label, r)
            assert r["scales"] == results[0][label]["scales"], (world, rank, label)
        assert res["gradscaler inf"]["skipped"] is True
        s = res["gradscaler inf"]["scales"]
        assert s[NAN_STEP] == s[NAN_STEP - 1] / 2, s  # backed off
    if world > 1:  # each rank holds about 1/N of the state (plus up to one 16384-element chunk per state)
        for label, _, _ in CASES:
            full = sum(res[label]["local_state"] for res in results)
            assert max(res[label]["local_state"] for res in results) <= full / world + 16384 * (full // 61040), label


BUCKET_MB = 0.1  # 26214 float32: buckets [weight 0, bias 0], [weight 1], [bias 1] of make_model()
BUCKET_CASES = [c for c in CASES if c[0] in ("AdamW", "Lamb", "clip + adamw")]


def bucket_worker(rank, world, init_file, out_dir):
    """Stage 2 in small buckets: reduce-scatters started by backward (every bucket complete before the
    step), several runs of chunks per rank in the partial-sum exchange; gradients accumulated over two
    backward passes (with and without no_sync: the step sends again what a later backward changed);
    GradScaler.unscale_ after backward sent the scaled gradients. Against the unsharded optimizer."""
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO
    init(rank, world, init_file)
    out = {}
    variants = [(label, name, kw, how) for label, name, kw in BUCKET_CASES for how in ("plain",)]
    variants += [("AdamW", "AdamW", dict(lr=1e-2), how)
                 for how in ("accumulate", "no_sync", "unscale_", "unscale_ clip", "overlap=False")]
    for label, name, kw, how in variants:
        model = make_model()
        ref_model = copy.deepcopy(model)
        zero = ZeRO(make_opt(oft, name, model.parameters(), kw), stage=2, bucket_cap_mb=BUCKET_MB,
                    overlap=how != "overlap=False")
        ref = make_opt(oft, name, ref_model.parameters(), kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if how.startswith("unscale_") else None
        sent_in_backward, warned = [], []
        for s in range(STEPS):
            zero.zero_grad()
            if how == "no_sync":
                with zero.no_sync():
                    backward_local(model, rank, s + 100)
            elif how == "accumulate":
                backward_local(model, rank, s + 100)
            backward_local(model, rank, s, scaler=scaler)
            sent_in_backward.append(zero._reducer.next if zero._reducer is not None else None)
            if scaler is not None:
                scaler.unscale_(zero)  # in place, after backward sent the scaled gradients
            ref_grads(model, ref_model, world)
            if how == "unscale_ clip":
                zero.clip_grad_norm_(0.05)
                torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
            if scaler is not None:
                import warnings
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    scaler.step(zero)
                warned.append(sum("GradScaler.unscale_" in str(w.message) for w in caught))
                scaler.update()
            else:
                zero.step()
            ref.step()
            ref.zero_grad()
        out[f"{label} {how}"] = dict(
            params_equal=equal_params(model, ref_model), moved=not equal_params(model, make_model()), warned=warned,
            rel_err=max(float((p - q).abs().max() / q.abs().max()) for p, q in zip(model.parameters(),
                                                                              ref_model.parameters())),
            buckets=len(zero._buckets), sent_in_backward=sent_in_backward,
            state_equal=same_state(zero.state_dict()["state"], ref.state_dict()["state"]))
    report(out_dir, rank, out)


@pytest.mark.parametrize("world", [1, 2])
def test_zero2_buckets_sent_during_backward_are_bitwise_the_unsharded_optimizer(world, tmp_path):
    # (2 ranks: each element's sum is the same in any buffer layout, so the reference's all_reduce
    # of one flat layout gives ZeRO's bucketed sums exactly)
    results = spawn_ranks(bucket_worker, world, tmp_path)
    for rank, res in enumerate(results):
        assert set(res) == {f"{c[0]} plain" for c in BUCKET_CASES} | {
            "AdamW accumulate", "AdamW no_sync", "AdamW unscale_", "AdamW unscale_ clip", "AdamW overlap=False"}
        for label, r in res.items():
            assert r["moved"], (label, "training did not move the parameters: the comparison would be vacuous")
            assert r["buckets"] == 3, r
            if label.endswith("clip"):  # the clip folded into the step: torch's clip to rounding
                assert r["rel_err"] <= 2e-6, (world, rank, label, r)
            else:
                assert r["params_equal"] and r["state_equal"], (world, rank, label, r)
            if world == 1:  # one rank reduces nothing: its gradients are stepped where they are
                assert r["sent_in_backward"] == [None] * STEPS, r
                assert r["warned"] in ([], [0] * STEPS), r
            elif label.endswith("overlap=False"):  # nothing sent during backward: all of it at the step
                assert r["sent_in_backward"] == [0] * STEPS, (label, r["sent_in_backward"])
            elif "unscale_" in label:
                # GradScaler.unscale_ after backward sent the scaled gradients: the step sends them again,
                # then the reduction waits for the step; a clip that used them is redone, with a warning
                assert r["sent_in_backward"] == [3] + [0] * (STEPS - 1), (label, r["sent_in_backward"])
                assert r["warned"] == ([1] if label.endswith("clip") else [0]) + [0] * (STEPS - 1), (label, r["warned"])
            else:  # every bucket was complete, so sent, before backward returned
                assert r["sent_in_backward"] == [3] * STEPS, (label, r["sent_in_backward"])


@pytest.mark.parametrize("saved_by,loaded_by", [(2, 1), (2, 3), (3, 2), (2, 2)])
def test_dcp_checkpoint_reshards_and_training_continues_bitwise(saved_by, loaded_by, tmp_path):
    for phase, rank, res in dcp_roundtrip.run(dcp_worker, saved_by, loaded_by, tmp_path):
        for label, _, _ in DCP_CASES:
            assert res[label] == dict(params_equal=True, state_equal=True), (phase, rank, label, res[label])
            if phase == "load":
                assert res[label + " loaded"] is True, (rank, label, "the loaded state is not the saved one")


def mismatch_worker(rank, world, init_file, out_dir, ckpt):
    import torch.distributed.checkpoint as dcp
    import optfuse
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO
    init(rank, world, init_file)
    model = make_model()
    zero = ZeRO(oft.AdamW(model.parameters(), lr=1e-2), stage=2)
    backward_local(model, rank, 0)
    zero.step()
    dcp.save(zero.sharded_state_dict(), checkpoint_id=ckpt)
    other = torch.nn.Sequential(torch.nn.Linear(20, 999), torch.nn.Tanh(), torch.nn.Linear(999, 40))
    zero2 = ZeRO(oft.AdamW(other.parameters(), lr=1e-2), stage=2)
    sd = zero2.sharded_state_dict(like=dcp.FileSystemReader(ckpt).read_metadata())
    try:
        dcp.load(sd, checkpoint_id=ckpt)
        zero2.load_sharded_state_dict(sd)
        msg = None
    except (optfuse.OptfuseError, RuntimeError, ValueError) as e:
        msg = f"{type(e).__name__}: {e}"
    report(out_dir, rank, {"error": msg})


def test_dcp_checkpoint_of_another_model_is_refused(tmp_path):
    (res,) = spawn_ranks(mismatch_worker, 1, tmp_path, str(tmp_path / "ckpt"))
    assert res["error"] is not None and "elements" in res["error"], res  # ZeRO's check, before any state is installed
    assert res["error"].startswith("OptfuseError"), res
