"""optfuse vs torch AdamW on one GPU, side by side in one run, as fractions of the copy floor.

For each workload: torch AdamW fused=True, fused captured in a CUDA graph, torch.compile (optional,
slow to compile), clip_grad_norm_ + fused AdamW; and `optfuse bench --backend cuda` (eager, no
graph) for adamw and for chain(clip_by_global_norm(1.0), adamw()). Medians of timed steps with CUDA
events after warm-up. The floor = bytes a step must move / measured device-to-device copy bandwidth.

  python3 bench/cuda_vs_torch.py --optfuse build/optfuse [--workloads gpt2-small,llama-1b] [--compile]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import workload_shapes  # noqa: E402


def median_ms(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth():
    n = 512 * 1024 * 1024  # 2 GiB of float32
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 20, 3)
    del src, dst
    return 2 * n * 4 / (ms * 1e-3)  # bytes read + written per second


def make_params(shapes, dtype):
    params = [torch.randn(s, device="cuda", dtype=dtype, requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def torch_rows(shapes, dtype, args):
    rows = {}
    params = make_params(shapes, dtype)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    rows["torch fused"] = median_ms(opt.step, args.steps, args.warmup)

    def clip_step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    rows["torch clip+fused"] = median_ms(clip_step, args.steps, args.warmup)
    del opt

    gopt = torch.optim.AdamW(params, lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            gopt.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gopt.step()
    rows["torch fused graph"] = median_ms(graph.replay, args.steps, args.warmup)
    del graph, gopt

    if args.compile and len(shapes) < 1000 and dtype == torch.float32:  # 2000 parameters: minutes to compile
        copt = torch.optim.AdamW(params, lr=1e-3, foreach=True)

        @torch.compile(fullgraph=False)
        def compiled_step():
            copt.step()
        t0 = time.perf_counter()
        compiled_step()
        torch.cuda.synchronize()
        rows["torch.compile (compile s)"] = time.perf_counter() - t0
        rows["torch.compile"] = median_ms(compiled_step, args.steps, args.warmup)
        del copt
    del params
    torch.cuda.empty_cache()
    return rows


def optfuse_row(binary, workload, chain, dtype, args):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [binary, "bench", "--backend", "cuda", "--workload", workload, "--chain", chain, "--dtype", dtype,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", path]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    with open(path) as fh:
        return json.load(fh)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optfuse", default="build/optfuse")
    ap.add_argument("--workloads", default="one-big,gpt2-small,llama-1b,many-small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (slow to compile)")
    ap.add_argument("--bf16", action="store_true", help="also bf16 params/grads/states on llama-1b")
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()

    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth {bw / 1e9:.0f} GB/s")
    results = {"copy_bandwidth_GBps": bw / 1e9, "rows": []}
    cases = [(w, "float32") for w in args.workloads.split(",")]
    if args.bf16:
        cases.append(("llama-1b", "bfloat16"))
    header = f"{'workload':<12} {'dtype':<9} {'variant':<28} {'ms':>9} {'% floor':>8}"
    lines = [header, "-" * len(header)]
    print(header, flush=True)
    for workload, dtype in cases:
        shapes = workload_shapes.shapes(workload)
        elems = sum(math.prod(s) for s in shapes)
        esize = 4 if dtype == "float32" else 2
        floor = {"adamw": 7 * esize * elems / bw * 1e3, "clip": 8 * esize * elems / bw * 1e3}
        trows = torch_rows(shapes, torch.float32 if dtype == "float32" else torch.bfloat16, args)
        rows = []
        for name, ms in trows.items():
            if name.endswith("(compile s)"):
                rows.append((name, ms, None))
                continue
            rows.append((name, ms, floor["clip" if "clip" in name else "adamw"]))
        for label, chain, key in [("optfuse adamw (eager)", "adamw()", "adamw"),
                                  ("optfuse clip+adamw (eager)", "chain(clip_by_global_norm(1.0), adamw())", "clip")]:
            r = optfuse_row(args.optfuse, workload, chain, dtype, args)
            rows.append((label, r["step_ms_median"], floor[key]))
        lines.append(f"{workload:<12} {dtype:<9} {'floor (adamw / clip+adamw)':<28} {floor['adamw']:9.3f} / {floor['clip']:.3f}")
        for name, ms, fl in rows:
            pct = f"{100 * fl / ms:7.1f}%" if fl else "       "
            unit = f"{ms:9.3f}" if fl else f"{ms:8.1f}s"
            lines.append(f"{workload:<12} {dtype:<9} {name:<28} {unit} {pct}")
            results["rows"].append({"workload": workload, "dtype": dtype, "variant": name, "value": ms,
                                    "floor_ms": fl})
        # Print and save as we go: a run cut short still leaves every finished workload.
        print("\n".join(lines[-len(rows) - 1:]), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
