"""fuse() over the registries of the optimizer packages people use (issue 33's "Must show"):
pytorch-optimizer (get_supported_optimizers / load_optimizer), timm.optim (list_optimizers /
create_optimizer_v2), lion-pytorch and schedulefree (every optimizer class they export).

Each registry entry is built as a user would (lr=1e-2, foreach=False where the class takes it, timm's
through create_optimizer_v2 with weight decay, so biases are a second param group), handed to
optfuse.torch.fuse(), and stepped 20 times in the loop users write (zero_grad, backward of a new batch,
step) next to the original on a twin model, float32, on the CPU. Three scenarios: fuse() on the fresh
optimizer; an lr scheduler attached to the original before fuse(); one attached to the fused optimizer
after fuse(). Outcomes:

  fused    every scenario within TOL of the original, relative to the parameter scale (and the
           original moved the parameters); "drop-in" or "traced" says which path fuse() took
  refused  fuse() raised an OptfuseError naming the class and the construct
  wrong    a fused optimizer differs from the original by more than TOL
  raised   an exception after fuse() returned, or fuse() raised something other than OptfuseError

Entries out of scope are listed with the reason and not counted: the step needs a closure (it evaluates
the loss itself), second-order ones (Hessian-vector products: create_graph=True), ones needing inputs
other than parameters (the model, named parameters, a distributed group, a package not installed), and
ones whose step is matrix math rather than element-wise math and per-tensor reductions (found by
running the original's step once under a TorchFunctionMode that watches for matmul, decompositions and
the like), or whose step draws random numbers (its values follow torch's random stream: no two runs
can be compared step by step).

    PYTHONPATH=... python3 tests/python/fuse_coverage.py [--only NAME_SUBSTRING] [--no-schedulers] [--mid-training]

prints the table and the counts; tests/python/test_fuse_coverage.py runs it under pytest.
"""
import argparse
import copy
import inspect
import sys
import time
import traceback
import warnings

import torch
from torch.overrides import TorchFunctionMode

STEPS = 20
TOL = 1e-6
LR = 1e-2

# Closure-driven: step(closure) is required (it evaluates the loss, several times or between two updates).
# Second-order: the step reads Hessian-vector products of the gradient (backward with create_graph=True).
# Special inputs: built from something other than parameters and hyperparameters.
OUT_OF_SCOPE = {
    "pytorch_optimizer.lbfgs": "closure-driven (torch.optim.LBFGS: step(closure) evaluates the loss repeatedly)",
    "pytorch_optimizer.bsam": "closure-driven (SAM: first_step / second_step around a second forward-backward)",
    "pytorch_optimizer.alig": "needs the loss value at every step (step(closure) or step(loss=...))",
    "pytorch_optimizer.adahessian": "second-order (Hutchinson Hessian diagonal: backward with create_graph=True)",
    "pytorch_optimizer.sophiah": "second-order (Hutchinson Hessian diagonal: backward with create_graph=True)",
    "pytorch_optimizer.dash": "second-order (Hessian-vector products: backward with create_graph=True)",
    "pytorch_optimizer.lomo": "special inputs: takes the model and runs its own backward (fused into autograd hooks)",
    "pytorch_optimizer.adalomo": "special inputs: takes the model and runs its own backward (fused into autograd hooks)",
    "pytorch_optimizer.demo": "special inputs: needs a torch.distributed process group (decoupled momentum exchange)",
    "pytorch_optimizer.distributedmuon": "special inputs: needs a torch.distributed process group",
    "pytorch_optimizer.adammini": "special inputs: takes the model's named parameters and its attention layout",
    "pytorch_optimizer.galore": "special inputs: param groups with a projection rank (low-rank SVD projection)",
    "pytorch_optimizer.fira": "special inputs: param groups with a projection rank (low-rank SVD projection)",
    "pytorch_optimizer.muonclip": "special inputs: takes the model and its attention layers (QK-clip)",
    "timm.optim.adahessian": "second-order (Hutchinson Hessian diagonal: backward with create_graph=True)",
    "schedulefree.AdamWScheduleFreeClosure": "closure-driven (step(closure) required)",
    "schedulefree.SGDScheduleFreeClosure": "closure-driven (step(closure) required)",
    "schedulefree.RAdamScheduleFreeClosure": "closure-driven (step(closure) required)",
    "schedulefree.ScheduleFreeWrapper": "special inputs: wraps another optimizer (a base optimizer instance)",
    "schedulefree.ScheduleFreeWrapperReference": "special inputs: wraps another optimizer (a base optimizer instance)",
}

# torch ops of matrix math: a step that runs one is not element-wise math and per-tensor reductions
# (torch.dot of two flattened tensors is a per-tensor sum of products: in scope)
MATRIX_OPS = ("matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "outer", "ger", "kron", "linalg_svd", "svd",
              "linalg_eigh", "eigh", "linalg_qr", "qr", "linalg_inv", "inverse", "linalg_cholesky", "cholesky",
              "linalg_solve", "lstsq", "linalg_matrix_norm", "matrix_power", "tensordot", "chain_matmul",
              "linalg_eig", "svd_lowrank", "linalg_svdvals", "cholesky_solve", "__matmul__", "__rmatmul__", "mv",
              "addmv", "addr", "fft_rfft", "fft_fft", "rfft", "irfft", "fft_irfft", "fft_rfft2", "fft_irfft2",
              "triangular_solve", "linalg_matrix_exp")
# random draws: the step's values depend on torch's random stream, so no two runs can be compared step by step
RANDOM_OPS = ("multinomial", "randn_like", "rand_like", "randint_like", "bernoulli", "normal", "randn", "rand",
              "randperm", "uniform", "exponential", "random", "cauchy", "geometric", "log_normal")


def make_model(seed=0):
    """conftest's model: a 2-layer MLP with biases (two matrices, two vectors)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 12, generator=g), torch.randn(16, 5, generator=g)


def train(model, opt, steps, start=0, scheduler=None):
    for s in range(start, start + steps):
        opt.zero_grad()
        x, y = _batch(s)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def rel_diff(a, b):
    num = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    den = max(q.detach().abs().max().item() for q in b.parameters())
    return num / den


def _kw(cls, **kw):
    params = inspect.signature(cls).parameters
    if "foreach" in params:
        kw["foreach"] = False
    return kw


# --- the registries: (name, factory(model) -> optimizer, class)

def entries():
    out = []
    try:
        import pytorch_optimizer as P
    except ImportError:
        P = None
    if P is not None:
        for n in P.get_supported_optimizers():
            try:
                cls = P.load_optimizer(n)
            except Exception as e:  # noqa: BLE001
                out.append((f"pytorch_optimizer.{n}", e, None))
                continue
            out.append((f"pytorch_optimizer.{n}", lambda m, c=cls: c(m.parameters(), **_kw(c, lr=LR)), cls))
    try:
        import timm.optim as T
    except ImportError:
        T = None
    if T is not None:
        for n in T.list_optimizers():
            try:
                info = T.get_optimizer_info(n)
            except Exception as e:  # noqa: BLE001
                out.append((f"timm.optim.{n}", e, None))
                continue

            def make(m, n=n):
                try:
                    return T.create_optimizer_v2(m, opt=n, lr=LR, weight_decay=0.05, foreach=False)
                except TypeError:
                    return T.create_optimizer_v2(m, opt=n, lr=LR, weight_decay=0.05)
            out.append((f"timm.optim.{n}", make, info.opt_class))
    try:
        import lion_pytorch
        out.append(("lion_pytorch.Lion", lambda m: lion_pytorch.Lion(m.parameters(), lr=1e-3, weight_decay=0.1),
                    lion_pytorch.Lion))
    except ImportError:
        pass
    try:
        import schedulefree as S
    except ImportError:
        S = None
    if S is not None:
        for n in sorted(dir(S)):
            cls = getattr(S, n)
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
                continue

            def make(m, c=cls):
                opt = c(m.parameters(), **_kw(c, lr=LR))
                if hasattr(opt, "train"):
                    opt.train()  # schedulefree refuses to step outside train mode
                return opt
            out.append((f"schedulefree.{n}", make, cls))
    return out


class _OpWatch(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.matrix, self.random = set(), set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
        if base in MATRIX_OPS:
            self.matrix.add(name)
        if base in RANDOM_OPS:
            self.random.add(name)
        return func(*args, **(kwargs or {}))


def scope_of(name, make):
    """None if in scope, else the reason it is left out (see the module's docstring)."""
    if name in OUT_OF_SCOPE:
        return OUT_OF_SCOPE[name]
    if isinstance(make, Exception):
        return f"special inputs: the registry could not load it ({type(make).__name__}: {make})"
    model = make_model()
    try:
        opt = make(model)
    except Exception as e:  # noqa: BLE001
        return f"special inputs: not constructible from parameters and lr ({type(e).__name__}: {str(e)[:120]})"
    watch = _OpWatch()
    try:
        for s in range(2):
            opt.zero_grad()
            x, y = _batch(s)
            torch.nn.functional.mse_loss(model(x), y).backward()
            with watch:
                opt.step()
    except Exception as e:  # noqa: BLE001
        return f"special inputs: its step() without a closure raised ({type(e).__name__}: {str(e)[:120]})"
    if watch.matrix:
        return f"matrix math, not element-wise math and per-tensor reductions (it runs {', '.join(sorted(watch.matrix))})"
    if watch.random:
        return (f"random draws (it runs {', '.join(sorted(watch.random))}): its values follow torch's random "
                "stream, no run can be compared with another step by step")
    return None


def _scheduler(opt, kind):
    if kind == "before":  # a warm-up and decay: lr changes at every step
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.9 ** s)
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=LR / 20)


def run_one(name, make, schedulers=True, mid_training=False):
    """(outcome, route, detail): outcome in fused / refused / wrong / raised."""
    import optfuse
    import optfuse.torch as oft
    route = None
    worst = 0.0
    scenarios = ("plain",) + (("scheduler-before", "scheduler-after") if schedulers else ())
    for scenario in scenarios + (("mid-training",) if mid_training else ()):
        model = make_model()
        ref_model = copy.deepcopy(model)
        start = copy.deepcopy(model)
        orig = make(model)
        ref = make(ref_model)
        sched = ref_sched = None
        started = 0
        if scenario == "mid-training":  # 5 steps of the original, then fuse() takes its state over
            train(model, orig, 5)
            started = 5
        if scenario == "scheduler-before":
            sched, ref_sched = _scheduler(orig, "before"), _scheduler(ref, "before")
        try:
            fused = oft.fuse(orig)
        except optfuse.OptfuseError as e:
            msg = str(e)
            reason = msg.split("cannot be fused: ", 1)[-1]
            if scenario != "plain":
                return "raised", route, f"{scenario}: fuse() refused what it fused without a scheduler: {reason}"
            return "refused", None, reason
        except Exception as e:  # noqa: BLE001
            return "raised", None, f"{scenario}: fuse() raised {type(e).__name__}: {e}"
        route = "traced" if type(fused).__name__ == "Traced" else "drop-in"
        if scenario == "scheduler-after":
            sched, ref_sched = _scheduler(fused, "after"), _scheduler(ref, "after")
        try:
            train(model, fused, STEPS - started, start=started, scheduler=sched)
            if scenario == "mid-training":  # the original class loads the fused state dict
                make(copy.deepcopy(model)).load_state_dict(fused.state_dict())
        except Exception as e:  # noqa: BLE001
            tb = traceback.extract_tb(e.__traceback__)[-1]
            return "raised", route, f"{scenario}: a fused step raised {type(e).__name__}: {e} ({tb.filename}:{tb.lineno})"
        train(ref_model, ref, STEPS, scheduler=ref_sched)
        d = rel_diff(model, ref_model)
        if not d <= TOL:
            return "wrong", route, f"{scenario}: differs from the original by {d:.3g} after {STEPS} steps"
        if not rel_diff(start, ref_model) > 1e-4:
            return "wrong", route, f"{scenario}: the original did not move the parameters (the comparison is vacuous)"
        worst = max(worst, d)
    return "fused", route, f"max rel diff {worst:.2g}"


def library(name):
    return name.split(".")[0] if not name.startswith("timm.") else "timm.optim"


def run(only=None, schedulers=True, out=sys.stdout, mid_training=False):
    warnings.simplefilter("ignore")
    results, skipped = {}, {}
    t0 = time.time()
    for name, make, cls in entries():
        if only and only not in name:
            continue
        why = scope_of(name, make)
        if why is not None:
            skipped[name] = why
            continue
        results[name] = run_one(name, make, schedulers, mid_training)
        print(f"{name:<42} {results[name][0]:<8} {results[name][1] or '':<8} {results[name][2][:300]}",
              file=out, flush=True)
    print(f"\nleft out ({len(skipped)}):", file=out)
    for n, why in skipped.items():
        print(f"  {n:<42} {why}", file=out)
    print(file=out)
    print(summary(results), file=out)
    print(f"({time.time() - t0:.0f} s)", file=out)
    return results, skipped


def counts(results):
    by = {}
    for n, (o, route, _) in results.items():
        c = by.setdefault(library(n), {"fused": 0, "traced": 0, "refused": 0, "wrong": 0, "raised": 0})
        c[o] += 1
        if o == "fused" and route == "traced":
            c["traced"] += 1
    return by


def summary(results):
    lines = []
    tot = {"fused": 0, "traced": 0, "refused": 0, "wrong": 0, "raised": 0}
    for lib, c in sorted(counts(results).items()):
        n = sum(c[k] for k in ("fused", "refused", "wrong", "raised"))
        lines.append(f"{lib:<18} {n:>3} in scope: fused {c['fused']:>3} ({c['traced']} traced), refused "
                     f"{c['refused']:>3}, wrong {c['wrong']}, raised {c['raised']}")
        for k in tot:
            tot[k] += c[k]
    n = sum(tot[k] for k in ("fused", "refused", "wrong", "raised"))
    lines.append(f"{'all':<18} {n:>3} in scope: fused {tot['fused']:>3} ({tot['traced']} traced), refused "
                 f"{tot['refused']:>3}, wrong {tot['wrong']}, raised {tot['raised']}: "
                 f"{100.0 * tot['fused'] / max(n, 1):.1f}% fused")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--only")
    ap.add_argument("--no-schedulers", action="store_true")
    ap.add_argument("--mid-training", action="store_true",
                    help="a fourth scenario: 5 steps of the original, fuse(), 15 more; the original loads the state dict")
    a = ap.parse_args()
    run(a.only, not a.no_schedulers, mid_training=a.mid_training)
