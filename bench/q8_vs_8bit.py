"""AdamW with 8-bit states on one GPU: optfuse's state_dtype=torch.int8 against FlashOptim's
FlashAdamW, torchao's AdamW8bit and bitsandbytes' AdamW8bit where installed (each skipped with the
reason where not), and optfuse's own bf16 / float32 states, on bfloat16 parameters (issue 34).

Per configuration and workload (bench/workload_shapes.py): a new bfloat16 gradient tensor for every
parameter every step (the loop users write), GPU time of opt.step() by CUDA events, median of --steps
steps after --warmup. Each configuration's own byte floor: its bytes actually held per element, each
read and written once per step (the parameter and every state tensor found in opt.state after the
first step, 0-dim ones left out) plus the gradient read once, divided by the copy bandwidth
(bench/training_loop.py's copy_bandwidth; on the CPU optimizers_vs_torch's cpu_copy_bandwidth). "held B/elem" adds the gradient to what the optimizer
keeps (parameter + states): the memory per parameter the issue counts.

  python3 bench/q8_vs_8bit.py [--workloads gpt2-small,llama-1b,wide] [--steps 20] [--warmup 5] [--json out.json]
  python3 bench/q8_vs_8bit.py --device cpu --workloads gpt2-small --scale 0.25   # wall time, host memory bandwidth
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload_shapes  # noqa: E402
from optimizers_vs_torch import cpu_copy_bandwidth  # noqa: E402
from training_loop import copy_bandwidth  # noqa: E402

import optfuse.torch as oft  # noqa: E402

workload_shapes.WORKLOADS.setdefault("wide", lambda: [(2000, 4096)])  # the 2000 x 4096


def _flash(ps):
    import flashoptim
    return flashoptim.FlashAdamW(ps, lr=1e-4, weight_decay=0.0)


def _torchao(ps):
    from torchao.optim import AdamW8bit
    return AdamW8bit(ps, lr=1e-4, weight_decay=0.0)


def _bnb(ps):
    import bitsandbytes as bnb
    return bnb.optim.AdamW8bit(ps, lr=1e-4, weight_decay=0.0)


CONFIGS = {
    "optfuse AdamW, bf16 states": lambda ps: oft.AdamW(ps, lr=1e-4, weight_decay=0.0),
    "optfuse AdamW, int8 states": lambda ps: oft.AdamW(ps, lr=1e-4, weight_decay=0.0, state_dtype=torch.int8),
    "optfuse AdamW, remainders + int8 states": lambda ps: oft.AdamW(
        ps, lr=1e-4, weight_decay=0.0, master_weights="remainders", state_dtype=torch.int8),
    "optfuse AdamW, remainders + fp32 states": lambda ps: oft.AdamW(
        ps, lr=1e-4, weight_decay=0.0, master_weights="remainders"),
    "flashoptim FlashAdamW (24-bit master, 8-bit states)": _flash,
    "torchao AdamW8bit": _torchao,
    "bitsandbytes AdamW8bit": _bnb,
}


def state_bytes(opt):
    seen, total = set(), 0

    def walk(x):
        nonlocal total
        if torch.is_tensor(x):
            if x.dim() > 0 and x.data_ptr() not in seen:
                seen.add(x.data_ptr())
                total += x.numel() * x.element_size()
            return
        for attr in ("__dict__",):  # tensor subclasses of the 8-bit libraries keep their data in fields
            for v in getattr(x, attr, {}).values():
                if torch.is_tensor(v):
                    walk(v)
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for st in opt.state.values():
        walk(st)
    return total


def run(make, shapes, steps, warmup, device):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device).to(torch.bfloat16)) for s in shapes]
    pool = [[(torch.randn(s, device=device) * 1e-2).to(torch.bfloat16) for s in shapes] for _ in range(2)]
    opt = make(params)
    times = []
    for i in range(warmup + steps):
        opt.zero_grad(set_to_none=True)
        for p, g in zip(params, pool[i % 2]):
            p.grad = g.view_as(g)
        if device == "cpu":
            t0 = time.perf_counter()
            opt.step()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        opt.step()
        b.record()
        if i >= warmup:
            times.append((a, b))
    if device == "cpu":
        ms = statistics.median(times)
    else:
        torch.cuda.synchronize()
        ms = statistics.median(x.elapsed_time(y) for x, y in times)
    sb = state_bytes(opt)
    del opt, params, pool
    if device != "cpu":
        torch.cuda.empty_cache()
    return ms, sb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="gpt2-small,llama-1b,wide")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=float, default=1.0, help="each tensor's element count times this (a 1-D tensor)")
    a = ap.parse_args()
    results = []
    name = torch.cuda.get_device_name() if a.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"device: {name}  torch {torch.__version__}")
    for wl in a.workloads.split(","):
        shapes = workload_shapes.shapes(wl, a.scale)
        n = sum(torch.Size(s).numel() for s in shapes)
        bw = copy_bandwidth(n) if a.device == "cuda" else cpu_copy_bandwidth(n)
        print(f"\n{wl}: {len(shapes)} tensors, {n / 1e6:.1f} M elements, copy bandwidth {bw / 1e9:.0f} GB/s")
        print(f"  {'configuration':<52} {'held B/elem':>11} {'floor ms':>8} {'ms/step':>8} {'% floor':>8}")
        for label, factory in CONFIGS.items():
            try:
                ms, sb = run(factory, shapes, a.steps, a.warmup, a.device)
            except Exception as e:  # noqa: BLE001
                print(f"  {label}: not run: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
                if not isinstance(e, ImportError):
                    traceback.print_exc(limit=2)
                results.append(dict(workload=wl, configuration=label, error=f"{type(e).__name__}: {e}"))
                continue
            moved = 2 * (2 * n + sb) + 2 * n  # parameter and states read and written, gradient read
            floor_ms = moved / bw * 1e3
            held = (2 * n + sb + 2 * n) / n
            pct = 100 * floor_ms / ms
            print(f"  {label:<52} {held:>11.3f} {floor_ms:>8.3f} {ms:>8.3f} {pct:>7.1f}%")
            results.append(dict(workload=wl, configuration=label, held_bytes_per_element=held, floor_ms=floor_ms,
                                ms=ms, pct_floor=pct, elements=n, copy_gbps=bw / 1e9))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
