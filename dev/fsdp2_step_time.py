"""Step time of optfuse.torch.AdamW on a model sharded with FSDP2 (fully_shard, world size 1, NCCL on
CUDA / gloo on CPU) against the same optimizer on the same model unsharded, in one process.

    python3 dev/fsdp2_step_time.py [--layers 48] [--width 1024] [--steps 30] [--clip]

Each step: forward and backward of a small batch (untimed), then step() timed with the device
synchronised before and after (so host time counts). Prints the median of each, and their ratio."""
import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--clip", action="store_true", help="a clip_by_global_norm + adamw chain (reduces over the mesh)")
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import optfuse.torch as oft

    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width) for _ in range(a.layers)]).to(device)
    sharded = copy.deepcopy(plain)
    mesh = init_device_mesh(device.type, (1,))
    for m in sharded:
        fully_shard(m, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    chain = "chain(clip_by_global_norm(max_norm=1.0), adamw(lr=1e-4))"

    def make(model):
        return oft.Fused(chain, model.parameters()) if a.clip else oft.AdamW(model.parameters(), lr=1e-4)

    x = torch.randn(8, a.width, device=device)
    results = {}
    for name, model in (("unsharded", plain), ("FSDP2", sharded)):
        opt = make(model)
        times = []
        for s in range(a.warmup + a.steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if s >= a.warmup:
                times.append(time.perf_counter() - t0)
        results[name] = statistics.median(times) * 1e3
    n = sum(p.numel() for p in plain.parameters())
    print(f"{device.type}, torch {torch.__version__}, {a.layers} x Linear({a.width}, {a.width}): {n:,} parameters, "
          f"{'clip + adamw' if a.clip else 'AdamW'}, median of {a.steps} steps")
    for name, ms in results.items():
        print(f"  {name:10s} step {ms:8.3f} ms")
    print(f"  FSDP2 / unsharded: {results['FSDP2'] / results['unsharded']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
