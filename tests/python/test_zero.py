"""optfuse.torch.distributed.ZeRO (stage 1) on CPU ranks over gloo, in the loop users write:
DistributedDataParallel averages the gradients, zero_grad() then backward every step, an lr
scheduler. On 1, 2 and 3 processes (shards that cut tensors in the middle), for every element-wise
optfuse.torch class: parameters and the consolidated state bitwise equal to an unsharded optimizer
of the same class stepped on the same averaged gradients, 10 steps; each rank holds about 1/N of
the state; a consolidated state dict loads into a ZeRO again and training continues bitwise equal;
a torch.optim optimizer (fused) under torch.amp.GradScaler matches too. Optimizers with reductions
(a global-norm clip, a non-finite check, Lamb's and Lars's per-tensor norms) exchange their partial
sums across ranks at the schedule's Exchange step and match bitwise too, also when a non-finite
gradient on one rank's shard must skip the step on every rank. Processes start with
torch.multiprocessing, rendezvous through a file (no network), and are bounded by timeouts."""
import copy
import json
import os
import time
from datetime import timedelta

import pytest
import torch
from ranks import report, spawn_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

STEPS = 10
CASES = [
    ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("Adam", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, amsgrad=True)),
    ("Adagrad", dict(lr=0.05, lr_decay=0.01)),
    ("RMSprop", dict(lr=1e-2, momentum=0.5, centered=True)),
    ("Lion", dict(lr=1e-3, weight_decay=0.1)),
    ("RAdam", dict(lr=1e-2, weight_decay=0.1)),
    ("Adamax", dict(lr=1e-2)),
    ("Adadelta", dict(lr=0.5, weight_decay=0.01)),
    ("Rprop", dict(lr=1e-3)),
    ("ASGD", dict(lr=0.05, t0=3)),
    # reductions: partial sums cross ranks at the Exchange step
    ("Lamb", dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)),
    ("Lars", dict(lr=0.05, momentum=0.9, weight_decay=1e-4)),
]
# Fused chains with reductions (label, SPEC, hyperparameters); the last skips a step whose gradients
# hold a NaN (placed in the last rank's shard at step NAN_STEP), on every rank.
NAN_STEP = 3
CHAIN_CASES = [
    ("clip + adamw", "chain(clip_by_global_norm(max_norm=0.05), adamw(lr=0.01))", dict(max_norm=0.02)),
    ("skip_if_nonfinite + sgd", "chain(skip_if_nonfinite(), sgd(lr=0.05, momentum=0.9))", {}),
]
# Mixed precision on a bfloat16 model (label, class, options): master copies, remainders and Kahan
# compensations are sharded like every state; stochastic rounding draws the unsharded bits.
PRECISION_CASES = [
    ("AdamW master_weights", "AdamW", dict(lr=1e-2, master_weights=True)),
    ("AdamW remainders", "AdamW", dict(lr=1e-2, master_weights="remainders")),
    ("AdamW stochastic bf16 states", "AdamW", dict(lr=1e-2, stochastic_rounding=True, state_dtype=torch.bfloat16)),
    ("SGD kahan", "SGD", dict(lr=0.05, momentum=0.9, kahan=True)),
]


def make_model(dtype=torch.float32):
    torch.manual_seed(0)  # the same model on every rank
    # 21000 + 40040 elements: with 2 or 3 ranks the shard boundaries (at multiples of the 16384-element
    # chunk into a tensor) fall inside the weights
    return torch.nn.Sequential(torch.nn.Linear(20, 1000), torch.nn.Tanh(), torch.nn.Linear(1000, 40)).to(dtype)


def data(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 20, generator=g).to(dtype), torch.randn(8, 40, generator=g).to(dtype)


def train(ddp, model, zero, ref_model, ref, scheds, rank, steps, start=0, nan_at=None):
    import torch.nn.functional as F
    for s in range(start, start + steps):
        x, y = data(rank, s, next(model.parameters()).dtype)
        zero.zero_grad()
        F.mse_loss(ddp(x), y).backward()  # DDP: every rank now holds the averaged gradients
        if s == nan_at:  # in the last weight's last elements: the last rank's shard
            model[2].weight.grad.view(-1)[-1] = float("nan")
        zero.step()
        ref.zero_grad(set_to_none=True)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            q.grad = p.grad.clone()
        ref.step()
        for sch in scheds:
            sch.step()


def same_state(a, b):
    if a.keys() != b.keys():
        return False
    for i in a:
        if a[i].keys() != b[i].keys():
            return False
        for k in a[i]:
            x, y = a[i][k], b[i][k]
            if torch.is_tensor(x) != torch.is_tensor(y):
                return False
            if torch.is_tensor(x) and not (x.shape == y.shape and torch.equal(x.cpu(), y.cpu())):
                return False
            if not torch.is_tensor(x) and x != y:
                return False
    return True


def worker(rank, world, init_file, out_dir):
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    for label, name, kw, dtype in [(n, n, kw, torch.float32) for n, kw in CASES] + \
            [(lb, n, kw, torch.bfloat16) for lb, n, kw in PRECISION_CASES]:
        model = make_model(dtype)
        ref_model = copy.deepcopy(model)
        ddp = DistributedDataParallel(model)
        zero = ZeRO(getattr(oft, name)(model.parameters(), **kw))
        ref = getattr(oft, name)(ref_model.parameters(), **kw)
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (zero, ref)]
        train(ddp, model, zero, ref_model, ref, scheds, rank, STEPS // 2)
        # a consolidated state dict into a new ZeRO (new wrapped optimizer) mid-run
        sd = zero.state_dict()
        zero = ZeRO(getattr(oft, name)(model.parameters(), **kw))
        zero.load_state_dict(sd)
        scheds[0] = torch.optim.lr_scheduler.StepLR(zero, step_size=3, gamma=0.5)
        scheds[0].load_state_dict(scheds[1].state_dict())
        train(ddp, model, zero, ref_model, ref, scheds, rank, STEPS - STEPS // 2, start=STEPS // 2)
        ref_sd = ref.state_dict()
        ref_state_numel = sum(v.numel() for st in ref_sd["state"].values() for v in st.values()
                              if torch.is_tensor(v) and v.dim() > 0)
        out[label] = dict(
            params_equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())),
            moved=any(not torch.equal(p, q) for p, q in zip(model.parameters(), make_model(dtype).parameters())),
            state_equal=same_state(zero.state_dict()["state"], ref_sd["state"]),
            lr=float(zero.param_groups[0]["lr"]), ref_lr=float(ref.param_groups[0]["lr"]),
            local_state=zero.local_state_numel(), full_state=ref_state_numel)
    # A torch.optim optimizer (fused by ZeRO) under torch.amp.GradScaler, against optfuse unsharded.
    model = make_model()
    ref_model = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    zero = ZeRO(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False))
    ref = oft.AdamW(ref_model.parameters(), lr=1e-2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    import torch.nn.functional as F
    for s in range(STEPS):
        x, y = data(rank, s)
        zero.zero_grad()
        scalers[0].scale(F.mse_loss(ddp(x), y)).backward()
        scalers[0].step(zero)
        scalers[0].update()
        ref.zero_grad(set_to_none=True)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            q.grad = p.grad.clone()  # the scaled, averaged gradients
        scalers[1].scale(torch.zeros(()))  # its scale, as the same loss scaling would give (same init, same history)
        scalers[1].step(ref)
        scalers[1].update()
    out["torch_adamw_gradscaler"] = dict(
        params_equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())),
        moved=any(not torch.equal(p, q) for p, q in zip(model.parameters(), make_model().parameters())))
    # Fused chains with reductions, against the same chain unsharded.
    for label, spec, kw in CHAIN_CASES:
        model = make_model()
        ref_model = copy.deepcopy(model)
        ddp = DistributedDataParallel(model)
        zero = ZeRO(oft.Fused(spec, model.parameters(), **kw))
        ref = oft.Fused(spec, ref_model.parameters(), **kw)
        nan_at = NAN_STEP if "nonfinite" in spec else None
        before_nan = None
        for s in range(STEPS):
            train(ddp, model, zero, ref_model, ref, [], rank, 1, start=s, nan_at=nan_at)
            if s == NAN_STEP - 1:
                before_nan = [p.detach().clone() for p in model.parameters()]
            if s == NAN_STEP and nan_at is not None:  # skipped on every rank: nothing moved
                out[label + " skipped"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), before_nan))
        out[label] = dict(
            params_equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())),
            moved=any(not torch.equal(p, q) for p, q in zip(model.parameters(), make_model().parameters())),
            state_equal=same_state(zero.state_dict()["state"], ref.state_dict()["state"]))
    # step hooks (ZeRO.step skips torch's wrapper only while none is registered) and the profiler range
    zero = ZeRO(oft.AdamW(make_model().parameters(), lr=1e-2))
    calls = []
    handles = [zero.register_step_pre_hook(lambda *a: calls.append("pre")),
               zero.register_step_post_hook(lambda *a: calls.append("post"))]
    for p in zero.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    zero.step()
    for h in handles:
        h.remove()
    zero.step()
    with torch.autograd.profiler.profile() as prof:
        zero.step()
    out["step hooks"] = dict(calls=calls, profiled=any("ZeRO.step" in e.name for e in prof.function_events))
    report(out_dir, rank, out)


def run_ranks(world, tmp_path, timeout=600):
    return spawn_ranks(worker, world, tmp_path, timeout=timeout)


# 4 ranks: rank 0's shard is empty (no chunk boundary falls before a quarter of the model)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero1_with_ddp_is_bitwise_the_unsharded_optimizer(world, tmp_path):
    results = run_ranks(world, tmp_path)
    labels = {n: kw for n, kw in CASES} | {lb: kw for lb, _, kw in PRECISION_CASES}
    for rank, res in enumerate(results):
        for name, kw in labels.items():
            r = res[name]
            assert r["moved"], (name, "training did not move the parameters: the comparison would be vacuous")
            assert r["params_equal"], (world, rank, name)
            assert r["state_equal"], (world, rank, name)
            assert r["lr"] == r["ref_lr"] < kw["lr"]  # the scheduler ran
            # 1/N of the state, plus what cutting at a chunk boundary (16384 elements) can add
            per_element = r["full_state"] // 61040
            assert r["local_state"] <= r["full_state"] / world + 16384 * per_element, (name, r)
        assert res["torch_adamw_gradscaler"] == dict(params_equal=True, moved=True), res["torch_adamw_gradscaler"]
        for label, _, _ in CHAIN_CASES:
            r = res[label]
            assert r == dict(params_equal=True, moved=True, state_equal=True), (world, rank, label, r)
        assert res["skip_if_nonfinite + sgd skipped"] is True, "the NaN step was not skipped on every rank"
        assert res["step hooks"] == dict(calls=["pre", "post"], profiled=True), res["step hooks"]
    if world > 1:  # the shards together hold all of the state
        for name in labels:
            assert sum(res[name]["local_state"] for res in results) == results[0][name]["full_state"], name


def test_shard_ranges():
    from optfuse.torch.distributed import shard_ranges
    # cuts at tensor starts or multiples of the chunk into a tensor, about total / world each
    assert shard_ranges([40000, 5000, 70001], 3, 16384) == [(0, 32768), (32768, 61384), (61384, 115001)]
    assert shard_ranges([100], 4, 16384) == [(0, 0), (0, 0), (0, 0), (0, 100)]
    assert shard_ranges([], 2, 16384) == [(0, 0), (0, 0)]
    for sizes, world in [([10 ** 6], 7), ([3000] * 50, 4), ([20000, 1, 70000], 5)]:
        ranges = shard_ranges(sizes, world, 16384)
        assert ranges[0][0] == 0 and ranges[-1][1] == sum(sizes)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for lo, _ in ranges:
            t = max(i for i, s in enumerate(starts) if s <= lo) if lo < sum(sizes) else None
            assert t is None or (lo - starts[t]) % 16384 == 0, (sizes, world, lo)
        assert max(b - a for a, b in ranges) <= -(-sum(sizes) // world) + 16384


def test_exchange_sees_the_partials_and_its_writes_are_combined():
    """The core's exchange hook (what ZeRO uses): local and global are views of the executor's
    partials; what the hook writes into global is what the step combines (an identity exchange gives
    the unsharded step bitwise; doubling every partial sum of squares changes the step)."""
    import optfuse
    from optfuse import _core

    def run(exchange):
        o = _core.Optimizer(_core.make_builtin("lamb", max_grad_norm=1.0), "cpu")
        g = torch.Generator().manual_seed(0)
        p, grad = torch.randn(40000, generator=g), torch.randn(40000, generator=g)
        states = [torch.zeros(40000), torch.zeros(40000)]
        o.set_tensors([(p, grad, states)])
        calls = []
        if exchange is not None:
            def hook(phase, rows, local, glob):
                calls.append((phase, list(rows), tuple(local.shape), tuple(glob.shape)))
                glob[rows] = exchange(local[rows])
            o._set_exchange(3, [0], [3], hook)
        o.step()
        return p, calls

    plain, _ = run(None)
    same, calls = run(lambda x: x)
    assert torch.equal(plain, same)
    plan = _core.make_plan(_core.make_builtin("lamb", max_grad_norm=1.0))
    exchanges = [ph for kind, ph in plan.schedule if kind == "exchange"]
    assert [c[0] for c in calls] == exchanges and len(exchanges) == 2, (calls, plan.schedule)
    assert all(c[2] == (len(plan.reduction_scopes), 3) and c[3] == c[2] for c in calls), calls
    doubled, _ = run(lambda x: 2 * x)
    assert not torch.equal(plain, doubled)
    o = _core.Optimizer(_core.make_builtin("lamb"), "cpu")
    o.set_tensors([(torch.zeros(40000), torch.zeros(40000), [torch.zeros(40000), torch.zeros(40000)])])
    with pytest.raises(optfuse.OptfuseError, match="covers the whole tensor"):
        o._set_exchange(3, [0], [2], lambda *a: None)


def cuda_worker(rank, world, init_file, out_dir):
    """ZeRO over NCCL on CUDA parameters (one GPU per rank): optimizers with reductions, whose partial
    sums cross ranks as device tensors, against the unsharded optimizer on the same gradients."""
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    cases = [("Lamb", lambda ps: oft.Lamb(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)),
             ("clip + adamw", lambda ps: oft.Fused("chain(clip_by_global_norm(max_norm=0.05), adamw(lr=0.01))", ps)),
             ("AdamW", lambda ps: oft.AdamW(ps, lr=1e-2))]
    # stage 2: the same gradients on every rank, reduce-scattered (averaged) by ZeRO at step()
    for stage, (label, make) in [(st, c) for st in (1, 2) for c in cases]:
        label = f"stage {stage} {label}"
        model = make_model().cuda()
        ref_model = copy.deepcopy(model)
        zero, ref = ZeRO(make(model.parameters()), stage=stage), make(ref_model.parameters())
        for s in range(STEPS):
            g = torch.Generator(device="cuda").manual_seed(s)  # the same "averaged" gradients on every rank
            for p, q in zip(model.parameters(), ref_model.parameters()):
                p.grad = torch.randn(p.shape, generator=g, device="cuda")
                q.grad = p.grad.clone()
            zero.step()
            ref.step()
        out[label] = dict(
            params_equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())),
            moved=any(not torch.equal(p, q) for p, q in zip(model.parameters(), make_model().cuda().parameters())))
    report(out_dir, rank, out)


@pytest.mark.parametrize("world", [1, 2])
def test_zero_on_cuda_over_nccl_is_bitwise_the_unsharded_optimizer(world, tmp_path):
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs CUDA and NCCL (CPU ranks over gloo are tested above)")
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    results = spawn_ranks(cuda_worker, world, tmp_path, timeout=300)
    for r, res in enumerate(results):
        for label, v in res.items():
            assert v == dict(params_equal=True, moved=True), (world, r, label, v)


def mismatch_worker(rank, world, init_file, out_dir):
    """Rank 1 wraps a model with one more output: ZeRO must fail on every rank, not hang."""
    import optfuse
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    model = torch.nn.Linear(20, 30 + rank)
    try:
        ZeRO(oft.AdamW(model.parameters()))
        message = "accepted"
    except optfuse.OptfuseError as e:
        message = str(e)
    report(out_dir, rank, {"message": message})


def test_parameters_that_differ_across_ranks_fail_on_every_rank(tmp_path):
    results = spawn_ranks(mismatch_worker, 2, tmp_path, timeout=120)
    for r, res in enumerate(results):
        msg = res["message"]
        assert msg.startswith("ZeRO: the ranks do not hold the same parameters"), (r, msg)
        assert "(0, (30, 20), 'torch.float32')" in msg and "(0, (31, 20), 'torch.float32')" in msg, msg


def clip_worker(rank, world, init_file, out_dir):
    """ZeRO.clip_grad_norm_ (stages 1 and 2) against torch.nn.utils.clip_grad_norm_ on the unsharded
    optimizer: the same norm and parameters, to rounding (the norm is summed in another order)."""
    import torch.nn.functional as F
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    for stage in (1, 2):
        model = make_model()
        ref_model = copy.deepcopy(model)
        net = DistributedDataParallel(model) if stage == 1 else model
        zero = ZeRO(oft.AdamW(model.parameters(), lr=1e-2), stage=stage)
        ref = oft.AdamW(ref_model.parameters(), lr=1e-2)
        worst_norm = worst_param = 0.0
        for s in range(STEPS):
            x, y = data(rank, s)
            zero.zero_grad()
            F.mse_loss(net(x), y).backward()
            local = [p.grad.clone() for p in model.parameters()]
            norm = zero.clip_grad_norm_(0.05)
            zero.step()
            for q, g in zip(ref_model.parameters(), local):  # the average of every rank's gradients
                if stage == 2:  # local gradients: average them (stage 1: DDP already did)
                    dist.all_reduce(g)
                    g /= world
                q.grad = g
            ref_norm = torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), 0.05)
            ref.step()
            worst_norm = max(worst_norm, abs(float(norm) - float(ref_norm)) / float(ref_norm))
            worst_param = max(worst_param, max(float((p - q).abs().max() / q.abs().max())
                                               for p, q in zip(model.parameters(), ref_model.parameters())))
        out[f"stage{stage}"] = dict(norm=worst_norm, param=worst_param, clipped=float(ref_norm) > 0.05)
    report(out_dir, rank, out)


@pytest.mark.parametrize("world", [2, 3])
def test_clip_grad_norm_is_folded_into_the_step(world, tmp_path):
    results = spawn_ranks(clip_worker, world, tmp_path, timeout=300)
    for r, res in enumerate(results):
        for stage, v in res.items():
            assert v["clipped"], (stage, "the clip never acted: the comparison would be vacuous")
            # stage 2: this reference averages the local gradients in another buffer layout than ZeRO's
            # reduce-scatter, and at 3 gloo ranks some sums round differently in the last bit
            # (test_zero2 uses ZeRO's layout to be bitwise); 10 Adam steps carry that to ~2e-6 on one
            # machine and 1.4e-5 on another (2-core CI-like VM, 2026-12-02: Adam's normalisation of
            # near-zero gradient entries amplifies a last-bit difference), so the bound has room
            bound = 1e-6 if stage == "stage1" else 5e-5
            assert v["norm"] <= 1e-6 and v["param"] <= bound, (world, r, stage, v)


def traffic_worker(rank, world, init_file, out_dir):
    """Bytes each rank puts on the wire per step, counted at the collectives ZeRO calls (ring
    algorithms: an all-gather of an S-byte piece per rank sends (N-1) S, a reduce-scatter of an
    N x S buffer sends (N-1) S, an all-reduce of B bytes 2 (N-1) / N B), against the model
    stage 1: (N-1)/N * param bytes; stage 2: (N-1)/N * (grad bytes + param bytes), each rounded up to
    the padded shard (the largest rank's), plus the few bytes of flags and partial sums."""
    import torch.nn.functional as F
    import optfuse.torch as oft
    import optfuse.torch._zero_buckets as zb
    import optfuse.torch.distributed as zd

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    sent = {"bytes": 0}

    def nbytes(t):
        return t.numel() * t.element_size()

    real = dict(all_gather=dist.all_gather, all_gather_into_tensor=dist.all_gather_into_tensor,
                reduce_scatter_tensor=dist.reduce_scatter_tensor, all_reduce=dist.all_reduce)

    class Counting:
        def __getattr__(self, name):
            return getattr(dist, name)

        def all_gather(self, out, t, **kw):
            sent["bytes"] += (world - 1) * nbytes(t)
            return real["all_gather"](out, t, **kw)

        def all_gather_into_tensor(self, out, t, **kw):
            sent["bytes"] += (world - 1) * nbytes(t)
            return real["all_gather_into_tensor"](out, t, **kw)

        def reduce_scatter_tensor(self, out, t, **kw):  # (stage 2's, started during backward)
            sent["bytes"] += (world - 1) * nbytes(out)
            return real["reduce_scatter_tensor"](out, t, **kw)

        def all_reduce(self, t, **kw):
            sent["bytes"] += 2 * (world - 1) * nbytes(t) // world
            return real["all_reduce"](t, **kw)

    out = {}
    for stage in (1, 2):
        model = make_model()
        zero = zd.ZeRO(oft.AdamW(model.parameters(), lr=1e-2), stage=stage)
        zd.dist = zb.dist = Counting()
        try:
            per_step = []
            for s in range(3):
                x, y = data(rank, s)
                zero.zero_grad()
                before = sent["bytes"]  # (stage 2 sends its buckets during backward)
                F.mse_loss(model(x), y).backward()
                if stage == 1:  # (DDP's all-reduce is DDP's traffic: averaged by hand, not counted)
                    for p in model.parameters():
                        real["all_reduce"](p.grad)
                        p.grad /= world
                zero.step()
                per_step.append(sent["bytes"] - before)
        finally:
            zd.dist = zb.dist = dist
        gathered = zero._rows[torch.float32]  # elements of the largest shard: the all-gather's row
        reduced = sum(b.row for b in zero._buckets)  # stage 2: each bucket's longest range
        model_bytes = (world - 1) * 4 * (gathered + (reduced if stage == 2 else 0))
        out[f"stage{stage}"] = dict(per_step=per_step, model=model_bytes,
                                    ideal=(world - 1) / world * 61040 * 4 * (1 if stage == 1 else 2))
    report(out_dir, rank, out)


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_per_step_follow_the_traffic_model(world, tmp_path):
    results = spawn_ranks(traffic_worker, world, tmp_path, timeout=200)
    for r, res in enumerate(results):
        for stage, v in res.items():
            for b in v["per_step"]:
                # the model's collectives, plus at most 1 KiB of flags (stage 2: which parameters have
                # gradients) per step
                assert v["model"] <= b <= v["model"] + 1024, (world, r, stage, v)
            # padding to the largest shard costs at most one chunk (16384 elements) per other rank
            assert v["model"] <= v["ideal"] + (world - 1) * 16384 * 4 * 2, (world, stage, v)


def dying_worker(rank, world, init_file, out_dir):
    """Rank 1 leaves after the ZeRO is built (exit code 0, so torch.multiprocessing lets rank 0 run
    on): rank 0's next step must fail with an error, not hang (gloo notices the closed connection, or
    the process group's timeout fires)."""
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    model = make_model()
    zero = ZeRO(oft.AdamW(model.parameters()))
    if rank == 1:
        os._exit(0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    t0 = time.monotonic()
    try:
        zero.step()
        outcome = "stepped"
    except Exception as e:  # noqa: BLE001  (whatever torch.distributed raises for a lost peer)
        outcome = f"{type(e).__name__}: {str(e)[:200]}"
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump({"outcome": outcome, "seconds": time.monotonic() - t0}, f)
    os._exit(0)  # destroy_process_group would wait for the dead peer


def test_a_rank_that_dies_makes_the_others_fail_not_hang(tmp_path):
    (res,) = spawn_ranks(dying_worker, 2, tmp_path, timeout=120, reporting=[0])
    assert res["outcome"] != "stepped", res
    assert res["seconds"] < 60, res  # within the process group's 20 s timeout, plus slack
