"""fuse(fn): a function written like torch's functional single-tensor optimizers
(torch.optim.adam._single_tensor_adam(params, grads, exp_avgs, ..., state_steps, *, lr, ...)) turned
into one with the same signature that updates every list in one fused launch per (device, dtype).

Roles, by position among the arguments that are lists of tensors: the first is the parameters, the
second the gradients; each later list is a state of the parameter's shape (entries may be None: the
function creates them, as _single_tensor_sgd does its momentum buffers on the first step), a list of
step counts (0-dim tensors, or a name containing "step"), or empty (a state the options do not use,
max_exp_avg_sqs without amsgrad). Numeric scalar arguments (floats, ints, one-element tensors) are
hyperparameters: new values are pushed to the engine, never a recompile. Everything else (booleans,
None, strings, which lists are empty or hold None) is structure: one trace per structure.

One element's worth of the function is traced (_trace.py's recorder, on lists of length 1), the rule
runs on the engine of the class form. The step counts are the engine's (set from the step tensors
when the table is built); the fused function adds to the step tensors what the function adds.
"""
import collections
import functools
import inspect
import math

import torch

from .. import _core
from ._base import OptfuseError, _is_dense, _with_unscale
from ._engine import Engine, dtype_code
from ._trace import _MATH, SymFloat, TraceError, _Paths, _Recorder, _symbolic_math, explore_paths

PROBE_ELEMENTS = 8
PROBE_STEP = 3.0       # the step count of the probe's step tensor before the call
# the other side of a branch on a hyperparameter that fails on the probe (indexes a list the caller
# left empty: rmsprop's momentum buffers when momentum == 0) is unreachable for this structure
_INFEASIBLE = (IndexError, TypeError, AttributeError)
_REFUSED_TRUE = ("differentiable", "has_sparse_grad", "has_complex")


def _tensor_list(v):
    return isinstance(v, list) and all(x is None or torch.is_tensor(x) for x in v)


def _hyper(v):
    if isinstance(v, bool):
        return False
    return isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1)


class FusedFunction:
    """What fuse(fn) returns: call it as fn. `traces` and `compiles` count traced rules and engines built."""

    def __init__(self, fn):
        self.fn = fn
        self.sig = inspect.signature(fn)
        functools.update_wrapper(self, fn)
        self._rules = {}    # structure -> (rule, layout)
        self._engines = {}  # (structure, device, dtype) -> [engine, table signature]
        self.traces = 0
        self.compiles = 0

    @property
    def _name(self):
        return f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', self.fn)}"

    def _refuse(self, why):
        return OptfuseError(f"optfuse.torch.fuse: {self._name} cannot be fused: {why}")

    def __call__(self, *args, **kwargs):
        try:
            bound = self.sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self._name}: {e}") from None
        bound.apply_defaults()
        a = bound.arguments
        lists = [(k, v) for k, v in a.items() if _tensor_list(v)]
        if len(lists) < 2:
            raise self._refuse("it takes fewer than two lists of tensors (parameters and gradients first)")
        (pname, params), (gname, grads) = lists[0], lists[1]
        n = len(params)
        hypers, struct = {}, []
        for k, v in a.items():
            if _tensor_list(v):
                continue
            if k in ("grad_scale", "found_inf"):
                if v is not None:
                    raise self._refuse(f"'{k}' is not None: the function form takes no grad_scale/found_inf "
                                       "(torch's single-tensor functions refuse them too); unscale the gradients first")
                continue
            if k in _REFUSED_TRUE and v is True:
                raise self._refuse(f"{k}=True is not supported (optfuse steps real, dense, non-differentiable tensors)")
            if _hyper(v):
                hypers[k] = v
                struct.append((k, "tensor" if torch.is_tensor(v) else "number"))
            elif v is None or isinstance(v, (bool, str)):
                struct.append((k, repr(v)))
            else:
                raise self._refuse(f"argument '{k}' of type {type(v).__name__} is neither a number, a flag nor a list "
                                   "of tensors")
        roles = []
        for k, v in lists[2:]:
            if len(v) == 0:
                roles.append((k, "empty"))
                continue
            if len(v) != n:
                raise self._refuse(f"list '{k}' has {len(v)} entries, '{pname}' has {n}")
            t0 = next((x for x in v if x is not None), None)
            if "step" in k or (t0 is not None and t0.dim() == 0 and params[0].dim() != 0):
                if any(x is None or x.numel() != 1 for x in v):
                    raise self._refuse(f"'{k}' (step counts) must hold one-element tensors")
                roles.append((k, "step"))
            else:
                roles.append((k, "state"))
        if len(grads) != n:
            raise self._refuse(f"'{gname}' has {len(grads)} entries, '{pname}' has {n}")
        state_lists = [(k, a[k]) for k, r in roles if r == "state"]
        step_list = next((a[k] for k, r in roles if r == "step"), None)
        # partition the entries: device, dtype, which states are still None
        parts = collections.OrderedDict()
        for i, (p, g) in enumerate(zip(params, grads)):
            self._check(i, p, g, state_lists)
            nones = tuple(lst[i] is None for _, lst in state_lists)
            parts.setdefault((nones, p.device, p.dtype), []).append(i)
        base = (tuple(roles), tuple(struct))
        hyper_values = {k: v for k, v in hypers.items()}
        for (nones, device, dtype), idx in parts.items():
            nones_by_name = dict(zip((k for k, _ in state_lists), nones))
            layout = None
            if any(nones):
                # which None states the function creates may depend on values (momentum != 0): asked on
                # every call that has None states (the first steps), part of the structure
                layout = self._guarded(lambda: self._layout(bound, pname, gname, roles, hypers, nones_by_name,
                                                            step_list))
            skey = base + (nones, tuple(layout["states"]) if layout else None)
            entry = self._rules.get(skey)
            if entry is None:
                entry = self._guarded(lambda: self._trace(bound, pname, gname, roles, hypers, nones_by_name,
                                                          step_list, layout))
                self._rules[skey] = entry
            rule, layout = entry
            if layout.get("guarded"):
                self._check_feasible(skey, bound, pname, gname, roles, hypers, nones_by_name, step_list)
            self._run(skey, rule, layout, device, idx, params, grads, state_lists, step_list, hyper_values)
        return None

    def _check(self, i, p, g, state_lists):
        if g is None:
            raise self._refuse(f"gradient {i} is None")
        if dtype_code(p) is None or torch.is_complex(p):
            raise self._refuse(f"parameter {i} is {p.dtype}; optfuse steps float32, float64, float16 and bfloat16 tensors")
        if g.is_sparse:
            raise self._refuse(f"gradient {i} is sparse")
        for t, what in [(p, "parameter"), (g, "gradient")] + [(lst[i], f"'{k}'") for k, lst in state_lists]:
            if t is None:
                continue
            if t.shape != p.shape or t.device != p.device or dtype_code(t) is None:
                raise self._refuse(f"{what} {i} has shape {tuple(t.shape)} / {t.dtype} on {t.device}; the parameter "
                                   f"{tuple(p.shape)} / {p.dtype} on {p.device}")
            if not _is_dense(t) or not (t.stride() == p.stride() or (t.is_contiguous() and p.is_contiguous())):
                raise self._refuse(f"{what} {i} is not dense with the parameter's strides")

    # --- tracing

    def _layout(self, bound, pname, gname, roles, hypers, nones, step_list):
        """A plain run on probes: which states the function leaves as tensors, what it adds to the step."""
        call = dict(bound.arguments)
        p = torch.randn(PROBE_ELEMENTS)
        call[pname], call[gname] = [p], [torch.randn(PROBE_ELEMENTS)]
        probes = {}
        for k, r in roles:
            if r == "state":
                probes[k] = [None] if nones[k] else [torch.rand(PROBE_ELEMENTS) + 0.5]
            elif r == "step":
                probes[k] = [torch.tensor(PROBE_STEP, dtype=step_list[0].dtype)]
            else:
                probes[k] = []
            call[k] = probes[k]
        for k, v in hypers.items():
            call[k] = torch.tensor(float(v), dtype=v.dtype).reshape(v.shape) if torch.is_tensor(v) else v
        self.fn(*inspect.BoundArguments(self.sig, call).args, **inspect.BoundArguments(self.sig, call).kwargs)
        states = []
        for k, r in roles:
            if r != "state":
                continue
            t = probes[k][0]
            if t is None:
                continue
            if not torch.is_tensor(t) or t.shape != p.shape:
                raise TraceError(f"'{k}' holds a {type(t).__name__} after the call, not a tensor of the parameter's shape")
            states.append(k)
        delta = 0.0
        for k, r in roles:
            if r == "step":
                delta = float(probes[k][0]) - PROBE_STEP
                if delta not in (0.0, 1.0):
                    raise TraceError(f"the function changes the step counts in '{k}' by {delta:g}, not by 0 or 1")
        return {"states": states, "step_delta": delta}

    def _check_feasible(self, skey, bound, pname, gname, roles, hypers, nones, step_list):
        """The traced rule left out a branch side that failed on the probe (e.g. rmsprop's momentum > 0
        side with an empty momentum list): with new hyperparameter values, the function itself runs on
        probes first, so that where torch's function would raise, this one raises too (instead of
        silently stepping the side it traced)."""
        values = tuple(float(v) for v in hypers.values())
        checked = self.__dict__.setdefault("_feasible", {})
        if checked.get(skey) == values:
            return
        try:
            self._layout(bound, pname, gname, roles, hypers, nones, step_list)
        except _INFEASIBLE as e:
            raise self._refuse(f"with these arguments it raises {type(e).__name__}: {e} (on probe tensors; the "
                               "traced rule covers only the values it was traced with)") from e
        checked[skey] = values

    def _guarded(self, fn):
        try:
            return fn()
        except TraceError as e:
            raise self._refuse(str(e)) from None
        except OptfuseError:
            raise
        except Exception as e:  # noqa: BLE001  (the function itself failed on the probe)
            raise self._refuse(f"tracing it raised {type(e).__name__}: {e}") from e

    def _trace(self, bound, pname, gname, roles, hypers, nones, step_list, layout=None):
        if layout is None:
            layout = self._layout(bound, pname, gname, roles, hypers, nones, step_list)
        rule = _core.Rule(f"traced_{getattr(self.fn, '__name__', 'fn')}")
        for k, v in hypers.items():
            rule.hyper(k, float(v))
        for k in layout["states"]:
            rule.state(k, 0.0)

        skipped = []

        def update(b):
            param, states = explore_paths(lambda forced: self._trace_once(b, forced, bound, pname, gname, roles,
                                                                          hypers, nones, step_list),
                                           infeasible=_INFEASIBLE, skipped=skipped)
            for k in layout["states"]:
                b.set_state(k, states.get(k, b.state(k)))
            b.set_param_base(param)
            return b.constant(0.0)

        rule.update(update)
        # build the IR now: trace errors surface here, named, not inside the engine
        _core.Optimizer(_with_unscale([rule]), "reference", 1)
        self.traces += 1
        # A branch side skipped as unreachable holds only for these values: later calls with other
        # hyperparameter values re-run the function on probes first (see __call__).
        layout = dict(layout, guarded=bool(skipped))
        return rule, layout

    def _trace_once(self, b, forced, bound, pname, gname, roles, hypers, nones, step_list):
        paths = _Paths(forced)
        rec = _Recorder(b, paths)
        call = dict(bound.arguments)
        p, g = torch.randn(PROBE_ELEMENTS), torch.randn(PROBE_ELEMENTS)
        rec.bind(p, b.param(), "element")
        rec.bind(g, b.update(), "element")
        call[pname], call[gname] = [p], [g]
        probes = {}
        for k, r in roles:
            if r == "state":
                if nones[k]:
                    probes[k] = [None]
                else:
                    t = torch.rand(PROBE_ELEMENTS) + 0.5
                    rec.bind(t, b.state(k), "element")
                    probes[k] = [t]
            elif r == "step":
                t = torch.tensor(PROBE_STEP, dtype=step_list[0].dtype)
                rec.bind(t, b.step() - 1.0, "uniform")
                probes[k] = [t]
            else:
                probes[k] = []
            call[k] = probes[k]
        for k, v in hypers.items():
            if torch.is_tensor(v):
                t = torch.tensor(float(v), dtype=v.dtype).reshape(v.shape)
                rec.bind(t, b.hyper(k), "uniform")
                call[k] = t
            else:
                call[k] = SymFloat(float(v), b.hyper(k), paths)
        ba = inspect.BoundArguments(self.sig, call)
        saved = {m: getattr(math, m) for m in _MATH}
        try:
            for m, exprfn in _MATH.items():
                setattr(math, m, _symbolic_math(saved[m], exprfn))
            with rec:
                self.fn(*ba.args, **ba.kwargs)
        finally:
            for m, f in saved.items():
                setattr(math, m, f)

        def expr_of(t, what):
            hit = rec.expr.get(rec.key(t)) if torch.is_tensor(t) else None
            if hit is None:
                raise TraceError(f"{what} after the call is a tensor the trace did not produce")
            return hit[0]

        states = {k: expr_of(probes[k][0], f"'{k}'") for k, r in roles if r == "state" and probes[k][0] is not None}
        return expr_of(call[pname][0], "the parameter"), states, paths.seen

    # --- running

    def _run(self, skey, rule, layout, device, idx, params, grads, state_lists, step_list, hypers):
        ekey = (skey, device, params[idx[0]].dtype)
        slot = self._engines.get(ekey)
        if slot is None:
            slot = [Engine(_with_unscale([rule]), device), None]
            self._engines[ekey] = slot
            self.compiles += 1
        engine = slot[0]
        used = [(k, lst) for k, lst in state_lists if k in layout["states"]]
        for k, lst in used:  # states the function would create now (None entries): zeros, in the caller's list
            for i in idx:
                if lst[i] is None:
                    lst[i] = torch.zeros_like(params[i], memory_format=torch.preserve_format)
        # The table is reused only for the very tensors it was built from: pointers and layouts (a
        # 100-element view of a 4096-element buffer has the buffer's pointer, not its size)
        ptrs = tuple(tuple(_layout_key(t) for t in (params[i], grads[i], *(lst[i] for _, lst in used))) for i in idx)
        steps = tuple(int(step_list[i]) for i in idx) if step_list is not None else None
        if slot[1] is None or slot[1][0] != ptrs or (steps is not None and slot[1][1] != steps):
            entries = [(params[i], grads[i], [lst[i] for _, lst in used], 0, steps[j] if steps else 0, j,
                        (False, False), (j + 1, 0)) for j, i in enumerate(idx)]
            engine.build(entries, lambda tg: hypers)
        else:
            engine.push_hypers(0, hypers)
        engine.step(None, None)
        if step_list is not None and layout["step_delta"]:
            torch._foreach_add_([step_list[i] for i in idx], layout["step_delta"])
            steps = tuple(s + int(layout["step_delta"]) for s in steps)
        slot[1] = (ptrs, steps)


def _layout_key(t):
    """What a table entry depends on in tensor t: its memory, shape, strides and dtype."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def fuse_function(fn):
    return FusedFunction(fn)
