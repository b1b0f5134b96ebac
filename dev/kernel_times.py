"""GPU time of each kernel of an optfuse.torch optimizer's step (torch profiler, CUDA time per step),
with the bytes each pass moves and its fraction of the copy bandwidth: which pass is off its floor.

  python3 dev/kernel_times.py --optimizer Adafactor --workload llama-1b [--steps 10]
"""
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import workload_shapes  # noqa: E402
from optimizers_vs_torch import OPTIMIZERS  # noqa: E402
from training_loop import copy_bandwidth  # noqa: E402

import optfuse  # noqa: E402
from step_loop import optimizer_on, parse_args  # noqa: E402


def pass_bytes(spec):
    """Bytes per element of each pass (explain's plan)."""
    return [int(m) for m in re.findall(r"bytes per element: \d+ read \+ \d+ written = (\d+)", optfuse.explain(spec))]


def main():
    a = parse_args(workload="llama-1b", steps=10)
    spec, _ = OPTIMIZERS[a.optimizer]
    n = sum(torch.Size(s).numel() for s in workload_shapes.shapes(a.workload))
    bw = copy_bandwidth(n)
    opt, _ = optimizer_on(a.optimizer, a.workload)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            opt.step()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.device_time_total / a.steps
    bytes_of = dict(zip([f"of_phase{i}" for i in range(10)], pass_bytes(spec)))
    print(f"{a.optimizer} on {a.workload}: {n / 1e6:.1f} M elements, copy bandwidth {bw / 1e9:.0f} GB/s")
    total = 0.0
    for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
        total += us
        b = bytes_of.get(name)
        floor = f"{b} B/elem, floor {b * n / bw * 1e6:8.1f} us, {100 * b * n / bw * 1e6 / us:5.1f}% of it" if b else ""
        print(f"  {name:<24} {us:9.1f} us/step  {floor}")
    print(f"  total {total:.1f} us/step")


if __name__ == "__main__":
    main()
