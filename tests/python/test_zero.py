"""optfuse.torch.distributed.ZeRO (stage 1) on CPU ranks over gloo, in the loop users write:
DistributedDataParallel averages the gradients, zero_grad() then backward every step, an lr
scheduler. On 1, 2 and 3 processes (shards that cut tensors in the middle), for every element-wise
optfuse.torch class: parameters and the consolidated state bitwise equal to an unsharded optimizer
of the same class stepped on the same averaged gradients, 10 steps; each rank holds about 1/N of
the state; a consolidated state dict loads into a ZeRO again and training continues bitwise equal;
a torch.optim optimizer (fused) under torch.amp.GradScaler matches too; chains with reductions are refused. Processes start with torch.multiprocessing, rendezvous through
a file (no network), and are bounded by timeouts."""
import copy
import json
import os
import time
from datetime import timedelta

import pytest
import torch

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
    # 6300 + 12040 elements: with 2 or 3 ranks the shard boundaries fall inside the weights
    return torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Tanh(), torch.nn.Linear(300, 40)).to(dtype)


def data(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 20, generator=g).to(dtype), torch.randn(8, 40, generator=g).to(dtype)


def train(ddp, model, zero, ref_model, ref, scheds, rank, steps, start=0):
    import torch.nn.functional as F
    for s in range(start, start + steps):
        x, y = data(rank, s, next(model.parameters()).dtype)
        zero.zero_grad()
        F.mse_loss(ddp(x), y).backward()  # DDP: every rank now holds the averaged gradients
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
    import optfuse
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
    # Reductions cannot be sharded yet: refused with a clear error, before any step.
    refusals = []
    for make in (lambda ps: oft.Lamb(ps), lambda ps: oft.Fused("chain(clip_by_global_norm(1.0), adamw())", ps)):
        try:
            ZeRO(make(make_model().parameters()))
            refusals.append("accepted")
        except optfuse.OptfuseError as e:
            refusals.append(str(e))
    out["refusals"] = refusals
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def run_ranks(world, tmp_path, timeout=600):
    import torch.multiprocessing as mp
    ctx = mp.start_processes(worker, args=(world, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"{world} ranks did not finish within {timeout} s")
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
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
            # 1/N of the state, plus what rounding the shard size up to 64 elements can add
            assert r["local_state"] <= r["full_state"] / world + 64 * (r["full_state"] // 18340 + 1), (name, r)
        assert res["torch_adamw_gradscaler"] == dict(params_equal=True, moved=True), res["torch_adamw_gradscaler"]
        assert res["refusals"][0].startswith("ZeRO: Lamb"), res["refusals"]
        assert "clip_by_global_norm" in res["refusals"][1], res["refusals"]
    if world > 1:  # the shards together hold all of the state
        for name in labels:
            assert sum(res[name]["local_state"] for res in results) == results[0][name]["full_state"], name


def test_shard_ranges():
    from optfuse.torch.distributed import ALIGN, shard_ranges
    assert shard_ranges(18340, 3) == [(0, 6144), (6144, 12288), (12288, 18340)]
    assert shard_ranges(100, 4) == [(0, 64), (64, 100), (100, 100), (100, 100)]
    assert all((b - a) % ALIGN == 0 for a, b in shard_ranges(10 ** 6, 7)[:-1])
    assert shard_ranges(0, 2) == [(0, 0), (0, 0)]


def test_muon_is_refused_with_the_reason():
    """Flat shards cut matrices apart; Muon's Newton-Schulz needs them whole (refused before any
    process group is needed)."""
    import optfuse
    import optfuse.torch as oft
    from optfuse.torch.distributed import ZeRO
    m = torch.nn.Linear(8, 8, bias=False)
    for opt in (oft.Muon(m.parameters(), lr=0.02),
                oft.MuonWithAuxAdam([{"params": list(m.parameters()), "use_muon": True}])):
        with pytest.raises(optfuse.OptfuseError, match="orthogonalises whole matrices"):
            ZeRO(opt)
