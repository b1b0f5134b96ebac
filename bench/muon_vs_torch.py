"""Muon step time: torch.optim.Muon against optfuse.torch.Muon, in the same run, on the hidden matrices
of the named workloads (bench/workload_shapes.py: the 2-D shapes without the token / position
embeddings and the LM head, which a Muon recipe gives to AdamW).

Per workload and optimizer: float32 parameters, a new gradient tensor for every parameter every
step (alternating between two preallocated sets: the loop users write), time of opt.step() (CUDA
events on a GPU, perf_counter on the CPU), median of --steps steps after --warmup. Also reported:

* the matrix phase alone (optfuse's batched Newton-Schulz over every bucket: the core's, cuBLAS or
  OpenBLAS) and, per bucket, its achieved TFLOP/s against torch.bmm/baddbmm on the same batch and
  torch's per-matrix function and its fraction of --peak-tflops (H200 dense bf16 tensor
  core rate: 989 TFLOP/s by NVIDIA's datasheet). FLOPs per matrix with k = min(m, n), l = max(m, n)
  (the iteration runs on the k x l orientation): per Newton-Schulz step X X^T is 2 k^2 l, G G is
  2 k^3, U X is 2 k^2 l, so ns_steps * (4 k^2 l + 2 k^3); the normalisation and the element-wise
  terms of addmm (O(k l + k^2)) are not counted;
* the element-wise passes (momentum pass, apply pass) timed alone, and on a GPU as a fraction of
  their memory floor: bytes each moves (momentum: read grad and buffer, write buffer and scratch,
  16 B/element float32; apply: read parameter and scratch, write parameter, 12 B/element) over the
  device-to-device copy bandwidth measured in the same run (as bench/training_loop.py does).

  python3 bench/muon_vs_torch.py [--device cuda] [--workloads gpt2-small,llama-1b] [--steps 20]
      [--warmup 5] [--json out.json]
  python3 bench/muon_vs_torch.py --device cpu --small      # shapes / 8, a quick check anywhere
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload_shapes  # noqa: E402

import optfuse.torch as oft  # noqa: E402
from optfuse.torch._muon import newton_schulz_batched  # noqa: E402

NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)


def hidden_shapes(name, small=False):
    """The workload's hidden matrices: 2-D shapes, without embeddings and the LM head."""
    shapes = workload_shapes.WORKLOADS[name]()
    if name == "gpt2-small":
        shapes = shapes[2:]  # wte (50257, 768), wpe (1024, 768)
    out = [s for s in shapes if len(s) == 2 and max(s) < 32000]
    if small:
        out = [(max(1, m // 8), max(1, n // 8)) for m, n in out]
    return out


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e3  # us
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6


def median_time(timer, fn, steps, warmup, before=None):
    times = []
    for i in range(warmup + steps):
        if before is not None:
            before(i)
        t = timer(fn)
        if i >= warmup:
            times.append(t)
    return statistics.median(times)


def ns_flops(shape, steps):
    k, length = min(shape), max(shape)
    return steps * (4 * k * k * length + 2 * k ** 3)


def copy_bandwidth(elements, device, runs=10):
    """Bytes read + written per second by a device-to-device copy of 16 bytes/element."""
    src = torch.ones(16 * elements, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timer = Timer(device)
    t = median_time(timer, lambda: dst.copy_(src), runs, 2)
    return 2 * src.numel() / (t * 1e-6)


def bench_workload(name, args, device):
    shapes = hidden_shapes(name, args.small)
    elements = sum(m * n for m, n in shapes)
    torch.manual_seed(0)
    init = [torch.randn(s, device=device) * 0.02 for s in shapes]
    params = {k: [torch.nn.Parameter(t.clone()) for t in init] for k in ("torch", "optfuse")}
    grad_sets = [[torch.randn(s, device=device) for s in shapes] for _ in range(2)]
    timer = Timer(device)
    res = {"workload": name, "tensors": len(shapes), "elements": elements, "small": args.small,
           "distinct_shapes": sorted({tuple(s) for s in shapes})}

    def give_grads(ps):
        def before(i):
            for p, g in zip(ps, grad_sets[i % 2]):
                p.grad = None  # zero_grad(set_to_none=True), then a new tensor
                p.grad = g.clone()
        return before

    opts = {"torch": torch.optim.Muon(params["torch"], lr=0.02, weight_decay=0.01),
            "optfuse": oft.Muon(params["optfuse"], lr=0.02, weight_decay=0.01)}
    for k, opt in opts.items():
        try:
            res[f"{k}_step_us"] = median_time(timer, opt.step, args.steps, args.warmup, give_grads(params[k]))
        except Exception:  # noqa: BLE001
            res[f"{k}_error"] = traceback.format_exc()
    if "torch_step_us" in res and "optfuse_step_us" in res:
        res["speedup"] = res["torch_step_us"] / res["optfuse_step_us"]
    # The core's own Muon chain (optfuse.MatrixChainOptimizer("muon(...)"): part 1, the matrix
    # phase, part 2, as C++ callers run it), on the same start and gradients; set_tensors with each
    # step's new gradient tensors runs before the timed step.
    try:
        import optfuse
        chain_params = [t.clone() for t in init]
        chain_bufs = [torch.zeros_like(t) for t in init]
        chain = optfuse.MatrixChainOptimizer("muon(lr=0.02, weight_decay=0.01)", device.type)
        stream = (lambda: torch.cuda.current_stream().cuda_stream) if device.type == "cuda" else (lambda: None)

        def chain_grads(i):
            chain.set_tensors([(p, g.clone(), [b]) for p, g, b in zip(chain_params, grad_sets[i % 2], chain_bufs)])

        res["core_chain_step_us"] = median_time(timer, lambda: chain.step(stream()), args.steps, args.warmup, chain_grads)
        res["core_chain_max_abs_param_diff_to_torch"] = max((a - b).abs().max().item()
                                                             for a, b in zip(chain_params, params["torch"]))
    except Exception:  # noqa: BLE001
        res["core_chain_error"] = traceback.format_exc()
    # after the same number of steps from the same start and gradients, how far apart the two are
    res["max_abs_param_diff"] = max((a - b).abs().max().item() for a, b in zip(params["torch"], params["optfuse"]))

    # the phases of optfuse's step, timed alone
    ours = opts["optfuse"]
    try:
        res["momentum_pass_us"] = median_time(timer, lambda: [e.step(None, None) for e in ours._engines_in.values()],
                                              args.steps, args.warmup)
        res["matrix_phase_us"] = median_time(timer, lambda: [b.orthogonalise() for b in ours._buckets],
                                             args.steps, args.warmup)
        res["apply_pass_us"] = median_time(timer, lambda: [e.step(None, None) for e in ours._engines_out.values()],
                                           args.steps, args.warmup)
        if device.type == "cuda":
            bw = copy_bandwidth(elements, device)
            res["copy_bandwidth_GBps"] = bw / 1e9
            res["momentum_pass_floor_fraction"] = (16 * elements / bw * 1e6) / res["momentum_pass_us"]
            res["apply_pass_floor_fraction"] = (12 * elements / bw * 1e6) / res["apply_pass_us"]
        buckets = []
        for b in ours._buckets:
            shape = tuple(b.scratch.shape[1:])
            count = b.scratch.shape[0]
            t = median_time(timer, b.orthogonalise, args.steps, args.warmup)
            flops = count * ns_flops(shape, NS[1])
            # torch's per-matrix Newton-Schulz on the same matrices (what torch.optim.Muon runs)
            from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns
            mats = list(b.scratch)
            t_torch = median_time(timer, lambda: [torch_ns(m, *NS) for m in mats], args.steps, args.warmup)
            # the same batch through torch.bmm / baddbmm (the matrix phase before the core had one)
            t_bmm = median_time(timer, lambda: b.scratch.copy_(newton_schulz_batched(b.scratch, *NS)),
                                args.steps, args.warmup)
            buckets.append({"shape": shape, "matrices": count, "flops": flops, "optfuse_us": t,
                            "engine": "core" if b.core is not None else "torch",
                            "optfuse_tflops": flops / (t * 1e-6) / 1e12, "torch_per_matrix_us": t_torch,
                            "torch_per_matrix_tflops": flops / (t_torch * 1e-6) / 1e12,
                            "torch_batched_us": t_bmm, "torch_batched_tflops": flops / (t_bmm * 1e-6) / 1e12})
        buckets.sort(key=lambda x: -x["flops"])
        for bk in buckets:
            bk["optfuse_fraction_of_peak"] = bk["optfuse_tflops"] / args.peak_tflops
            bk["torch_fraction_of_peak"] = bk["torch_per_matrix_tflops"] / args.peak_tflops
        res["buckets"] = buckets
        total = sum(bk["flops"] for bk in buckets)
        res["matrix_phase_tflops"] = total / (res["matrix_phase_us"] * 1e-6) / 1e12
    except Exception:  # noqa: BLE001
        res["phases_error"] = traceback.format_exc()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workloads", default="gpt2-small,llama-1b")
    ap.add_argument("--small", action="store_true", help="every matrix dimension / 8 (a quick check, e.g. on a CPU)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense bf16 tensor-core rate for the fraction of peak (H200: 989)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "threads": torch.get_num_threads(), "peak_tflops": args.peak_tflops,
           "results": []}
    for name in args.workloads.split(","):
        r = bench_workload(name, args, device)
        out["results"].append(r)
        line = (f"{name}{' (small)' if args.small else ''}: {r['tensors']} matrices, "
                f"torch.optim.Muon {r.get('torch_step_us', float('nan')):.0f} us, "
                f"optfuse {r.get('optfuse_step_us', float('nan')):.0f} us, speedup {r.get('speedup', float('nan')):.2f}x; "
                f"passes {r.get('momentum_pass_us', float('nan')):.0f} + {r.get('matrix_phase_us', float('nan')):.0f} "
                f"+ {r.get('apply_pass_us', float('nan')):.0f} us; max|dp| {r['max_abs_param_diff']:.3g}")
        print(line)
        if "core_chain_step_us" in r:
            print(f"  the core's muon chain (MatrixChainOptimizer): {r['core_chain_step_us']:.0f} us per step, "
                  f"max|dp| to torch {r['core_chain_max_abs_param_diff_to_torch']:.3g}")
        for bk in r.get("buckets", []):
            print(f"  NS {bk['matrices']} x {bk['shape']}: optfuse ({bk['engine']}) {bk['optfuse_tflops']:.2f} TFLOP/s "
                  f"({100 * bk['optfuse_fraction_of_peak']:.1f}% of {args.peak_tflops:g}), torch batched bmm "
                  f"{bk['torch_batched_tflops']:.2f}, torch per matrix {bk['torch_per_matrix_tflops']:.2f} TFLOP/s")
        for k in ("torch_error", "optfuse_error", "phases_error", "core_chain_error"):
            if k in r:
                print(r[k])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
