"""optfuse.torch optimizers on a model sharded with torch's FSDP2 (`fully_shard`) on CPU ranks over
gloo, in the loop users write: zero_grad(), backward (FSDP2 reduce-scatters the averaged gradient:
each rank holds the DTensor gradient of its own rows), step(), an lr scheduler. On 1, 2 and 3
processes, with uneven shards and ranks whose shard of a tensor is empty.

What is exact and why: each rank steps its local shards with the element-wise kernel, so every
element sees the arithmetic the unsharded optimizer applies to it. The reference is therefore the
same optfuse optimizer, unsharded, stepped on the same averaged gradients (each DTensor gradient's
full_tensor()): parameters and states bitwise equal, 10 steps. Chains with reductions (global-norm
clip, Lamb, Lars, a non-finite skip) reduce over the mesh: their partial sums are cut at other
places than the unsharded step's, so they are held to 1e-6 relative (bitwise on 1 rank), and an inf
in one rank's shard skips the step on every rank. torch.optim.AdamW(foreach=False) on
the same FSDP2 model is not bitwise optfuse (single roundings differ, docs/python.md "Numerics"):
it is held to 1e-6 relative, and its state dict has the same keys, types (DTensor states with the
parameter's placements) and shapes as ours. State dicts: the optimizer's own (DTensor states) into a
new optimizer, and torch.distributed.checkpoint (get_optimizer_state_dict, dcp.save / dcp.load,
set_optimizer_state_dict on a fresh optimizer, whose state is initialised by torch with a zero-grad
step at lr=0) mid-run: training continues bitwise equal. Processes start with torch.multiprocessing, rendezvous
through a file (no network), and are bounded by timeouts."""
import os
import traceback
from datetime import timedelta

import pytest
import torch
from ranks import report, spawn_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401
except ImportError:
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

STEPS = 10
# (label, optimizer factory over params): element-wise chains, every one steps local shards
CASES = [
    ("AdamW", lambda oft, ps: oft.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    ("AdamW amsgrad", lambda oft, ps: oft.AdamW(ps, lr=1e-2, amsgrad=True)),
    ("SGD momentum", lambda oft, ps: oft.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("SGD nesterov", lambda oft, ps: oft.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)),
    ("Adam", lambda oft, ps: oft.Adam(ps, lr=1e-2, weight_decay=0.1)),
    ("RMSprop", lambda oft, ps: oft.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True)),
    ("Lion", lambda oft, ps: oft.Lion(ps, lr=1e-3, weight_decay=0.1)),
    ("NAdam", lambda oft, ps: oft.NAdam(ps, lr=1e-2)),
    ("fuse(torch.optim.AdamW)", lambda oft, ps: oft.fuse(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))),
    ("fuse(torch.optim.SGD)", lambda oft, ps: oft.fuse(torch.optim.SGD(ps, lr=0.05, momentum=0.9))),
]
# (label, factory): chains with reductions, whose values must span every rank's shards
REDUCING = [
    ("Lamb", lambda oft, ps: oft.Lamb(ps, lr=1e-2)),
    ("Lars", lambda oft, ps: oft.Lars(ps, lr=0.05, momentum=0.9)),
    ("clip + adamw", lambda oft, ps: oft.Fused("chain(clip_by_global_norm(max_norm=0.05), adamw(lr=0.01))", ps)),
    ("skip nonfinite + clip + adamw", lambda oft, ps: oft.Fused(
        "chain(skip_if_nonfinite(), clip_by_global_norm(max_norm=0.05), adamw(lr=0.01))", ps)),
]
POISON_STEP = 4  # the non-finite case: an inf in the last rank's shard of the first weight's gradient


def make_model(device="cpu"):
    torch.manual_seed(0)  # the same model on every rank
    # 37 rows (uneven on 2 and 3 ranks), 5 rows (3 ranks: 2, 2, 1), 1 row (ranks > 0 hold nothing)
    return torch.nn.Sequential(torch.nn.Linear(20, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 1)).to(device)


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def data(rank, step, device="cpu"):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 20, generator=g).to(device), torch.randn(8, 1, generator=g).to(device)


def train(model, opt, ref_model, ref, scheds, rank, start, stop, poison=None):
    """The FSDP2 loop; the reference steps on the averaged gradients FSDP2 produced (gathered).
    poison: (step, rank) whose local gradient shard of the first parameter gets an inf."""
    import torch.nn.functional as F
    device = next(ref_model.parameters()).device
    for s in range(start, stop):
        x, y = data(rank, s, device)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if poison == (s, rank):
            next(model.parameters()).grad._local_tensor.view(-1)[0] = float("inf")
        for p, q in zip(model.parameters(), ref_model.parameters()):
            q.grad = p.grad.full_tensor()  # a collective: every rank, same order
        opt.step()
        if ref is not None:
            ref.step()
        for sc in scheds:
            sc.step()


def full(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def same_state(sd, ref_sd):
    """Bitwise: the sharded optimizer's state (DTensors, gathered) against the unsharded one's."""
    if sd["state"].keys() != ref_sd["state"].keys():
        return False
    for k, st in sd["state"].items():
        ref_st = ref_sd["state"][k]
        if st.keys() != ref_st.keys():
            return False
        for name, v in st.items():
            if torch.is_tensor(v):
                # (on CUDA, a 0-dim state loaded through DCP may sit on the device, the reference's on the
                # CPU, as torch.optim's would: values are compared)
                if not torch.equal(full(v).cpu(), ref_st[name].cpu()):
                    return False
            elif v != ref_st[name]:
                return False
    return True


def params_equal(model, ref_model):
    return all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), ref_model.parameters()))


def layout_of(sd):
    """What a state dict looks like to tools: per parameter, per state, (type, placements, shape)."""
    return {str(k): {n: (type(v).__name__, str(getattr(v, "placements", None)), list(v.shape))
                     for n, v in st.items() if torch.is_tensor(v)} for k, st in sd["state"].items()}


def run_cases(rank, world, device, mesh, ckpt_dir, out):
    import optfuse
    import optfuse.torch as oft
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    half = STEPS // 2
    for label, make in CASES:
        ref_model = make_model(device)
        model = shard(make_model(device), mesh)
        opt, ref = make(oft, model.parameters()), make(oft, ref_model.parameters())
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt, ref)]
        train(model, opt, ref_model, ref, scheds, rank, 0, half)
        phases = [params_equal(model, ref_model)]
        # the optimizer's own state dict (DTensor states) into a new optimizer mid-run
        sd = opt.state_dict()
        layout = layout_of(sd)
        # per-element states are DTensors; step (and NAdam's mu_product) stay 0-dim tensors, as torch's
        dtensor_states = all(t == "DTensor" for st in layout.values() for t, _, shape in st.values() if shape)
        opt = make(oft, model.parameters())
        opt.load_state_dict(sd)
        scheds[0] = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        scheds[0].load_state_dict(scheds[1].state_dict())
        train(model, opt, ref_model, ref, scheds, rank, half, half + 2)
        phases.append(params_equal(model, ref_model))
        # torch.distributed.checkpoint: sharded save, load into a fresh optimizer
        path = os.path.join(ckpt_dir, f"{label.replace(' ', '_')}")
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        before = [p.full_tensor() for p in model.parameters()]
        model.zero_grad(set_to_none=True)  # as in a new process (torch initialises state only without grads)
        opt = make(oft, model.parameters())
        target = {"optim": get_optimizer_state_dict(model, opt)}  # torch's zero-grad step at lr=0 made the state
        untouched = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
        dcp.load(target, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, target["optim"])
        scheds[0] = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        scheds[0].load_state_dict(scheds[1].state_dict())
        train(model, opt, ref_model, ref, scheds, rank, half + 2, STEPS)
        out[label] = dict(
            params_equal=params_equal(model, ref_model), phases=phases,
            state_equal=same_state(opt.state_dict(), ref.state_dict()),
            moved=any(not torch.equal(p, q) for p, q in zip(ref_model.parameters(), make_model(device).parameters())),
            dtensor_states=dtensor_states, init_step_untouched=untouched,
            lr=opt.param_groups[0]["lr"], ref_lr=ref.param_groups[0]["lr"])

    # FSDP2 replaces a parameter's local tensor (re-padding it, e.g. on load_state_dict(assign=True)):
    # the next step must step the new tensors (the tables pointed at the old ones), and stay exact
    ref_model = make_model(device)
    model = shard(make_model(device), mesh)
    opt, ref = oft.AdamW(model.parameters(), lr=1e-2), oft.AdamW(ref_model.parameters(), lr=1e-2)
    train(model, opt, ref_model, ref, [], rank, 0, 3)
    for p in model.parameters():
        p._local_tensor = p._local_tensor.clone()
    replaced = [p._local_tensor.clone() for p in model.parameters()]
    train(model, opt, ref_model, ref, [], rank, 3, 5)
    out["replaced local tensors"] = dict(
        params_equal=params_equal(model, ref_model),
        moved=any(not torch.equal(a, p._local_tensor) for a, p in zip(replaced, model.parameters())))

    # torch.optim.AdamW(foreach=False) on the same FSDP2 model: within 1e-6, the same state dict layout
    ref_model = make_model(device)
    models = [shard(make_model(device), mesh) for _ in range(2)]
    opts = [oft.AdamW(models[0].parameters(), lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.1, foreach=False)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in opts]
    for m, o in zip(models, opts):
        train(m, o, ref_model, None, [], rank, 0, STEPS)
    for sc in scheds:
        sc.step()
    err = max(float((p.full_tensor() - q.full_tensor()).abs().max() / q.full_tensor().abs().max())
              for p, q in zip(*(m.parameters() for m in models)))
    out["torch AdamW"] = dict(rel_err=err, same_layout=layout_of(opts[0].state_dict()) == layout_of(opts[1].state_dict()))

    # reductions over the mesh: against the unsharded optimizer on the same averaged gradients
    for label, make in REDUCING:
        ref_model = make_model(device)
        model = shard(make_model(device), mesh)
        opt, ref = make(oft, model.parameters()), make(oft, ref_model.parameters())
        poison = (POISON_STEP, world - 1) if "nonfinite" in label else None
        before = [q.detach().clone() for q in ref_model.parameters()]
        skipped = None
        for s in range(STEPS):
            train(model, opt, ref_model, ref, [], rank, s, s + 1, poison)
            if poison and s == POISON_STEP:  # the reference skipped: so must every rank
                skipped = all(torch.equal(a, q) for a, q in zip(before, ref_model.parameters()))
            before = [q.detach().clone() for q in ref_model.parameters()]
        err = max(float((p.full_tensor() - q).abs().max() / q.abs().max())
                  for p, q in zip(model.parameters(), ref_model.parameters()))
        out["reducing " + label] = dict(
            rel_err=err, params_equal=params_equal(model, ref_model), skipped=skipped,
            moved=any(not torch.equal(p, q) for p, q in zip(ref_model.parameters(), make_model(device).parameters())))

    # refused: a reducing chain over DTensor and plain parameters together, Muon, ZeRO around DTensors
    refusals = {}
    model, extra = shard(make_model(device), mesh), torch.nn.Parameter(torch.ones(3, device=device))
    opt = oft.Fused("chain(clip_by_global_norm(max_norm=0.05), adamw(lr=0.01))", list(model.parameters()) + [extra])
    x, y = data(rank, 0, device)
    torch.nn.functional.mse_loss(model(x), y).backward()
    extra.grad = torch.ones_like(extra)
    try:
        opt.step()
        refusals["mixed"] = "no error"
    except optfuse.OptfuseError as e:
        refusals["mixed"] = str(e)
    for label, make in [("Muon", lambda oft, ps: oft.Muon([p for p in ps if p.dim() == 2], lr=0.02)),
                        ("ZeRO", lambda oft, ps: oft.distributed.ZeRO(oft.AdamW(ps, lr=1e-2)))]:
        model = shard(make_model(device), mesh)
        try:
            import optfuse.torch.distributed  # noqa: F401
            opt = make(oft, model.parameters())
            train(model, opt, make_model(device), None, [], rank, 0, 1)
            refusals[label] = "no error"
        except optfuse.OptfuseError as e:
            refusals[label] = str(e)
    out["refusals"] = refusals


def worker(rank, world, init_file, out_dir, backend, device_type):
    out = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        mesh = init_device_mesh(device_type, (world,))
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        run_cases(rank, world, device, mesh, os.path.join(out_dir, "ckpt"), out)
    except Exception:
        out["error"] = traceback.format_exc()
    report(out_dir, rank, out)


def run_ranks(world, tmp_path, backend="gloo", device_type="cpu", timeout=600):
    return spawn_ranks(worker, world, tmp_path, backend, device_type, timeout=timeout)


def check(results, world):
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        for label, _ in CASES:
            r = res[label]
            assert r["moved"], (label, "training did not move the parameters: the comparison would be vacuous")
            assert r["params_equal"], (world, rank, label, r)
            assert r["state_equal"], (world, rank, label)
            assert r["dtensor_states"], (world, rank, label, "states must be DTensors, as torch.optim's with FSDP2")
            assert r["init_step_untouched"], (world, rank, label, "torch's lr=0 state initialisation moved parameters")
            assert r["lr"] == r["ref_lr"] < 0.05 + 1e-9  # the scheduler ran
        r = res["replaced local tensors"]
        assert r["moved"] and r["params_equal"], (world, rank, "a replaced local tensor was not stepped", r)
        r = res["torch AdamW"]
        assert r["rel_err"] <= 1e-6, r
        assert r["same_layout"], "the state dict must look like torch.optim's with FSDP2"
        for label, _ in REDUCING:
            r = res["reducing " + label]
            assert r["moved"], label
            assert r["rel_err"] <= 1e-6, (world, rank, label, r)
            if world == 1:  # the same chunks as the unsharded step
                assert r["params_equal"], (rank, label, r)
            if "nonfinite" in label:
                assert r["skipped"] is True, (world, rank, label, "the reference did not skip the poisoned step")
        ref = res["refusals"]
        assert "plain tensors" in ref["mixed"] and "fully_shard" in ref["mixed"], ref["mixed"]
        assert "Newton-Schulz" in ref["Muon"], ref["Muon"]
        assert "already sharded" in ref["ZeRO"], ref["ZeRO"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_steps_local_shards_bitwise_as_unsharded(world, tmp_path):
    check(run_ranks(world, tmp_path), world)


def hsdp_worker(rank, world, init_file, out_dir):
    """HSDP (a 2 x 2 mesh: replicate x shard) on 4 gloo ranks: the reducing chains reduce within the
    shard dimension (every replica computes the same values), against the unsharded optimizer."""
    out = {}
    try:
        import optfuse.torch as oft
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for label, make in REDUCING:
            ref_model = make_model()
            model = shard(make_model(), mesh)
            opt, ref = make(oft, model.parameters()), make(oft, ref_model.parameters())
            train(model, opt, ref_model, ref, [], rank, 0, STEPS)
            out[label] = dict(
                placements=str(next(model.parameters()).placements),
                rel_err=max(float((p.full_tensor() - q).abs().max() / q.abs().max())
                            for p, q in zip(model.parameters(), ref_model.parameters())),
                moved=any(not torch.equal(p, q) for p, q in zip(ref_model.parameters(), make_model().parameters())))
    except Exception:
        out["error"] = traceback.format_exc()
    report(out_dir, rank, out)


def test_hsdp_reductions_run_within_the_shard_dimension(tmp_path):
    results = spawn_ranks(hsdp_worker, 4, tmp_path, timeout=600)
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        for label, _ in REDUCING:
            r = res[label]
            assert "Replicate" in r["placements"] and "Shard" in r["placements"], r  # really HSDP
            assert r["moved"] and r["rel_err"] <= 1e-6, (rank, label, r)


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_on_cuda_over_nccl(world, tmp_path):
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs CUDA and NCCL (CPU ranks over gloo are tested above)")
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    check(run_ranks(world, tmp_path, "nccl", "cuda", timeout=300), world)
