"""Which part of building an optimizer waits for the GPU? Each piece is timed on the host behind
--sleep-ms of queued GPU work (a piece that waits takes about the sleep longer than alone):
the core Optimizer's construction (CUDA executor: kernels from the disk cache, loaded), set_tensors
for N tensors, the first step, destroying an optimizer that stepped (its device buffers freed),
a page-locked allocation, torch allocations.

    python3 dev/construct_wait.py [--tensors 2000] [--numel 4096] [--sleep-ms 300]
"""
import argparse
import os
import sys
import time

import torch

import optfuse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from training_loop import sleep_cycles_per_ms  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--sleep-ms", type=float, default=300.0)
    a = ap.parse_args()
    cyc = int(a.sleep_ms * sleep_cycles_per_ms())

    def timed(label, fn):
        out = {}
        for behind in (False, True):
            torch.cuda.synchronize()
            if behind:
                torch.cuda._sleep(cyc)
            t0 = time.perf_counter()
            r = fn()
            out[behind] = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
        verdict = "WAITS" if out[True] > out[False] + 0.5 * a.sleep_ms else "no wait"
        print(f"{label:58s} {out[False]:8.1f} ms alone {out[True]:8.1f} ms behind: {verdict}", flush=True)
        return r

    spec = "adamw(lr=1e-3, weight_decay=0.01)"
    timed("core Optimizer (first: compiles)", lambda: optfuse.Optimizer(spec, "cuda"))
    timed("core Optimizer (kernels cached)", lambda: optfuse.Optimizer(spec, "cuda"))
    timed("page-locked 1 MiB (torch pin_memory)", lambda: torch.empty(1 << 18, pin_memory=True))
    timed("torch.empty 64 MiB on the GPU", lambda: torch.empty(1 << 24, device="cuda"))

    def tensors():
        return [(torch.randn(a.numel, device="cuda"), torch.randn(a.numel, device="cuda"),
                 [torch.zeros(a.numel, device="cuda"), torch.zeros(a.numel, device="cuda")], 0)
                for _ in range(a.tensors)]
    for n in (a.tensors, 148, 16):
        sets = [tensors()[:n] for _ in range(2)]
        it = iter(sets)
        opts = [optfuse.Optimizer(spec, "cuda") for _ in range(2)]
        ot = iter(opts)
        timed(f"set_tensors, {n} tensors (a new optimizer)", lambda: next(ot).set_tensors(next(it)))
        ot = iter(opts)
        timed(f"step, {n} tensors (each optimizer's first)", lambda: next(ot).step())
        timed(f"step, {n} tensors (later steps)", lambda: opts[0].step())
        # each call drops the last reference to one optimizer: its destructor runs inside the call
        timed(f"destroying an optimizer of {n} tensors", lambda: (opts.pop(), None)[1])


if __name__ == "__main__":
    main()
