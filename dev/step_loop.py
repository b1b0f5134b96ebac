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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", default="Adafactor")
    ap.add_argument("--workload", default="gpt2-small")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    _, kw = OPTIMIZERS[a.optimizer]
    params = [torch.randn(s, device="cuda") for s in workload_shapes.shapes(a.workload)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = getattr(oft, a.optimizer)(params, **kw)
    for _ in range(a.steps):
        opt.step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
