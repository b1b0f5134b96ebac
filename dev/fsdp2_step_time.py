"""Step time of optfuse.torch.AdamW on a model sharded with FSDP2 (fully_shard, world size 1, NCCL on
CUDA / gloo on CPU) against the same optimizer on the same model unsharded, in one process.

    python3 dev/fsdp2_step_time.py [--layers 48] [--width 1024] [--steps 30] [--clip] [--profile] [--torch]

Each step: forward and backward of a small batch (untimed), then step() timed with the device
synchronised before and after (so host time counts). Prints the median of each, and their ratio;
"host" is the time until step() returned; on CUDA, "GPU" the step's device time alone (CUDA events
around it behind ~1 ms of queued work, so that launches and host work hide)."""
import argparse
import copy
import cProfile
import os
import statistics
import time

import torch
import torch.distributed as dist

from profile_top import print_top


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--clip", action="store_true", help="a clip_by_global_norm + adamw chain (reduces over the mesh)")
    ap.add_argument("--profile", action="store_true", help="cProfile 10 more steps of each, top functions by own time")
    ap.add_argument("--torch", action="store_true",
                    help="torch.optim.AdamW (fused on CUDA, foreach on CPU; --clip: after clip_grad_norm_) instead "
                         "of optfuse: what FSDP2 costs torch's own step")
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
        if a.torch:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if cuda else {"foreach": True}))
            if a.clip:
                step = opt.step

                def clipped_step():
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    step()
                opt.step = clipped_step
            return opt
        return oft.Fused(chain, model.parameters()) if a.clip else oft.AdamW(model.parameters(), lr=1e-4)

    x = torch.randn(8, a.width, device=device)
    results, hosts, gpus = {}, {}, {}
    for name, model in (("unsharded", plain), ("FSDP2", sharded)):
        opt = make(model)
        times, host = [], []
        for s in range(a.warmup + a.steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            sync()
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            sync()
            if s >= a.warmup:
                times.append(time.perf_counter() - t0)
                host.append(t1 - t0)
        results[name] = statistics.median(times) * 1e3
        hosts[name] = statistics.median(host) * 1e3
        if cuda:  # GPU time alone: CUDA events around step() behind ~1 ms of queued work, so host time hides
            gpu = []
            for _ in range(a.steps):
                opt.zero_grad()
                model(x).square().mean().backward()
                sync()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(2_000_000)
                start.record()
                opt.step()
                end.record()
                sync()
                gpu.append(start.elapsed_time(end))
            gpus[name] = statistics.median(gpu)
        if a.profile:
            prof = cProfile.Profile()
            for _ in range(10):
                opt.zero_grad()
                model(x).square().mean().backward()
                sync()
                prof.enable()
                opt.step()
                prof.disable()
                sync()
            print_top(prof, 10, 8, name)
    n = sum(p.numel() for p in plain.parameters())
    print(f"{device.type}, torch {torch.__version__}, {a.layers} x Linear({a.width}, {a.width}): {n:,} parameters, "
          f"{'torch ' if a.torch else ''}{'clip + adamw' if a.clip else 'AdamW'}, median of {a.steps} steps")
    for name, ms in results.items():
        gpu = f", GPU {gpus[name]:.3f} ms" if name in gpus else ""
        print(f"  {name:10s} step {ms:8.3f} ms  (host {hosts[name]:.3f} ms{gpu})")
    print(f"  FSDP2 / unsharded: {results['FSDP2'] / results['unsharded']:.3f}"
          + (f"; GPU time {gpus['FSDP2'] / gpus['unsharded']:.3f}" if gpus else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
