"""optfuse.torch.AdamW vs torch.optim.AdamW(fused=True) in the loop users write, on one GPU, in one run.

A training step is `loss.backward(); opt.step(); opt.zero_grad()`: when step() is called the GPU is
still busy with backward, and every step hands the optimizer NEW gradient tensors (zero_grad sets
them to None, backward allocates fresh ones). A good step() only enqueues work: it must never wait
for the GPU, and its host cost must stay small next to the GPU time it queues. So this measures, per
workload (bench/workload_shapes.py) and optimizer, in that loop:

  host us/step      time.perf_counter_ns around opt.step() alone, median of --steps steps after
                    --warmup; each step first does opt.zero_grad(set_to_none=True) and gives every
                    parameter a new gradient tensor (a fresh tensor object, alternating between two
                    preallocated gradient sets so the data pointers change too and nothing is
                    allocated in the timed region); GPU work (torch.cuda._sleep) is queued ahead of
                    the step, as backward would be, so the GPU never idles waiting for the host.
  behind 50ms sleep host time of step() with ~50 ms of GPU work queued ahead (torch.cuda._sleep):
                    far below 50 ms for a step that never waits; "WAITS" marks one above half.
  GPU ms/step       CUDA events around step() in that same loop (median); % floor = floor / it.
  graph ms          step() captured once in a CUDA graph (torch's recipe: warm-up on a side stream,
                    then torch.cuda.graph) with CUDA-tensor hyperparameters and capturable=True;
                    median of CUDA-event-timed replays; % floor as above. Before capture, the
                    never-waits check runs on this optimizer too (CUDA-tensor hyperparameters must
                    not make step() read them back to the host): JSON, and a warning if it waits.
  --compile         a torch.compile'd train step (forward sum((p*p).sum()), backward, step,
                    zero_grad) with a tensor lr set by group['lr'].fill_() on a cosine schedule for
                    --compile-steps steps: compile time (first call), median step time (CUDA events
                    and host), recompiles after the first call (dynamo's unique graph count) and
                    graph breaks. Slow to compile: optional.

Floor = 28 bytes/element (fp32 AdamW: read p, g, m, v; write p, m, v) x elements / copy bandwidth;
the copy bandwidth is torch's device-to-device dst.copy_(src) (cudaMemcpyAsync) over two buffers of
14 bytes/element each (the step's footprint, as `optfuse bench` does), bytes read + written per
second, median of 10 copies. Hyperparameters everywhere: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
weight decay 1e-2. Every optimizer section catches and reports its own exception.

  python3 bench/training_loop.py [--workloads gpt2-small,llama-1b,many-small,one-big] [--scale 1]
      [--steps 50] [--warmup 10] [--compile] [--json out.json]
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload_shapes  # noqa: E402

HYPERS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
OPTIMIZERS = ["torch fused", "optfuse"]


def cuda_scalar(v):
    return torch.tensor(v, device="cuda")


def make_eager(name, params):
    if name == "torch fused":
        return torch.optim.AdamW(params, fused=True, **HYPERS)
    import optfuse.torch
    return optfuse.torch.AdamW(params, **HYPERS)


def make_capturable(name, params):
    """CUDA-tensor hyperparameters, read by the kernels at every step: capturable, schedulable."""
    if name == "torch fused":
        return torch.optim.AdamW(params, lr=cuda_scalar(HYPERS["lr"]), betas=HYPERS["betas"], eps=HYPERS["eps"],
                                 weight_decay=HYPERS["weight_decay"], fused=True, capturable=True)
    import optfuse.torch
    b1, b2 = HYPERS["betas"]
    return optfuse.torch.AdamW(params, lr=cuda_scalar(HYPERS["lr"]), betas=(cuda_scalar(b1), cuda_scalar(b2)),
                               eps=cuda_scalar(HYPERS["eps"]), weight_decay=cuda_scalar(HYPERS["weight_decay"]),
                               capturable=True)


def events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def sleep_cycles_per_ms():
    torch.cuda._sleep(1000)
    a, b = events()
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    b.synchronize()
    return 20_000_000 / a.elapsed_time(b)


def copy_bandwidth(elements, runs=10):
    """Bytes read + written per second by torch's device-to-device copy over the step's footprint."""
    n = 14 * elements
    src = torch.ones(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(runs + 2):  # two warm-up copies
        a, b = events()
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b))
    return 2 * n / (statistics.median(times) * 1e-3)


class Workload:
    """Parameters and two sets of gradients (the 'backward' of alternate steps), allocated once."""

    def __init__(self, shapes, seed=0):
        torch.manual_seed(seed)
        self.shapes = shapes
        self.pool = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(2)]
        self.params = None

    def fresh_params(self):
        self.params = None
        torch.cuda.empty_cache()
        self.params = [torch.randn(s, device="cuda").requires_grad_() for s in self.shapes]
        return self.params

    def backward(self, k):
        """What backward leaves behind: a new gradient tensor object on every parameter."""
        for p, g in zip(self.params, self.pool[k % 2]):
            p.grad = g.detach()


def loop(opt, wl, steps, warmup, ahead_ms, cpm):
    """The user's loop. Returns (host us per step, GPU ms per step) lists of the timed steps."""
    host, gpu = [], []
    for k in range(warmup + steps):
        opt.zero_grad(set_to_none=True)
        wl.backward(k)
        torch.cuda.synchronize()
        if ahead_ms:
            torch.cuda._sleep(int(ahead_ms * cpm))  # backward still running on the GPU
        a, b = events()
        a.record()
        t0 = time.perf_counter_ns()
        opt.step()
        t1 = time.perf_counter_ns()
        b.record()
        b.synchronize()
        if k >= warmup:
            host.append((t1 - t0) / 1e3)
            gpu.append(a.elapsed_time(b))
    return host, gpu


def run_eager(name, wl, args, cpm, row):
    params = wl.fresh_params()
    opt = make_eager(name, params)
    # Warm-up without GPU work ahead gives the host time, which sizes the sleep queued ahead of each
    # timed step (twice the median warm-up step + 0.5 ms) so the events time the GPU work alone.
    host, _ = loop(opt, wl, max(args.warmup, 3), 2, 0, cpm)
    ahead = 2e-3 * statistics.median(host) + 0.5
    host, gpu = loop(opt, wl, args.steps, 0, ahead, cpm)
    row.update(host_us=statistics.median(host), host_us_min=min(host), gpu_ms=statistics.median(gpu),
               gpu_ms_min=min(gpu), ahead_ms=ahead)
    try:
        behind = behind_sleep(opt, wl, args, cpm)
        row.update(behind_sleep_us=statistics.median(behind), behind_sleep_us_max=max(behind),
                   waits=max(behind) > 0.5e3 * args.sleep_ms)
    except Exception as e:  # noqa: BLE001
        report(row, "sleep", name, e)
    del opt


def behind_sleep(opt, wl, args, cpm):
    """Never waits: host us of step() with ~--sleep-ms of GPU work queued ahead of it."""
    behind = []
    for k in range(args.sleep_steps):
        opt.zero_grad(set_to_none=True)
        wl.backward(k)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(args.sleep_ms * cpm))
        t0 = time.perf_counter_ns()
        opt.step()
        t1 = time.perf_counter_ns()
        torch.cuda.synchronize()
        behind.append((t1 - t0) / 1e3)
    return behind


def run_graph(name, wl, args, cpm, row):
    params = wl.fresh_params()
    opt = make_capturable(name, params)
    try:  # the same never-waits check, eager, with CUDA-tensor hyperparameters (JSON; warns)
        behind = behind_sleep(opt, wl, args, cpm)
        # This optimizer's first step builds its tables: host work that may well exceed half the
        # sleep without waiting, so it is reported, not judged (dev/first_step_wait.py and
        # test_building_and_destroying_an_optimizer_never_wait_for_the_gpu judge it alone vs behind).
        first, later = behind[0], behind[1:] or behind
        row.update(tensor_hypers_behind_sleep_us=statistics.median(later),
                   tensor_hypers_first_step_behind_sleep_us=first,
                   tensor_hypers_waits=max(later) > 0.5e3 * args.sleep_ms)
        if row["tensor_hypers_waits"]:
            print(f"  ! {name} with CUDA-tensor hyperparameters WAITS for the GPU: step() took "
                  f"{max(later) / 1e3:.1f} ms behind {args.sleep_ms:g} ms of GPU work", file=sys.stderr)
    except Exception as e:  # noqa: BLE001
        report(row, "sleep (tensor hypers)", name, e)
    wl.backward(0)  # a graph replays fixed addresses: the gradients must stay put
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    before = params[0].detach().flatten()[:64].clone()
    graph.replay()
    torch.cuda.synchronize()
    row["graph_updates_params"] = bool((params[0].detach().flatten()[:64] != before).any())
    times = []
    for k in range(args.warmup + args.steps):
        torch.cuda._sleep(int(0.5 * cpm))  # the GPU stays busy while replay() is issued
        a, b = events()
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        if k >= args.warmup:
            times.append(a.elapsed_time(b))
    row.update(graph_ms=statistics.median(times), graph_ms_min=min(times))
    del graph, opt


def run_compile(name, wl, args, row):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    params = wl.fresh_params()
    opt = make_capturable(name, params)

    def train_step():
        loss = sum((p * p).sum() for p in params)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step = torch.compile(train_step)
    n = args.compile_steps

    def set_lr(k):
        for g in opt.param_groups:
            g["lr"].fill_(0.5 * HYPERS["lr"] * (1 + math.cos(math.pi * k / n)))

    set_lr(0)
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    row["compile_s"] = time.perf_counter() - t0
    graphs0 = counters["stats"]["unique_graphs"]
    host, gpu = [], []
    for k in range(1, n):
        set_lr(k)
        a, b = events()
        a.record()
        t0 = time.perf_counter_ns()
        step()
        t1 = time.perf_counter_ns()
        b.record()
        b.synchronize()
        if k > min(10, n // 2):  # the first steps are not timed (their recompiles are counted)
            host.append((t1 - t0) / 1e6)
            gpu.append(a.elapsed_time(b))
    row.update(compile_step_ms=statistics.median(gpu), compile_host_ms=statistics.median(host),
               compile_graphs_first_call=graphs0,
               recompiles=counters["stats"]["unique_graphs"] - graphs0,
               graph_breaks=sum(counters["graph_break"].values()))
    del step, opt
    torch._dynamo.reset()


def report(row, section, name, e):
    msg = f"{type(e).__name__}: {e}".strip()
    row.setdefault("errors", {})[section] = msg
    print(f"  ! {name} {section}: {msg}", file=sys.stderr)
    traceback.print_exc(limit=-4, file=sys.stderr)
    try:  # a sticky CUDA error fails here; the figures that follow will report it too
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def fmt(v, spec, width):
    return f"{v:{width}{spec}}" if isinstance(v, (int, float)) else f"{'-':>{width}}"


def table(rows, sleep_ms=50.0):
    head = (f"{'workload':<11} {'optimizer':<12} {'host us/step':>12} {f'host us behind {sleep_ms:g}ms sleep':>25} "
            f"{'GPU ms/step':>11} {'% floor':>7} {'graph ms':>9} {'graph % floor':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        fl = r["floor_ms"]
        pct = lambda k: 100 * fl / r[k] if r.get(k) else None  # noqa: E731
        behind = fmt(r.get("behind_sleep_us"), ".1f", 19) + (" WAITS" if r.get("waits") else "      ")
        lines.append(f"{r['workload']:<11} {r['optimizer']:<12} {fmt(r.get('host_us'), '.1f', 12)} {behind:>25} "
                     f"{fmt(r.get('gpu_ms'), '.3f', 11)} {fmt(pct('gpu_ms'), '.1f', 7)} "
                     f"{fmt(r.get('graph_ms'), '.3f', 9)} {fmt(pct('graph_ms'), '.1f', 13)}"
                     + ("  (errors: " + ", ".join(r["errors"]) + ")" if r.get("errors") else ""))
    if any("compile_s" in r or "compile" in r.get("errors", {}) for r in rows):
        head = (f"{'workload':<11} {'optimizer':<12} {'compile s':>9} {'step ms (GPU)':>13} {'step ms (host)':>14} "
                f"{'recompiles':>10} {'graph breaks':>12}")
        lines += ["", "torch.compile'd train step (forward + backward + step + zero_grad)", head, "-" * len(head)]
        for r in rows:
            if "compile_s" in r or "compile" in r.get("errors", {}):
                lines.append(f"{r['workload']:<11} {r['optimizer']:<12} {fmt(r.get('compile_s'), '.1f', 9)} "
                             f"{fmt(r.get('compile_step_ms'), '.3f', 13)} {fmt(r.get('compile_host_ms'), '.3f', 14)} "
                             f"{fmt(r.get('recompiles'), 'd', 10)} {fmt(r.get('graph_breaks'), 'd', 12)}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="gpt2-small,llama-1b,many-small,one-big",
                    help=f"comma-separated, from: {', '.join(workload_shapes.WORKLOADS)}")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every tensor's element count")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, from: {', '.join(OPTIMIZERS)}")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per loop (medians)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sleep-ms", type=float, default=50.0, help="GPU work queued ahead in the never-waits check")
    ap.add_argument("--sleep-steps", type=int, default=5)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA graph rows")
    ap.add_argument("--compile", action="store_true", help="also time a torch.compile'd train step (slow)")
    ap.add_argument("--compile-steps", type=int, default=100)
    ap.add_argument("--compile-max-tensors", type=int, default=1000,
                    help="skip --compile on workloads with more tensors (2000 tensors: many minutes)")
    ap.add_argument("--json", help="write every figure here (rewritten after each workload)")
    args = ap.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    bad = [w for w in workloads if w not in workload_shapes.WORKLOADS] + [o for o in optimizers if o not in OPTIMIZERS]
    if bad:
        ap.error(f"unknown workload(s)/optimizer(s): {', '.join(bad)}")
    if args.steps < 1 or args.warmup < 0 or args.scale <= 0 or args.sleep_steps < 1 or args.compile_steps < 4:
        ap.error("--steps, --sleep-steps >= 1, --warmup >= 0, --scale > 0, --compile-steps >= 4")
    if not torch.cuda.is_available():
        sys.exit("bench/training_loop.py measures the CUDA training loop and needs a CUDA device; "
                 f"torch {torch.__version__} sees none (torch.cuda.is_available() is False).")

    cpm = sleep_cycles_per_ms()
    try:
        import optfuse
        of_version = optfuse.__version__
    except Exception as e:  # noqa: BLE001  (the optfuse rows will report it)
        of_version = f"unavailable ({e})"
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "optfuse": of_version,
            "sleep_cycles_per_ms": cpm, "args": vars(args)}
    print(f"device: {info['device']}  torch {info['torch']}  optfuse {of_version}  "
          f"(_sleep: {cpm / 1e3:.0f} kcycles/ms)", flush=True)
    results = {**info, "rows": []}
    for wname in workloads:
        shapes = workload_shapes.shapes(wname, args.scale)
        try:
            elements = sum(math.prod(s) for s in shapes)
            bw = copy_bandwidth(elements)
            torch.cuda.empty_cache()
            wl = Workload(shapes)
        except Exception as e:  # noqa: BLE001
            print(f"{wname}: setup failed: {type(e).__name__}: {e}", file=sys.stderr)
            torch.cuda.empty_cache()
            continue
        floor_ms = 28 * elements / bw * 1e3
        print(f"\n{wname} (scale {args.scale:g}): {len(shapes)} tensors, {elements:,} elements; copy (torch "
              f"dst.copy_(src)) {bw / 1e9:.0f} GB/s; floor {floor_ms:.3f} ms/step", flush=True)
        rows = []
        for name in optimizers:
            row = {"workload": wname, "optimizer": name, "tensors": len(shapes), "elements": elements,
                   "copy_GBps": bw / 1e9, "floor_ms": floor_ms}
            rows.append(row)
            sections = [("eager", lambda: run_eager(name, wl, args, cpm, row))]
            if not args.no_graph:
                sections.append(("graph", lambda: run_graph(name, wl, args, cpm, row)))
            if args.compile and len(shapes) <= args.compile_max_tensors:
                sections.append(("compile", lambda: run_compile(name, wl, args, row)))
            for section, fn in sections:
                print(f"  {name}: {section} ...", file=sys.stderr, flush=True)
                try:
                    fn()
                except Exception as e:  # noqa: BLE001
                    report(row, section, name, e)
                wl.params = None
                torch.cuda.empty_cache()
        del wl
        torch.cuda.empty_cache()
        results["rows"] += rows
        print(table(rows, args.sleep_ms), flush=True)
        if args.json:  # a run cut short still leaves every finished workload
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)
    print("\n" + table(results["rows"], args.sleep_ms))


if __name__ == "__main__":
    main()
