"""Sharded optimizer steps (optfuse.torch.distributed.ZeRO stages 1 and 2) against a DDP-style step,
on N ranks in one run: per rank and step, the bytes moved through the process group (counted at the
collectives) next to the communication model, the step time, and the optimizer-state bytes each rank
holds. The bench checks the model: it exits nonzero when a measured byte count differs from the model
by more than the stated tolerance.

Rows, per workload (bench/workload_shapes.py, the shapes of `optfuse bench --workload`) and per N:
  single optfuse    the unsharded optfuse AdamW step alone, no collective (one GPU's step time);
                    "single optfuse clip" the same for the clip chain
  ddp optfuse       all_reduce of the gradients (averaged, in 25 MiB buckets of one flat gradient
                    buffer, as DDP with gradient_as_bucket_view) + optfuse.torch.AdamW, unsharded
  ddp torch         the same all_reduce + torch.optim.AdamW (fused=True where the device has it,
                    else foreach=True)
  ddp optfuse clip  the same all_reduce + a Fused chain clip_by_global_norm -> adamw, unsharded
  zero1             the same all_reduce + ZeRO(optfuse.torch.AdamW, stage=1): sharded step +
                    all_gather of the parameters
  zero1 clip        as zero1 with the clip chain: + the exchange of per-chunk partial sums
  zero2             ZeRO(optfuse.torch.AdamW, stage=2): reduce_scatter of the local gradients +
                    sharded step + all_gather of the parameters (no DDP all_reduce)
  zero2 clip        as zero2 with the clip chain
Every optimizer: lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2 (torch's AdamW defaults);
the clip's max_norm=1.0. Parameters are random, the same on every rank; each rank's local gradients
are random with a seed of its own (no model, no backward: the step alone is measured).

Traffic counted: torch.distributed's collectives are wrapped (the module's attributes, which
distributed.py calls through `dist.`), and each call adds, from the sizes of the tensors it is
given, what a ring algorithm sends and receives per rank (each rank sends as much as it receives):
  all_reduce of a B-byte tensor:                      2 (N-1)/N x B
  all_gather of an S-byte tensor (list or flat out):  (N-1) x S
  reduce_scatter(_tensor) into an S-byte output:      (N-1) x S
Any other collective during a step fails the bench (it is not modelled). Not counted: the
rendezvous, ZeRO's construction (all_gather_object), protocol headers; what the backend really puts
on the wire may differ (gloo's and NCCL's algorithms for small buffers, NCCL's trees).

Model, per rank and step (P parameter elements in T tensors, g / p bytes per gradient / parameter
element, S the largest rank's elements: ZeRO pads every rank's all-gather row to it; stage 2 groups
the tensors into B buckets of 25 MB, each cut into one range per rank, R the sum over buckets of each
bucket's longest range; the ranges come from optfuse.torch.distributed.shard_ranges, cut at tensor
starts or 16384-element chunks on CPU):
  DDP all_reduce:            2 (N-1)/N x P x g
  stage 1:                   DDP all_reduce + (N-1) x S x p            (all_gather of the parameters)
  stage 2:                   (N-1) x (R x g + S x p)                   (reduce_scatters + all_gather)
                             + 2 (N-1)/N x 4 x (T + B)                 (all_reduce of int32 flags)
  "ideal" (unpadded shards): DDP 2 (N-1)/N P g; stage 1 DDP + (N-1)/N P p; stage 2 (N-1)/N P (g + p)
  (S exceeds P/N by less than one chunk.) Where the backend lacks reduce_scatter_tensor, ZeRO falls
  back to an all_reduce of its [N, S] buffer: 2 (N-1) x S x g; the row then says "fallback".
Tolerance: rows without a reduction must match the model exactly. A clip row adds the exchange of
per-chunk partial sums, bounded by (N-1) x 8 B x C per reduction, C the largest rank's chunk count
(every piece's chunks, the last partial one included): measured - model must lie in [0, that bound].

Step time: median over --steps timed steps after --warmup steps (time.perf_counter, with
torch.cuda.synchronize on CUDA), of the slowest rank. Per step the local gradients are restored
(untimed); the timed part is the all_reduce (DDP rows) and the optimizer's step(). Optimizer state:
bytes of the per-element state tensors (dim > 0; step counts left out) each rank's optimizer holds
(for ZeRO: its inner optimizer over the rank's pieces), against the unsharded optfuse AdamW's.

  python3 bench/zero_vs_ddp.py [--ranks 1,2,4] [--device cpu|cuda] [--workloads NAME[@SCALE],...]
      [--steps 10] [--warmup 3] [--threads T] [--timeout 600] [--json out.json]

CPU: gloo, ranks meet through a file; default workloads are small (gpt2-small and many-small
scaled down). CUDA (--device cuda): NCCL, rank r on cuda:r (needs as many GPUs as ranks); default
workloads gpt2-small, llama-1b, many-small at full size.
"""
import argparse
import inspect
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from fractions import Fraction

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload_shapes  # noqa: E402

CPU_DEFAULT_WORKLOADS = "gpt2-small@0.03125,many-small@0.25"
CUDA_DEFAULT_WORKLOADS = "gpt2-small,llama-1b,many-small"
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
LR, BETAS, EPS, WD, MAX_NORM = 1e-3, (0.9, 0.999), 1e-8, 1e-2, 1.0
CLIP_CHAIN = (f"chain(clip_by_global_norm(max_norm={MAX_NORM}), "
              f"adamw(lr={LR}, b1={BETAS[0]}, b2={BETAS[1]}, eps={EPS}, weight_decay={WD}))")
# (name, ZeRO stage or None, all_reduce the gradients first, optimizer kind)
VARIANTS = [
    ("single optfuse", None, False, "adamw"),  # the step alone, no collective: one GPU's (or process's) time
    ("single optfuse clip", None, False, "clip"),
    ("ddp optfuse", None, True, "adamw"),
    ("ddp torch", None, True, "torch"),
    ("ddp optfuse clip", None, True, "clip"),
    ("zero1", 1, True, "adamw"),
    ("zero1 clip", 1, True, "clip"),
    ("zero2", 2, False, "adamw"),
    ("zero2 clip", 2, False, "clip"),
]
EXCHANGE_BYTES_PER_CHUNK = 8  # one float64 partial sum per chunk and reduction
COUNTED = {  # collective -> (the argument whose bytes count, factor(N))
    "all_reduce": ("tensor", lambda n: Fraction(2 * (n - 1), n)),
    "all_gather": ("tensor", lambda n: Fraction(n - 1)),
    "all_gather_into_tensor": ("input_tensor", lambda n: Fraction(n - 1)),
    "reduce_scatter_tensor": ("output", lambda n: Fraction(n - 1)),
    "reduce_scatter": ("output", lambda n: Fraction(n - 1)),
}
UNMODELLED = ["broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "all_gather_object",
              "broadcast_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier"]
COUNTING_TEXT = """\
Bytes per rank per step, counted at torch.distributed's collectives from the sizes of the tensors
they are given, as a ring algorithm moves them (sent = received): all_reduce of B bytes 2(N-1)/N B;
all_gather of an S-byte tensor (N-1) S; reduce_scatter into an S-byte output (N-1) S. Not counted:
rendezvous, construction, headers. Model: DDP 2(N-1)/N P g; zero1 DDP + (N-1) S p; zero2
(N-1) (R g + S p) + 2(N-1)/N 4(T+B) (flags); S = largest shard (padded row), R = bucket rows
(B 25 MB buckets), "ideal" uses P/N.
Tolerance: exact, except clip rows: + the partial-sum exchange, 0..(N-1) x 8 B x C per reduction
(C = the largest rank's chunks)."""


def parse_workloads(spec, default_scale):
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, scale = item.partition("@")
        if name not in workload_shapes.WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; known: {', '.join(workload_shapes.WORKLOADS)}")
        out.append((item if scale else (name if default_scale == 1.0 else f"{name}@{default_scale:g}"),
                    name, float(scale) if scale else default_scale))
    return out


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# --- the traffic counter (in each rank's process)
class Traffic:
    """Wraps torch.distributed's collectives; inside `step()` each call adds its ring bytes."""

    def __init__(self, dist):
        self.dist = dist
        self.current = None
        self.real = {}
        for name in list(COUNTED) + UNMODELLED:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.real[name] = fn
            setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        sig = inspect.signature(fn)

        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)  # counted once it succeeded (ZeRO probes reduce_scatter_tensor)
            rec = self.current
            if rec is not None:
                entry = rec.setdefault(name, dict(calls=0, tensor_bytes=0, sent=Fraction(0), recv=Fraction(0)))
                entry["calls"] += 1
                if name in COUNTED:
                    arg, factor = COUNTED[name]
                    bound = sig.bind(*args, **kwargs)
                    t = bound.arguments[arg]
                    world = self.dist.get_world_size(bound.arguments.get("group"))
                    b = t.numel() * t.element_size()
                    entry["tensor_bytes"] += b
                    entry["sent"] += factor(world) * b
                    entry["recv"] += factor(world) * b
            return out

        return wrapped

    def step(self):
        traffic = self

        class _Step:
            def __enter__(self):
                traffic.current = {}
                return traffic.current

            def __exit__(self, *exc):
                traffic.current = None

        return _Step()


def state_bytes(state):
    return sum(v.numel() * v.element_size() for st in state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)


def buckets_of(sizes, elem_bytes, cap_bytes):
    """ZeRO stage 2's buckets (one dtype): consecutive tensors up to cap_bytes, a larger one alone."""
    out = []
    for n in sizes:
        if not out or (cap_bytes is not None and sum(out[-1]) and (sum(out[-1]) + n) * elem_bytes > cap_bytes):
            out.append([])
        out[-1].append(n)
    return out


def traffic_model(stage, allreduce, clip, sizes, world, gbytes, pbytes, chunk, reduce_scatter):
    """{term: bytes} of the exact model, its ideal (unpadded) value, and the tolerance above it.
    Stage 2 cuts each bucket into one range per rank (stage 1: one bucket); the all-gather's row is
    the largest rank's total, the reduce-scatters' rows each bucket's longest range."""
    from optfuse.torch.distributed import shard_ranges
    n = world
    P, T = sum(sizes), len(sizes)
    buckets = buckets_of(sizes, gbytes, BUCKET_BYTES if stage == 2 else None)
    per_bucket = [shard_ranges(b, n, chunk) for b in buckets]
    S = max(sum(rs[r][1] - rs[r][0] for rs in per_bucket) for r in range(n))
    rows = sum(max(hi - lo for lo, hi in rs) for rs in per_bucket)
    terms, ideal = {}, Fraction(0)
    if allreduce:
        terms["all_reduce grads"] = Fraction(2 * (n - 1), n) * P * gbytes
        ideal += terms["all_reduce grads"]
    if stage == 2:
        if reduce_scatter:
            terms["reduce_scatter grads"] = Fraction((n - 1) * rows * gbytes)
        else:
            terms["all_reduce [N,row] grads (fallback)"] = Fraction(2 * (n - 1), n) * n * rows * gbytes
        # which parameters have gradients, which buckets are sent again
        terms["all_reduce flags"] = Fraction(2 * (n - 1), n) * 4 * (T + len(buckets))
        ideal += Fraction(n - 1, n) * P * gbytes
    if stage in (1, 2):
        terms["all_gather params"] = Fraction((n - 1) * S * pbytes)
        ideal += Fraction(n - 1, n) * P * pbytes
    tolerance = 0
    chunks = 0
    if stage and clip:
        # the largest rank's chunk count over its pieces (each piece's chunks, the last partial one too)
        per_rank = [0] * n
        for bucket, ranges in zip(buckets, per_bucket):
            start = 0
            for size in bucket:
                for r, (a, b) in enumerate(ranges):
                    lo, hi = max(a, start), min(b, start + size)
                    if lo < hi:
                        per_rank[r] += -(-(hi - lo) // chunk)
                start += size
        chunks = max(per_rank)
        tolerance = (n - 1) * EXCHANGE_BYTES_PER_CHUNK * chunks  # one reduction: the clip's sum of squares
    return terms, ideal, tolerance, dict(P=P, T=T, S=S, buckets=len(buckets), reduce_rows=rows,
                                         chunks_largest_rank=chunks, ranges=per_bucket)


def make_optimizer(kind, params, device):
    import optfuse.torch as oft
    if kind == "adamw":
        return oft.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), "optfuse AdamW"
    if kind == "clip":
        return oft.Fused(CLIP_CHAIN, params), "optfuse clip_by_global_norm + adamw"
    for flag in ("fused", "foreach"):
        try:
            opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **{flag: True})
            if flag == "fused":  # construction may accept what the first step refuses
                probe = [torch.nn.Parameter(torch.zeros(4, device=device, dtype=params[0].dtype))]
                probe[0].grad = torch.zeros_like(probe[0])
                torch.optim.AdamW(probe, fused=True).step()
            return opt, f"torch AdamW {flag}"
        except (RuntimeError, ValueError, NotImplementedError):
            continue
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), "torch AdamW for-loop"


def run_variant(variant, shapes, dtype, device, world, cfg, traffic, dist, chunk):
    from optfuse.torch.distributed import ZeRO
    name, stage, allreduce, kind = variant
    rank = dist.get_rank()
    sizes = [numel(s) for s in shapes]
    total = sum(sizes)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)  # the same parameters on every rank
    pflat = torch.empty(total, dtype=dtype, device=device)
    pflat.uniform_(-0.1, 0.1, generator=gen)
    params = [torch.nn.Parameter(t.view(s)) for t, s in zip(pflat.split(sizes), shapes)]
    gen.manual_seed(1000 + rank)  # this rank's local gradients
    local = torch.randn(total, dtype=dtype, device=device, generator=gen).mul_(0.01)
    gflat = torch.empty_like(local)
    gviews = [t.view(s) for t, s in zip(gflat.split(sizes), shapes)]
    per_bucket = max(1, BUCKET_BYTES // gflat.element_size())
    buckets = [gflat[i:i + per_bucket] for i in range(0, total, per_bucket)]
    inner, label = make_optimizer(kind, params, device)
    opt = ZeRO(inner, stage=stage) if stage else inner
    if stage:
        label = f"ZeRO stage {stage} of {label}"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, counts = [], []
    for s in range(cfg["warmup"] + cfg["steps"]):
        gflat.copy_(local)  # this rank's local gradients again (untimed)
        for p, g in zip(params, gviews):
            p.grad = g  # ZeRO stage 2 frees .grad after each step
        sync()
        t0 = time.perf_counter()
        with traffic.step() as rec:
            if allreduce:
                for b in buckets:  # DDP: divide by N, then sum over ranks, bucket by bucket
                    b.div_(world)
                    dist.all_reduce(b)
            opt.step()
            sync()
        dt = time.perf_counter() - t0
        counts.append(rec)
        if s >= cfg["warmup"]:
            times.append(dt)
    st = state_bytes(opt._inner.state if stage else opt.state)  # ZeRO: its inner optimizer over this rank's pieces
    reduce_scatter = not stage or stage == 1 or world == 1 or "reduce_scatter_tensor" in counts[-1]
    gb = pb = pflat.element_size()
    terms, ideal, tol, info = traffic_model(stage, allreduce, kind == "clip", sizes, world, gb, pb, chunk,
                                            reduce_scatter)
    model = sum(terms.values(), Fraction(0))
    per_step = []
    bad = []
    for s, rec in enumerate(counts):
        sent = sum((e["sent"] for e in rec.values()), Fraction(0))
        recv = sum((e["recv"] for e in rec.values()), Fraction(0))
        per_step.append(dict(sent=float(sent), recv=float(recv)))
        unmodelled = sorted(k for k in rec if k not in COUNTED)
        if unmodelled:
            bad.append((s, f"unmodelled collective(s) {unmodelled}"))
        for what, v in (("sent", sent), ("received", recv)):
            if not (0 <= v - model <= tol):
                bad.append((s, f"{float(v):.0f} B {what}, model {float(model):.0f} B "
                                f"(difference {float(v - model):+.0f} B, tolerance 0..{tol} B)"))
    steps_of = {}
    for s, m in bad:
        steps_of.setdefault(m, []).append(s)
    bad = [f"{m} (step{'s' if len(at) > 1 else ''} {', '.join(map(str, at))})" for m, at in steps_of.items()]
    last = counts[-1]
    sent = sum((e["sent"] for e in last.values()), Fraction(0))
    del opt, inner, params, pflat, gflat, local, buckets, gviews
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(variant=name, optimizer=label, rank=rank, step_ms=statistics.median(times) * 1e3,
                step_ms_all=[t * 1e3 for t in times],
                sent=float(sent), recv=float(sum((e["recv"] for e in last.values()), Fraction(0))),
                model=float(model), model_terms={k: float(v) for k, v in terms.items()}, ideal=float(ideal),
                tolerance=tol, difference=float(sent - model), per_step=per_step,
                collectives={k: dict(calls=e["calls"], tensor_bytes=e["tensor_bytes"], sent=float(e["sent"]),
                                     recv=float(e["recv"])) for k, e in last.items()},
                reduce_scatter=reduce_scatter, state_bytes=st, shard_elements=info["S"], params=info["P"],
                tensors=info["T"], exchange_chunks=info["chunks_largest_rank"], mismatches=bad)


def worker(rank, world, rendezvous, out_dir, cfg):
    threads = cfg["threads"]
    os.environ["OPTFUSE_NUM_THREADS"] = str(threads)  # before optfuse's thread pool starts
    if cfg["device"] == "cuda":
        os.environ["OPTFUSE_CUDA_DEVICE"] = str(rank)  # optfuse's context where the thread has none
    torch.set_num_threads(threads)
    import torch.distributed as dist
    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    out = dict(rank=rank, results=[], error=None)
    try:
        kw = {}
        if device.type == "cuda" and "device_id" in inspect.signature(dist.init_process_group).parameters:
            kw["device_id"] = device  # binds the NCCL communicator to this rank's GPU
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfg["pg_timeout"]), **kw)
        from optfuse import _core
        chunk = _core.chunk_elements(device.type)
        traffic = Traffic(dist)
        dtype = getattr(torch, cfg["dtype"])
        for label, name, scale in cfg["workloads"]:
            shapes = workload_shapes.shapes(name, scale)
            for variant in VARIANTS:
                r = run_variant(variant, shapes, dtype, device, world, cfg, traffic, dist, chunk)
                r["workload"] = label
                out["results"].append(r)
        dist.barrier()
    except Exception:
        out["error"] = traceback.format_exc()
        raise
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world, cfg, timeout):
    """Runs `worker` on `world` processes (spawn), bounded by `timeout` seconds; the ranks' JSON."""
    import torch.multiprocessing as mp
    run_dir = tempfile.mkdtemp(prefix=f"zero_vs_ddp_{world}_")
    try:
        ctx = mp.start_processes(worker, args=(world, os.path.join(run_dir, "rendezvous"), run_dir, cfg),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        failure = None
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.terminate()
                    failure = f"{world} ranks did not finish within {timeout} s (--timeout)"
                    break
        except Exception as e:  # a rank raised or died: the others are terminated by join
            failure = e
        outs = []
        for r in range(world):
            path = os.path.join(run_dir, f"rank{r}.json")
            outs.append(json.load(open(path)) if os.path.exists(path) else None)
        if failure:
            errors = "".join(f"\n--- rank {o['rank']}:\n{o['error']}" for o in outs if o and o["error"])
            if isinstance(failure, Exception):  # the ranks' own tracebacks where they wrote them
                failure = "a rank failed" + (errors if errors else f": {failure}")
            else:
                failure += errors
            raise RuntimeError(failure)
        return outs
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def cpu_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_info(device):
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = dict(host=platform.node(), platform=platform.platform(), python=platform.python_version(),
                cpu=cpu, cores=cpu_cores(),
                torch=torch.__version__)
    try:
        import optfuse
        info["optfuse"] = getattr(optfuse, "__version__", "?")
    except ImportError:
        info["optfuse"] = None
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def fmt_bytes(b):
    return f"{b:,.0f}"


def fmt_mib(b):
    return f"{b / 2**20:.2f}"


def table(rows):
    head = ("workload", "N", "variant", "step ms", "sent=recv B/step", "model B/step", "meas-model",
            "ideal B/step", "state MiB/rank", "x unsharded")
    lines = [head]
    for r in rows:
        lines.append((r["workload"], str(r["world"]), r["variant"] + ("" if r["reduce_scatter"] else " (fallback)"),
                      f"{r['step_ms']:.2f}", fmt_bytes(r["sent"]), fmt_bytes(r["model"]),
                      f"{r['difference']:+,.0f}" + (f" (<={r['tolerance']:,})" if r["tolerance"] else ""),
                      fmt_bytes(r["ideal"]), fmt_mib(r["state_bytes"]),
                      f"{r['state_ratio']:.3f}" if r["state_ratio"] is not None else "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    align = ["<", ">", "<", ">", ">", ">", ">", ">", ">", ">"]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(f"{c:{a}{w}}" for c, a, w in zip(line, align, widths)))
        if k == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: gloo; cuda: NCCL, rank r on cuda:r (needs as many GPUs as ranks)")
    ap.add_argument("--workloads", default=None,
                    help=f"NAME[@SCALE],... from bench/workload_shapes.py ({', '.join(workload_shapes.WORKLOADS)}); "
                         f"SCALE scales every tensor's element count (flattened). Default: cpu "
                         f"{CPU_DEFAULT_WORKLOADS}; cuda {CUDA_DEFAULT_WORKLOADS}")
    ap.add_argument("--scale", type=float, default=1.0, help="scale of workloads given without @SCALE")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="parameters and gradients (the optimizer states follow the optimizers' defaults)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads per rank (torch and optfuse); default cores // N, at least 1")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for all the runs of one N (else fail)")
    ap.add_argument("--pg-timeout", type=float, default=120, help="process group timeout in seconds")
    ap.add_argument("--json", default=None, help="write every figure (per rank) and the machine here")
    a = ap.parse_args(argv)

    ranks = [int(x) for x in a.ranks.split(",") if x.strip()]
    if not ranks or min(ranks) < 1:
        raise SystemExit(f"--ranks {a.ranks!r}: world sizes must be >= 1")
    if a.steps < 1 or a.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    import torch.distributed as dist
    if not dist.is_available():
        raise SystemExit("torch.distributed is not available in this torch build")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available (torch.cuda.is_available() is False)")
        have = torch.cuda.device_count()
        if have < max(ranks):
            raise SystemExit(f"--device cuda: {max(ranks)} ranks need {max(ranks)} GPUs (one per rank); "
                             f"{have} visible. Use --ranks with at most {have}.")
        if not dist.is_nccl_available():
            raise SystemExit("--device cuda: this torch build has no NCCL")
    elif not dist.is_gloo_available():
        raise SystemExit("this torch build has no gloo backend")
    workloads = parse_workloads(a.workloads or (CUDA_DEFAULT_WORKLOADS if a.device == "cuda"
                                                else CPU_DEFAULT_WORKLOADS), a.scale)
    cores = cpu_cores()

    rows, per_rank, failures = [], [], []
    for n in ranks:
        threads = a.threads or max(1, cores // n)
        cfg = dict(device=a.device, dtype=a.dtype, steps=a.steps, warmup=a.warmup, threads=threads,
                   pg_timeout=a.pg_timeout, workloads=workloads)
        t0 = time.monotonic()
        try:
            outs = spawn(n, cfg, a.timeout)
        except RuntimeError as e:
            print(f"N={n}: {e}", file=sys.stderr)
            sys.exit(2)
        print(f"N={n}: {time.monotonic() - t0:.1f} s ({threads} thread(s) per rank)", file=sys.stderr)
        for k in range(len(outs[0]["results"])):
            mine = [o["results"][k] for o in outs]
            first = mine[0]
            row = dict(workload=first["workload"], world=n, variant=first["variant"], optimizer=first["optimizer"],
                       step_ms=max(r["step_ms"] for r in mine),  # the slowest rank's median
                       sent=max(r["sent"] for r in mine), recv=max(r["recv"] for r in mine),
                       model=first["model"], model_terms=first["model_terms"], ideal=first["ideal"],
                       tolerance=first["tolerance"], difference=max((r["difference"] for r in mine), key=abs),
                       reduce_scatter=all(r["reduce_scatter"] for r in mine),
                       state_bytes=max(r["state_bytes"] for r in mine), params=first["params"],
                       tensors=first["tensors"], shard_elements=first["shard_elements"],
                       dtype=a.dtype, threads_per_rank=threads if a.device == "cpu" else None,
                       mismatches=[f"rank {r['rank']}: {m}" for r in mine for m in r["mismatches"]])
            rows.append(row)
            per_rank.append(dict(workload=row["workload"], world=n, variant=row["variant"], ranks=mine))
            for m in row["mismatches"]:
                failures.append(f"{row['workload']} N={n} {row['variant']}: {m}")
    for row in rows:  # state against the unsharded optfuse AdamW's (the same workload and N)
        base = next((r["state_bytes"] for r in rows if r["workload"] == row["workload"] and r["world"] == row["world"]
                     and r["variant"] == "ddp optfuse"), None)
        row["state_ratio"] = row["state_bytes"] / base if base else None

    info = machine_info(a.device)
    print(f"zero_vs_ddp: {a.device} ({'NCCL' if a.device == 'cuda' else 'gloo'}), torch {info['torch']}, "
          f"optfuse {info['optfuse']}, {info['cpu']} ({info['cores']} cores)"
          + (f", {info['gpus'][0]} x{len(info['gpus'])}" if a.device == "cuda" else ""))
    print(f"{a.dtype} parameters and gradients; step time: median of {a.steps} steps after {a.warmup} warm-up, "
          f"slowest rank; state: per-element optimizer state one rank holds")
    for label, name, scale in workloads:
        sizes = [numel(s) for s in workload_shapes.shapes(name, scale)]
        print(f"  {label}: {sum(sizes):,} parameters in {len(sizes)} tensors")
    print(COUNTING_TEXT)
    print()
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(machine=info, args=vars(a), counting=COUNTING_TEXT, clip_chain=CLIP_CHAIN,
                           bucket_bytes=BUCKET_BYTES, rows=rows, per_rank=per_rank, failures=failures), f, indent=1)
    if failures:
        print(f"\nFAILED: the measured traffic differs from the model in {len(failures)} case(s):", file=sys.stderr)
        for m in failures:
            print("  " + m, file=sys.stderr)
        sys.exit(1)
    print("\ntraffic model: every row matches (within the stated tolerance)")


if __name__ == "__main__":
    main()
