"""Optimizers optfuse did not write, fused by tracing (`optfuse.torch.fuse(opt)`), against their own
implementations, in the loop users write (new gradient tensors every step), on a CUDA GPU.

For each third-party class and workload: the original's step time and the fused one's (median GPU
time of --steps steps after --warmup, the same timing as bench/optimizers_vs_torch.py), the fused
step as a fraction of its memory floor (the traced plan's bytes per element / the copy bandwidth
measured in the same run), and the one-off costs of fusing: `fuse()` (trace + verification against
the original on probes) and the first step (NVRTC compile of the traced rule, with an empty
compile cache: OPTFUSE_CACHE_DIR points at a fresh directory).

  python3 bench/traced_vs_original.py [--workloads gpt2-small,many-small] [--json out.json]

Classes whose package is not installed are skipped with a line saying so.
"""
import argparse
import importlib
import json
import os
import re
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload_shapes  # noqa: E402
from optimizers_vs_torch import time_steps  # noqa: E402
from training_loop import copy_bandwidth  # noqa: E402

import optfuse.torch as oft  # noqa: E402

# label -> (module, class, constructor arguments); foreach=False where the class has it (the tracer
# records per-parameter torch ops; foreach lists are refused)
CLASSES = {
    "lion_pytorch.Lion": ("lion_pytorch", "Lion", dict(lr=1e-4, weight_decay=0.01)),
    "timm.optim.AdaBelief": ("timm.optim", "AdaBelief", dict(lr=1e-3, weight_decay=0.01)),
    "pytorch_optimizer.Yogi": ("pytorch_optimizer", "Yogi", dict(lr=1e-3, foreach=False)),
    "pytorch_optimizer.Adan": ("pytorch_optimizer", "Adan", dict(lr=1e-3, foreach=False)),
}


def traced_bytes(opt):
    """Total bytes per element of the fused optimizer's plan (from optfuse.torch.explain)."""
    m = re.search(r"total bytes per element: (\d+)", oft.explain(opt, backend="cuda"))
    return int(m.group(1)) if m else None


def one_off_costs(make, shapes):
    """(seconds of fuse(), seconds of the first fused step with a cold compile cache)."""
    params = [torch.randn(s, device="cuda") for s in shapes]
    original = make(params)
    t0 = time.perf_counter()
    fused = oft.fuse(original)
    t_fuse = time.perf_counter() - t0
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fused.step()
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    return t_fuse, t_first, fused


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="gpt2-small,many-small")
    ap.add_argument("--classes", default=",".join(CLASSES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ["OPTFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="optfuse-cold-cache-")  # first steps compile
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    results = []
    for wl in a.workloads.split(","):
        shapes = workload_shapes.shapes(wl)
        n = sum(torch.Size(s).numel() for s in shapes)
        bw = copy_bandwidth(n)
        print(f"\n{wl}: {len(shapes)} tensors, {n / 1e6:.1f} M elements, copy bandwidth {bw / 1e9:.0f} GB/s")
        print(f"  {'class':<26} {'original ms':>11} {'fused ms':>9} {'speedup':>8} {'B/elem':>6} {'% floor':>8}"
              f" {'fuse() s':>9} {'1st step s':>10}")
        for label in a.classes.split(","):
            module, name, kw = CLASSES[label]
            try:
                cls = getattr(importlib.import_module(module), name)
            except Exception as e:  # noqa: BLE001
                print(f"  {label:<26} skipped: {type(e).__name__}: {e}")
                continue
            try:
                make = lambda ps, c=cls, k=kw: c(ps, **k)  # noqa: E731
                t_fuse, t_first, fused = one_off_costs(make, shapes)
                bpe = traced_bytes(fused)
                del fused
                ms_orig = time_steps(make, shapes, a.steps, a.warmup)
                ms_fused = time_steps(lambda ps: oft.fuse(make(ps)), shapes, a.steps, a.warmup)
                floor_ms = bpe * n / bw * 1e3 if bpe else float("nan")
                pct = 100 * floor_ms / ms_fused
                print(f"  {label:<26} {ms_orig:>11.3f} {ms_fused:>9.3f} {ms_orig / ms_fused:>7.2f}x {bpe:>6} {pct:>7.1f}%"
                      f" {t_fuse:>9.3f} {t_first:>10.3f}")
                results.append(dict(workload=wl, cls=label, original_ms=ms_orig, fused_ms=ms_fused, bytes_per_element=bpe,
                                    floor_ms=floor_ms, pct_floor=pct, fuse_s=t_fuse, first_step_s=t_first, elements=n,
                                    tensors=len(shapes), copy_gbps=bw / 1e9))
            except Exception as e:  # noqa: BLE001
                print(f"  {label:<26} FAILED {type(e).__name__}: {e}")
                traceback.print_exc(limit=3)
                results.append(dict(workload=wl, cls=label, error=f"{type(e).__name__}: {e}"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
