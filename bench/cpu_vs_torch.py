"""optfuse vs torch AdamW on the CPU, in one run, on the same workload, as fractions of the copy floor.

Rows: `optfuse bench --backend cpu` (adamw, generated C++ over all tensors in one pass) and torch's
torch.optim.AdamW with fused=True, foreach=True and the for-loop (foreach=False). Every variant uses
the same hyperparameters (lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2: torch's AdamW
defaults, which are also optfuse's adamw() defaults), the same dtype, the same thread count, random
parameters and gradients. Step times are medians of timed steps (time.perf_counter) after warm-up.

The floor is optfuse bench's: bytes a step must move (28 per float32 element for AdamW: read param,
grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq) / the copy bandwidth it measured in
the same run (bytes read + written per second by a multi-threaded copy as large as the workload).
"GB/s" is those required bytes per second of step time, for every row alike, so it is comparable
(torch's foreach and for-loop paths move more bytes than that; this counts only what is needed).

On a noisy machine (shared VMs) use --rounds: the variants are run in turn R times and each row
reports the median over rounds of its per-round median.

  python3 bench/cpu_vs_torch.py --optfuse build/optfuse [--workload cpu-default] [--scale 1]
      [--dtype float32|bfloat16] [--threads N] [--steps 20] [--warmup 3] [--rounds 1] [--json out.json]
"""
import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload_shapes  # noqa: E402

VARIANTS = ["optfuse", "torch fused", "torch foreach", "torch for-loop"]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def default_threads():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def median_step_ms(step, steps, warmup):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def run_optfuse(args):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [args.optfuse, "bench", "--backend", "cpu", "--workload", args.workload, "--scale", repr(args.scale),
           "--dtype", args.dtype, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--json", path]
    print("$ " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    with open(path) as fh:
        result = json.load(fh)
    os.unlink(path)
    return result


class TorchWorkload:
    """Parameters with random gradients, allocated once and reused by every torch variant."""

    def __init__(self, shapes, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.params = []
        for s in shapes:
            p = torch.empty(s, dtype=dtype, device="cpu").uniform_(-1, 1, generator=g).requires_grad_()
            p.grad = torch.empty_like(p).uniform_(-1, 1, generator=g)
            self.params.append(p)

    def time_variant(self, variant, steps, warmup):
        kwargs = {"fused": True} if variant == "torch fused" else {"foreach": variant == "torch foreach"}
        # Fresh states for every variant (torch allocates them zeroed at the first step).
        opt = torch.optim.AdamW(self.params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **kwargs)
        with torch.no_grad():
            med, mn = median_step_ms(opt.step, steps, warmup)
        del opt
        return med, mn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optfuse", default="build/optfuse", help="path of the optfuse program")
    ap.add_argument("--workload", default="cpu-default", choices=sorted(workload_shapes.WORKLOADS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every tensor's element count")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=default_threads(), help="threads for optfuse and torch alike")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="run every variant this many times, in turn")
    ap.add_argument("--skip", default="", help="comma-separated variants to leave out, e.g. 'torch for-loop'")
    ap.add_argument("--json", help="write the table and the raw results here")
    args = ap.parse_args()
    if args.threads < 1 or args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.scale <= 0:
        ap.error("--threads, --steps and --rounds must be >= 1, --warmup >= 0, --scale > 0")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variant(s) in --skip: {', '.join(sorted(unknown))}; known: {', '.join(VARIANTS)}")
    variants = [v for v in VARIANTS if v not in skip]

    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    shapes = workload_shapes.shapes(args.workload, args.scale)
    elements = sum(math.prod(s) for s in shapes)
    print(f"workload {args.workload} (scale {args.scale:g}): {len(shapes)} tensors, {elements:,} elements, "
          f"{args.dtype}; {args.threads} threads; torch {torch.__version__}; {cpu_model()}, "
          f"{os.cpu_count()} CPUs online", file=sys.stderr)
    tw = TorchWorkload(shapes, dtype) if any(v.startswith("torch") for v in variants) else None

    per_round = {v: [] for v in variants}  # (median ms, min ms) per round
    optfuse_runs = []
    for r in range(args.rounds):
        for v in variants:
            if v == "optfuse":
                res = run_optfuse(args)
                if res["elements"] != elements:
                    sys.exit(f"optfuse bench stepped {res['elements']} elements, torch {elements}: shapes disagree")
                optfuse_runs.append(res)
                per_round[v].append((res["step_ms_median"], res["step_ms_min"]))
            else:
                per_round[v].append(tw.time_variant(v, args.steps, args.warmup))
            print(f"round {r + 1}/{args.rounds}: {v}: median {per_round[v][-1][0]:.3f} ms", file=sys.stderr)

    if optfuse_runs:
        copy_gbps = statistics.median(x["copy_bandwidth_GBps"] for x in optfuse_runs)
        bytes_per_step = optfuse_runs[0]["bytes_per_step"]
    else:  # no optfuse row: no measured copy bandwidth, so no floor
        copy_gbps, bytes_per_step = float("nan"), 7 * elements * (4 if args.dtype == "float32" else 2)
    floor_ms = bytes_per_step / (copy_gbps * 1e9) * 1e3
    rows = []
    for v in variants:
        med = statistics.median(x[0] for x in per_round[v])
        mn = min(x[1] for x in per_round[v])
        rows.append({"variant": v, "step_ms_median": med, "step_ms_min": mn,
                     "effective_GBps": bytes_per_step / (med * 1e-3) / 1e9, "fraction_of_floor": floor_ms / med})

    head = f"{'variant':<16} {'median ms':>10} {'min ms':>9} {'GB/s':>7} {'% floor':>8} {'vs optfuse':>10}"
    lines = [f"workload {args.workload} (scale {args.scale:g}), {len(shapes)} tensors, {elements:,} elements, "
             f"{args.dtype}, {args.threads} threads, {args.rounds} round(s) of {args.steps} steps after "
             f"{args.warmup} warm-up",
             f"copy bandwidth {copy_gbps:.2f} GB/s (read + written) -> floor {floor_ms:.3f} ms for "
             f"{bytes_per_step / 1e9:.3f} GB per step",
             head, "-" * len(head)]
    base = next((r["step_ms_median"] for r in rows if r["variant"] == "optfuse"), None)
    for r in rows:
        rel = f"{r['step_ms_median'] / base:9.2f}x" if base else ""
        lines.append(f"{r['variant']:<16} {r['step_ms_median']:10.3f} {r['step_ms_min']:9.3f} "
                     f"{r['effective_GBps']:7.2f} {100 * r['fraction_of_floor']:7.1f}% {rel:>10}")
    print("\n".join(lines), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"workload": args.workload, "scale": args.scale, "dtype": args.dtype, "threads": args.threads,
                       "elements": elements, "tensors": len(shapes), "torch": torch.__version__,
                       "cpu": cpu_model(), "copy_bandwidth_GBps": copy_gbps, "floor_ms": floor_ms,
                       "bytes_per_step": bytes_per_step, "rows": rows, "optfuse_runs": optfuse_runs,
                       "per_round": per_round}, fh, indent=1)


if __name__ == "__main__":
    main()
