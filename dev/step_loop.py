"""Steps an optfuse.torch optimizer on a benchmark workload and nothing else: a target for Nsight
Compute (`ncu --kernel-name of_phase1 ... python3 dev/step_loop.py --optimizer Adafactor`), which
the torch profiler of dev/kernel_times.py would disturb.

  python3 dev/step_loop.py --optimizer Adafactor --workload gpt2-small [--steps 5]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import workload_shapes  # noqa: E402
from optimizers_vs_torch import OPTIMIZERS  # noqa: E402

import optfuse.torch as oft  # noqa: E402


def parse_args(workload="gpt2-small", steps=5):
    """--optimizer, --workload, --steps: the arguments of this script and of dev/kernel_times.py."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", default="Adafactor")
    ap.add_argument("--workload", default=workload)
    ap.add_argument("--steps", type=int, default=steps)
    return ap.parse_args()


def optimizer_on(name, workload):
    """The optfuse.torch optimizer `name` (bench/optimizers_vs_torch.py's arguments) over the
    workload's parameters on the GPU, each with a gradient."""
    _, kw = OPTIMIZERS[name]
    params = [torch.randn(s, device="cuda") for s in workload_shapes.shapes(workload)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    return getattr(oft, name)(params, **kw), params


def main():
    a = parse_args()
    opt, _ = optimizer_on(a.optimizer, a.workload)
    for _ in range(a.steps):
        opt.step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
