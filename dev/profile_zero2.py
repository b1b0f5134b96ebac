"""cProfile of ZeRO stage 2 at world size 1 on many small CUDA tensors (host time per step)."""
import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29561")
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
import optfuse.torch as oft  # noqa: E402
from optfuse.torch.distributed import ZeRO  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
ps = [torch.nn.Parameter(torch.randn(4096, device=dev)) for _ in range(2000)]
grads = [torch.randn(4096, device=dev) for _ in ps]


def run(opt, n):
    ts = []
    for _ in range(n):
        for p, g in zip(ps, grads):
            p.grad = g
        torch.cuda.synchronize() if dev == "cuda" else None
        t = time.perf_counter()
        opt.step()
        torch.cuda.synchronize() if dev == "cuda" else None
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


for stage in (None, 1, 2):
    opt = oft.AdamW(ps, lr=1e-3) if stage is None else ZeRO(oft.AdamW(ps, lr=1e-3), stage=stage)
    run(opt, 5)
    print("stage", stage, f"{run(opt, 20):.3f} ms")
    if stage == 2:
        cProfile.run("run(opt, 10)", "/tmp/zp.out")
        pstats.Stats("/tmp/zp.out").sort_stats("tottime").print_stats(12)
dist.destroy_process_group()
