"""Bus bandwidth of all_gather_into_tensor and reduce_scatter_tensor, as nccl-tests reports it, for
the two-GPU checks (issue 14: ZeRO's collectives as a fraction of what the machine's collectives
reach). Spawns N ranks on one host: NCCL with one GPU each (--device cuda), or gloo on the CPU.

    python3 dev/collective_busbw.py --ranks 2 --device cuda [--sizes-mb 1,16,256,1024] [--iters 20]

Per size S (bytes of the whole gathered / reduced buffer, float32): algbw = S / time, busbw =
algbw x (N-1)/N (nccl-tests' factor for both collectives); the median of --iters timed calls after
5 warm-up calls, each call synchronised (CUDA: torch.cuda.synchronize; the slowest rank's time)."""
import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, init_file, device_type, sizes_mb, iters):
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=300))
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    rows = []
    for mb in sizes_mb:
        n = max(world, int(mb * 2 ** 20) // 4 // world * world)  # elements of the whole buffer
        full = torch.ones(n, device=device)
        part = torch.ones(n // world, device=device)
        for name, call in (("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(full, part)),
                           ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(part, full))):
            times = []
            for i in range(5 + iters):
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                call()
                sync()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i >= 5:
                    times.append(float(dt))
            t = statistics.median(times)
            algbw = n * 4 / t / 1e9
            rows.append((name, n * 4, t * 1e6, algbw, algbw * (world - 1) / world))
    if rank == 0:
        with open(os.path.join(os.path.dirname(init_file), "rows.txt"), "w") as f:
            for r in rows:
                f.write(" ".join(map(str, r)) + "\n")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes-mb", default="1,16,256,1024")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if a.device == "cuda" and torch.cuda.device_count() < a.ranks:
        raise SystemExit(f"--ranks {a.ranks} needs {a.ranks} GPUs, this machine has {torch.cuda.device_count()}")
    sizes = [float(x) for x in a.sizes_mb.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(worker, args=(a.ranks, init_file, a.device, sizes, a.iters), nprocs=a.ranks, join=True)
        with open(os.path.join(tmp, "rows.txt")) as f:
            rows = [line.split() for line in f]
    print(f"{a.ranks} ranks, {a.device}, torch {torch.__version__}; median of {a.iters} calls, slowest rank")
    print(f"{'collective':24s} {'bytes':>14s} {'us':>10s} {'algbw GB/s':>11s} {'busbw GB/s':>11s}")
    for name, size, us, algbw, busbw in rows:
        print(f"{name:24s} {int(size):14,d} {float(us):10.1f} {float(algbw):11.2f} {float(busbw):11.2f}")


if __name__ == "__main__":
    main()
