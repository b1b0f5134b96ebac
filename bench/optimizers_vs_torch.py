"""Step time of optfuse.torch optimizers against the best existing implementation of each, in the
same run on one GPU (or, with --device cpu, on the CPU), as a fraction of the memory-bandwidth floor.

Per optimizer and workload (bench/workload_shapes.py): float32 parameters, a new gradient tensor for
every parameter every step (zero_grad(set_to_none=True) then fresh tensors, alternating between two
preallocated sets: the loop users write), GPU time of opt.step() by CUDA events, median of --steps
steps after --warmup. Floor = bytes per element of optfuse's plan (its `explain`: every pass over
memory counted) x elements / copy bandwidth (torch's device-to-device copy over 2 x 14 bytes/element,
bytes read + written per second, as bench/training_loop.py; on the CPU torch's copy of as many bytes,
and step times by time.perf_counter). The competitor's fraction uses the same
floor, so both columns compare against the least traffic optfuse found for the math.

Competitors: torch.optim's own foreach and fused implementations where they exist; for Lamb,
timm.optim.Lamb (foreach) when timm is installed, else `ForeachLamb` below (timm's multi-tensor
LAMB written with torch._foreach ops: a global-norm pass, the Adam moments, per-tensor norms, the
update -- what timm's foreach path runs). Every section catches and reports its own exception.

  python3 bench/optimizers_vs_torch.py [--optimizers Lamb,Lars,Adam,...] [--workloads llama-1b]
      [--scale 1] [--steps 20] [--warmup 5] [--device cuda|cpu] [--json out.json]
"""
import argparse
import json
import os
import re
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload_shapes  # noqa: E402
from training_loop import copy_bandwidth, events  # noqa: E402  (one definition of the floor's bandwidth)

import optfuse  # noqa: E402
import optfuse.torch as oft  # noqa: E402

# optfuse class -> (its SPEC, for the plan's bytes per element; constructor arguments)
OPTIMIZERS = {
    "Lamb": ("lamb()", dict(lr=1e-3, weight_decay=0.01)),
    "Lars": ("lars(weight_decay=1e-4, momentum=0.9)", dict(lr=0.1, weight_decay=1e-4, momentum=0.9)),
    "AdamW": ("adamw()", dict(lr=1e-3, weight_decay=0.01)),
    "Adam": ("adam()", dict(lr=1e-3)),
    "SGD": ("sgd(momentum=0.9)", dict(lr=1e-2, momentum=0.9)),
    "Adagrad": ("adagrad()", dict(lr=1e-2)),
    "RMSprop": ("rmsprop()", dict(lr=1e-2)),
    "RAdam": ("radam()", dict(lr=1e-3)),
    "Adamax": ("adamax()", dict(lr=1e-3)),
    "Adadelta": ("adadelta()", dict(lr=1.0)),
    "ASGD": ("asgd()", dict(lr=1e-2)),
    "Rprop": ("rprop()", dict(lr=1e-2)),
    "NAdam": ("nadam()", dict(lr=1e-3)),
    "AdEMAMix": ("ademamix()", dict(lr=1e-3)),
    "Adafactor": ("adafactor()", dict(lr=1e-2)),
}


class ForeachLamb(torch.optim.Optimizer):
    """timm's multi-tensor LAMB (defaults: max_grad_norm 1, bias correction, grad averaging, adapt
    where weight_decay != 0), with torch._foreach ops. Our own code, for the benchmark only."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = max_grad_norm
        self.steps = 0

    @torch.no_grad()
    def step(self):
        ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in ps]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        clip = (norm / self.max_grad_norm).clamp_(min=1.0)
        grads = torch._foreach_div(grads, clip)
        self.steps += 1
        g = self.param_groups[0]
        b1, b2 = g["betas"]
        for p in ps:
            if not self.state[p]:
                self.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        m = [self.state[p]["exp_avg"] for p in ps]
        v = [self.state[p]["exp_avg_sq"] for p in ps]
        torch._foreach_lerp_(m, grads, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
        bc1, bc2 = 1 - b1 ** self.steps, 1 - b2 ** self.steps
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bc2 ** 0.5)
        torch._foreach_add_(denom, g["eps"])
        upd = torch._foreach_div(m, bc1)
        torch._foreach_div_(upd, denom)
        torch._foreach_add_(upd, ps, alpha=g["weight_decay"])
        w_norm = torch._foreach_norm(ps)
        u_norm = torch._foreach_norm(upd)
        ratio = [torch.where(w > 0, torch.where(u > 0, w / u, 1.0), 1.0) for w, u in zip(w_norm, u_norm)]
        torch._foreach_mul_(upd, ratio)
        torch._foreach_add_(ps, upd, alpha=-g["lr"])


def competitors(name):
    """(label, factory(params, kwargs)) of the best existing implementations of this optimizer."""
    if name in ("Lamb", "Lars"):
        out = [("foreach LAMB (timm's math)", lambda ps, kw: ForeachLamb(ps, **kw))] if name == "Lamb" else []
        try:
            import inspect

            import timm
            import timm.optim
            cls = getattr(timm.optim, name)
            foreach = "foreach" in inspect.signature(cls).parameters  # older timm: one for-loop implementation
            label = f"timm {timm.__version__} {name}" + (" (foreach)" if foreach else "")
            out.append((label, lambda ps, kw, c=cls, f=foreach: c(ps, **kw, **({"foreach": True} if f else {}))))
        except Exception:  # timm (or torchvision) not installed
            pass
        return out
    cls = getattr(torch.optim, name, None)
    if cls is None:
        return []
    out = [("torch foreach", lambda ps, kw, c=cls: c(ps, foreach=True, **kw))]
    if name == "Adafactor":  # torch's default for Adafactor is its for-loop
        out.append(("torch for-loop (default)", lambda ps, kw, c=cls: c(ps, foreach=False, **kw)))
    if name in ("Adam", "AdamW", "SGD", "Adagrad"):
        out.append(("torch fused", lambda ps, kw, c=cls: c(ps, fused=True, **kw)))
    return out


def plan_bytes(spec):
    m = re.search(r"total bytes per element: (\d+)", optfuse.explain(spec))
    return int(m.group(1))


def time_steps(make, shapes, steps, warmup, dtype=torch.float32, device="cuda"):
    """Median time (ms) of make(params).step() in the loop users write (parameters and gradients of
    `dtype`): GPU time by CUDA events, or on the CPU wall time; shared by
    bench/mixed_precision_vs_torch.py."""
    torch.manual_seed(0)
    params = [torch.randn(s, device=device).to(dtype) for s in shapes]
    pool = [[(torch.randn(s, device=device) * 1e-2).to(dtype) for s in shapes] for _ in range(2)]
    opt = make(params)
    times = []
    for i in range(warmup + steps):
        opt.zero_grad(set_to_none=True)
        for p, g in zip(params, pool[i % 2]):
            p.grad = g.view_as(g)  # a new tensor object over the same memory
        if device == "cpu":
            t0 = time.perf_counter()
            opt.step()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = events()
        a.record()
        opt.step()
        b.record()
        if i >= warmup:
            times.append((a, b))
    if device == "cpu":
        return statistics.median(times)
    torch.cuda.synchronize()
    out = statistics.median(x.elapsed_time(y) for x, y in times)
    del opt, params, pool
    torch.cuda.empty_cache()
    return out


def cpu_copy_bandwidth(elements, runs=5):
    """Bytes read + written per second by torch's CPU copy over the step's footprint (as copy_bandwidth)."""
    src = torch.ones(14 * elements, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if i >= 1:
            times.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizers", default="Lamb,Lars")
    ap.add_argument("--workloads", default="llama-1b")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json")
    a = ap.parse_args()
    results = []
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"device: {device_name}  torch {torch.__version__}")
    for wl in a.workloads.split(","):
        shapes = workload_shapes.shapes(wl, a.scale)
        n = sum(torch.Size(s).numel() for s in shapes)
        bw = copy_bandwidth(n) if a.device == "cuda" else cpu_copy_bandwidth(n)
        print(f"\n{wl}: {len(shapes)} tensors, {n / 1e6:.1f} M elements, copy bandwidth {bw / 1e9:.0f} GB/s")
        print(f"  {'optimizer':<10} {'B/elem':>6} {'floor ms':>8}  {'implementation':<28} {'ms/step':>8} {'% floor':>8}")
        for name in a.optimizers.split(","):
            if name not in OPTIMIZERS or not hasattr(oft, name):
                print(f"  {name:<10} (no optfuse class here: skipped)")
                continue
            spec, kw = OPTIMIZERS[name]
            try:
                bpe = plan_bytes(spec)
            except Exception as e:  # noqa: BLE001
                print(f"  {name:<10} explain failed: {e}")
                continue
            floor_ms = bpe * n / bw * 1e3
            rows = [("optfuse", lambda ps, kw, c=getattr(oft, name): c(ps, **kw))] + competitors(name)
            for label, factory in rows:
                try:
                    ms = time_steps(lambda ps: factory(ps, dict(kw)), shapes, a.steps, a.warmup, device=a.device)
                    pct = 100 * floor_ms / ms
                    print(f"  {name:<10} {bpe:>6} {floor_ms:>8.3f}  {label:<28} {ms:>8.3f} {pct:>7.1f}%")
                    results.append(dict(workload=wl, optimizer=name, implementation=label, bytes_per_element=bpe,
                                        floor_ms=floor_ms, ms=ms, pct_floor=pct, elements=n, copy_gbps=bw / 1e9))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name:<10} {label}: FAILED {type(e).__name__}: {e}")
                    traceback.print_exc(limit=2)
                    results.append(dict(workload=wl, optimizer=name, implementation=label, error=str(e)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=device_name, torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
