"""optfuse.torch.AdamW over parameters of the same sizes laid out four ways, side by side in one run:
dense (contiguous), channels-last (ResNet-50's convolution shapes, bench/workload_shapes.py),
transposed views (each matrix a `.t()` of a contiguous one: dense, another order of dimensions) and
views with gaps (every second element of a buffer twice the size: stepped through a dense copy
gathered and scattered around the launch). Median step time of --steps steps after --warmup, with
new gradients each step as users' loops hand over; the ratio to the dense step.

  python3 bench/strided_vs_dense.py [--device cpu|cuda] [--scale 0.25] [--steps 20] [--json out.json]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload_shapes  # noqa: E402


def layouts(shapes, device):
    """{layout name: list of parameters}, the same sizes in each."""
    out = {"dense": [], "channels-last": [], "transposed": [], "gaps": []}
    for s in shapes:
        out["dense"].append(torch.randn(s, device=device))
        if len(s) == 4:
            out["channels-last"].append(torch.randn(s, device=device).to(memory_format=torch.channels_last))
        else:
            out["channels-last"].append(torch.randn(s, device=device))
        if len(s) >= 2:
            flipped = (*s[:-2], s[-1], s[-2])
            out["transposed"].append(torch.randn(flipped, device=device).transpose(-1, -2))
        else:
            out["transposed"].append(torch.randn(s, device=device))
        base = torch.randn((*s, 2), device=device)
        out["gaps"].append(base[..., 0])
    return out


def time_steps(params, steps, warmup, device):
    import optfuse.torch as oft
    ps = [torch.nn.Parameter(t) for t in params]
    grads = [[torch.randn_like(p) for p in ps] for _ in range(2)]
    opt = oft.AdamW(ps, lr=1e-3, weight_decay=1e-2)
    times = []
    for s in range(warmup + steps):
        for p, g in zip(ps, grads[s % 2]):
            p.grad = g.view_as(g)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workload", default="resnet50-convs")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    shapes = workload_shapes.WORKLOADS[a.workload]()
    if a.scale != 1.0:  # (keeps every dimension count: scales the first dimension)
        shapes = [(max(1, int(s[0] * a.scale)), *s[1:]) for s in shapes]
    elements = sum(torch.Size(s).numel() for s in shapes)
    rows = []
    results = {name: time_steps(ps, a.steps, a.warmup, a.device) for name, ps in layouts(shapes, a.device).items()}
    for name, ms in results.items():
        rows.append({"layout": name, "ms": ms, "vs_dense": ms / results["dense"]})
        print(f"{a.workload} ({len(shapes)} tensors, {elements / 1e6:.1f}M elements, {a.device}): {name:14s} "
              f"{ms:8.2f} ms/step  {ms / results['dense']:.2f}x dense")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": a.workload, "device": a.device, "elements": elements, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
