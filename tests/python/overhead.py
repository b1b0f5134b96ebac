"""Host time of one optfuse.torch step over many small tensors (not a pytest file: run it).

    python3 tests/python/overhead.py [--tensors 2000] [--device cpu|cuda] [--profile]

Prints the median time per step of: the whole step when the gradients are the same tensors as last
step ("nothing changed"), its parts (the gradient check over all parameters, the core call), a step
after every parameter was given a new gradient tensor, and its parts; a step after zero_grad() and
a real backward (gradients made by autograd; --profile: their cProfile); torch's own AdamW for
comparison. On CUDA the times are host times (no synchronisation inside)."""
import argparse
import cProfile
import os
import statistics
import sys
import time

import torch

import optfuse.torch as oft

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "dev"))
from profile_top import print_top  # noqa: E402


def median_us(fn, reps=200, trials=7):
    fn()
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of the steps after backward")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ps = [torch.nn.Parameter(torch.randn(a.numel, device=dev)) for _ in range(a.tensors)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = oft.AdamW(ps, lr=1e-3)
    opt.step()
    sync()
    eng = next(iter(opt._engines.values()))
    print(f"{a.tensors} tensors of {a.numel} elements on {dev}; backend: {eng.core.backend_status()}")
    rows = [
        ("step, nothing changed", opt.step),
        ("  of which: .grad identity check (C++)", opt._watch.check),
        ("  of which: hyperparameter check + check", opt._fresh),
        ("  of which: core step call", lambda: eng.step(None, None)),
    ]
    for name, fn in rows:
        print(f"{name:45s} {median_us(fn):9.1f} us")
        sync()
    # new gradient tensors every step, as zero_grad(set_to_none=True) + backward give
    fresh = [[torch.randn_like(p) for p in ps] for _ in range(2)]
    k = [0]

    def swap():
        k[0] ^= 1
        for p, g in zip(ps, fresh[k[0]]):
            p.grad = g

    t_swap = median_us(swap, reps=20)
    t_both = median_us(lambda: (swap(), opt.step()), reps=20)
    print(f"{'step after new .grad tensors (set_to_none)':45s} {t_both - t_swap:9.1f} us")
    sync()
    # its parts, each timed alone right after new gradients arrived (median of 200)
    watch = opt._watch
    parts = {"check": [], "take": [], "core": []}
    for _ in range(200):
        swap()
        t0 = time.perf_counter()
        r = watch.check()
        t1 = time.perf_counter()
        if r == 1:
            eng.core._take_grads(watch)
        t2 = time.perf_counter()
        eng.step(None, None)
        t3 = time.perf_counter()
        for part, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[part].append(dt * 1e6)
    sync()
    for part, name in (("check", ".grad check, new tensors (C++)"), ("take", "pointer patch (_take_grads)"),
                    ("core", "core step call")):
        print(f"{'  of which: ' + name:45s} {statistics.median(parts[part]):9.1f} us")
    # the loop users write: backward makes the gradient tensors (they have no Python object until
    # .grad is read), zero_grad(set_to_none=True) drops them
    loss_of = lambda: torch.stack(ps).square().sum()  # noqa: E731
    steps = []
    for k in range(60):
        opt.zero_grad()
        loss_of().backward()
        sync()
        t0 = time.perf_counter()
        opt.step()
        steps.append((time.perf_counter() - t0) * 1e6)
    print(f"{'step after backward (zero_grad, backward)':45s} {statistics.median(steps[10:]):9.1f} us")
    if a.profile:
        prof = cProfile.Profile()
        for k in range(50):
            opt.zero_grad()
            loss_of().backward()
            sync()
            prof.runcall(opt.step)
        print_top(prof, 50, 12, "the steps after backward")
    for kind in ("fused", "foreach"):
        try:
            t = torch.optim.AdamW(ps, lr=1e-3, **{kind: True})
            t.step()
            sync()
            print(f"{'torch.optim.AdamW(' + kind + '=True).step':45s} {median_us(t.step, reps=5, trials=3):9.1f} us")
        except Exception as e:  # pragma: no cover
            print(f"torch {kind}: {e}")


if __name__ == "__main__":
    main()
