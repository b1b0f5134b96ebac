"""AdamW step time with low-precision parameters, optfuse's mixed-precision options against torch's
fused AdamW in the same run on one GPU, as a fraction of each configuration's memory floor.

Per configuration and workload (bench/workload_shapes.py): bfloat16 parameters, a new bfloat16
gradient tensor for every parameter every step (the loop users write, as bench/optimizers_vs_torch.py),
GPU time of opt.step() by CUDA events, median of --steps steps after --warmup. Floor = bytes per
element actually moved (each role read and/or written once, at its storage size: the table below)
x elements / copy bandwidth (bench/training_loop.py's copy_bandwidth, one definition).

  configuration                       reads                          writes              B/elem
  bf16 everything (torch fused too)   p g m v: 2+2+2+2               p m v: 2+2+2          14
  bf16 + fp32 master + fp32 states    g master m v: 2+4+4+4          p master m v: 2+4+4+4 28
  bf16 + remainders + fp32 states     p rem g m v: 2+2+2+4+4         p rem m v: 2+2+4+4    26
  bf16 states, stochastic rounding    p g m v: 2+2+2+2               p m v: 2+2+2          14

  python3 bench/mixed_precision_vs_torch.py [--workloads llama-1b] [--steps 20] [--warmup 5] [--json out.json]
"""
import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload_shapes  # noqa: E402
from optimizers_vs_torch import time_steps  # noqa: E402  (the same timing loop)
from training_loop import copy_bandwidth  # noqa: E402

import optfuse.torch as oft  # noqa: E402

# label -> (bytes per element, factory(params) -> optimizer)
CONFIGS = {
    "torch AdamW(fused=True), bf16 states": (14, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
    "optfuse AdamW, bf16 states": (14, lambda ps: oft.AdamW(ps, lr=1e-4)),
    "optfuse AdamW, master_weights=True": (28, lambda ps: oft.AdamW(ps, lr=1e-4, master_weights=True)),
    "optfuse AdamW, master_weights='remainders'": (26, lambda ps: oft.AdamW(ps, lr=1e-4, master_weights="remainders")),
    "optfuse AdamW, bf16 states + stochastic rounding": (
        14, lambda ps: oft.AdamW(ps, lr=1e-4, stochastic_rounding=True, state_dtype=torch.bfloat16)),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="llama-1b")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    results = []
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for wl in a.workloads.split(","):
        shapes = workload_shapes.shapes(wl, a.scale)
        n = sum(torch.Size(s).numel() for s in shapes)
        bw = copy_bandwidth(n)
        print(f"\n{wl}: {len(shapes)} tensors, {n / 1e6:.1f} M elements, copy bandwidth {bw / 1e9:.0f} GB/s")
        print(f"  {'configuration':<50} {'B/elem':>6} {'floor ms':>8} {'ms/step':>8} {'% floor':>8}")
        for label, (bpe, factory) in CONFIGS.items():
            floor_ms = bpe * n / bw * 1e3
            try:
                ms = time_steps(factory, shapes, a.steps, a.warmup, dtype=torch.bfloat16)
                pct = 100 * floor_ms / ms
                print(f"  {label:<50} {bpe:>6} {floor_ms:>8.3f} {ms:>8.3f} {pct:>7.1f}%")
                results.append(dict(workload=wl, configuration=label, bytes_per_element=bpe, floor_ms=floor_ms, ms=ms,
                                    pct_floor=pct, elements=n, copy_gbps=bw / 1e9))
            except Exception as e:  # noqa: BLE001
                print(f"  {label}: FAILED {type(e).__name__}: {e}")
                traceback.print_exc(limit=2)
                results.append(dict(workload=wl, configuration=label, error=str(e)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
