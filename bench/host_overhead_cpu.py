"""Host time per step() on the CPU in the loop users write, where the kernel is negligible: each
step, every parameter gets a NEW gradient tensor (alternating between two preallocated sets, as
zero_grad + backward would hand over), then opt.step() is timed alone. Parameters have the tensor
count of a workload (bench/workload_shapes.py) but only `--elements` elements each, so what is
measured is the optimizer's own per-step work: reading torch's state (the per-step check of every
parameter, gradient and state tensor), pushing hyperparameters, the launch and its bookkeeping.

Run it once per build to compare two builds in one session (e.g. PYTHONPATH of an older install):
  python3 bench/host_overhead_cpu.py [--workloads gpt2-small,many-small] [--steps 300] [--backward]
      [--json out.json]
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


def measure(n_tensors, elements, steps, warmup, optimizer, backward=False):
    import optfuse.torch as oft
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(elements)) for _ in range(n_tensors)]
    sets = [[torch.randn(elements) for _ in params] for _ in range(2)]
    if optimizer == "optfuse":
        opt = oft.AdamW(params, lr=1e-3, weight_decay=1e-2)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=True)
    times = []
    for s in range(warmup + steps):
        opt.zero_grad(set_to_none=True)
        if backward:  # gradients made by autograd, as in training: no Python object until .grad is read
            sum((p * p).sum() for p in params).backward()
        else:
            for p, g in zip(params, sets[s % 2]):
                p.grad = g.view_as(g)  # a new tensor object over the same memory
        t0 = time.perf_counter_ns()
        opt.step()
        t1 = time.perf_counter_ns()
        if s >= warmup:
            times.append((t1 - t0) / 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="gpt2-small,many-small")
    ap.add_argument("--elements", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--torch", action="store_true", help="also torch.optim.AdamW(foreach=True)")
    ap.add_argument("--backward", action="store_true",
                    help="gradients from backward() of sum(p*p) each step, not assigned from Python")
    ap.add_argument("--json")
    a = ap.parse_args()
    import optfuse
    out = {"optfuse": os.path.dirname(optfuse.__file__), "torch": torch.__version__, "results": []}
    for name in a.workloads.split(","):
        n = len(workload_shapes.shapes(name))
        for opt in ["optfuse"] + (["torch foreach"] if a.torch else []):
            us = measure(n, a.elements, a.steps, a.warmup, opt, a.backward)
            out["results"].append({"workload": name, "tensors": n, "optimizer": opt, "host_us": us})
            print(f"{name:12s} {n:5d} tensors  {opt:14s} {us:9.1f} us/step (median of {a.steps})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
