"""cProfile of ZeRO at world size 1 on many small CUDA tensors (host time per step), against the
unsharded optimizer. --clip: the clip_by_global_norm + adamw chain instead of AdamW.

    python3 dev/profile_zero2.py [--clip] [--tensors 2000] [--numel 4096] [--stages none,1,2] [--no-profile]

--stages picks which to time and in which order (one per process shows whether order matters)."""
import argparse
import cProfile
import os
import time

import torch
import torch.distributed as dist

from profile_top import print_top

ap = argparse.ArgumentParser()
ap.add_argument("--clip", action="store_true")
ap.add_argument("--tensors", type=int, default=2000)
ap.add_argument("--numel", type=int, default=4096)
ap.add_argument("--stages", default="none,1,2", help="comma-separated, in this order (none: the unsharded optimizer)")
ap.add_argument("--no-profile", action="store_true")
a = ap.parse_args()
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29561")
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
import optfuse.torch as oft  # noqa: E402
from optfuse.torch.distributed import ZeRO  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
ps = [torch.nn.Parameter(torch.randn(a.numel, device=dev)) for _ in range(a.tensors)]
grads = [torch.randn(a.numel, device=dev) for _ in ps]


def make():
    if a.clip:
        return oft.Fused("chain(clip_by_global_norm(max_norm=1.0), adamw(lr=1e-3))", ps)
    return oft.AdamW(ps, lr=1e-3)


def run(opt, n):
    """Median ms per step with the device synchronised around it, and median host ms (no sync after)."""
    ts, hs = [], []
    for _ in range(n):
        for p, g in zip(ps, grads):
            p.grad = g
        sync()
        t = time.perf_counter()
        opt.step()
        hs.append(time.perf_counter() - t)
        sync()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3, sorted(hs)[len(hs) // 2] * 1e3


for stage in [None if x == "none" else int(x) for x in a.stages.split(",")]:
    opt = make() if stage is None else ZeRO(make(), stage=stage)
    run(opt, 5)
    total, host = run(opt, 20)
    print(f"stage {stage}: {total:.3f} ms per step, {host:.3f} ms host", flush=True)
    if stage in (None, 2) and not a.no_profile:
        prof = cProfile.Profile()
        prof.runcall(run, opt, 10)
        print_top(prof, 10, 10, f"stage {stage}")
dist.destroy_process_group()
