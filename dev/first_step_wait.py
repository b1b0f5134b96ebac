"""Does the first step() (the one that builds the tables) wait for the GPU? Host time of that step
with and without ~--sleep-ms of GPU work queued ahead, for optfuse.torch.AdamW with CUDA-tensor
hyperparameters (capturable) and with Python numbers; a step that waits takes the sleep longer.
--profile: cProfile of the step behind the sleep (cumulative), to find where a wait happens.
--sync-debug: one more first step under torch.cuda.set_sync_debug_mode("error"): the first torch
call in it that synchronises with the GPU raises, and its traceback is printed (syncs inside
optfuse's C++ do not show there).

    python3 dev/first_step_wait.py [--tensors 148] [--numel 1048576] [--sleep-ms 50] [--profile]
                                   [--sync-debug] [--workload gpt2-small]

--workload: the shapes of bench/workload_shapes.py, parameters made as bench/training_loop.py makes
them (after torch.cuda.empty_cache(), so the states need new device memory) instead of equal tensors."""
import argparse
import cProfile
import gc
import os
import sys
import time
import traceback

import torch

import optfuse.torch as oft
from profile_top import print_top

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from training_loop import Workload, sleep_cycles_per_ms  # noqa: E402
from workload_shapes import shapes  # noqa: E402


def make_params(a):
    if not a.workload:
        return [torch.nn.Parameter(torch.randn(a.numel, device="cuda")) for _ in range(a.tensors)]
    return Workload(shapes(a.workload)).fresh_params()


def first_step_ms(a, tensor_hypers, sleep_cycles, profile, sync_debug=False):
    ps = make_params(a)
    for p in ps:
        p.grad = torch.randn_like(p)
    t = (lambda x: torch.tensor(x, device="cuda")) if tensor_hypers else (lambda x: x)
    opt = oft.AdamW(ps, lr=t(1e-3), betas=(t(0.9), t(0.999)), eps=t(1e-8), weight_decay=t(0.01),
                    capturable=tensor_hypers)
    gc.collect()  # the previous call's optimizer is freed here, not inside the timed step
    torch.cuda.synchronize()
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    try:
        torch.cuda.set_sync_debug_mode("error" if sync_debug else 0)
        prof.runcall(opt.step) if prof else opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    if prof:
        print_top(prof, 1, 14, "the step behind the sleep", cumulative=True)
    return ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=148)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--sleep-ms", type=float, default=50.0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sync-debug", action="store_true")
    ap.add_argument("--workload", help="a workload of bench/workload_shapes.py (e.g. gpt2-small)")
    a = ap.parse_args()
    cyc = int(a.sleep_ms * sleep_cycles_per_ms())
    first_step_ms(a, True, 0, False)  # compiles and caches the kernels: later builds load them
    for tensor_hypers in (True, False):
        alone = first_step_ms(a, tensor_hypers, 0, False)
        behind = first_step_ms(a, tensor_hypers, cyc, False)
        kind = "CUDA-tensor hyperparameters" if tensor_hypers else "Python-number hyperparameters"
        verdict = "WAITS" if behind > alone + 0.5 * a.sleep_ms else "does not wait"
        what = a.workload or f"{a.tensors} x {a.numel}"
        print(f"{what}, {kind}: first step {alone:.1f} ms alone, {behind:.1f} ms behind "
              f"{a.sleep_ms:g} ms of GPU work: {verdict}")
        if a.profile and verdict == "WAITS":
            first_step_ms(a, tensor_hypers, cyc, True)
        if a.sync_debug:
            sync_debug_step(a, tensor_hypers)


def sync_debug_step(a, tensor_hypers):
    try:
        first_step_ms(a, tensor_hypers, 0, False, sync_debug=True)
        print("sync debug: no torch call in the first step synchronised with the GPU")
    except RuntimeError:
        print("sync debug: a torch call in the first step synchronised with the GPU:")
        traceback.print_exc(file=sys.stdout)


if __name__ == "__main__":
    main()
