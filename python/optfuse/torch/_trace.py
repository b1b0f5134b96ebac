"""Tracing a torch optimizer's per-parameter update into an optfuse rule (used by fuse() for classes
without a hand-written drop-in).

How: the optimizer's own step() runs on a probe (one small parameter, a copy of each param group)
under a TorchFunctionMode recorder. Every tensor the step touches is mapped to an optfuse expression
(the parameter, its gradient, its state slots, constants); every torch op maps its inputs'
expressions to the op's expression (in-place ops rebind their target). Hyperparameters become
`SymFloat`s: Python floats that carry an expression, so the scalar arithmetic optimizers do in Python
(1 - beta1 ** step) stays symbolic. The step count is an input too (state["step"] tensor or number).

Two traces per rule: the first step (the optimizer creates its state) and a later step (state read
from the slots); the rule takes the first where step == 1. A Python branch on a symbolic scalar
(if step < warmup, if weight_decay != 0) is traced both ways and becomes a select. What the IR cannot
express (Python control flow on element data, .item() of element data, ops the recorder does not
know, indexing, scalar states other than the step) raises TraceError naming the construct.
fuse() then checks the traced optimizer against the original on probe parameters before using it.

Reductions: a 2-norm or the sum of a square of a whole parameter-shaped tensor is the IR's per-tensor
sum of squares (Recorder.reduction; the rest are refused by name). So that a sum over the group's
parameters in Python is never taken for a per-tensor one, the probe group holds two other parameters
whose values are "foreign": one reaching the probe's update is refused.
"""
import math
import traceback

import torch
from torch.overrides import TorchFunctionMode

from .. import _core


class TraceError(_core.OptfuseError):
    pass


def _where():
    """file:line of the optimizer code being traced (the innermost frame outside this module and torch)."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "optfuse" not in fr.filename and "/torch/" not in fr.filename:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "?"


class _Decision(tuple):
    """(condition, outcome) of one Python branch, and whether it was on another parameter's values
    (`foreign`, with the place `where`): such a branch must not change this parameter's update."""
    foreign, where = False, "?"


class _Paths:
    """Outcomes of symbolic Python conditions: forced ones first, then the real value (recorded).
    With `memo`, a condition met again (the same expression: hash-consed) has the outcome it had, and is
    not a new branch (the loop over a group's probe parameters meets each hyperparameter condition
    once per parameter)."""

    def __init__(self, forced, memo=False):
        self.forced, self.seen = list(forced), []
        self.memo = {} if memo else None

    def decide(self, cond_expr, real, foreign=False, where="?"):
        key = (repr(cond_expr), foreign)
        if self.memo is not None and key in self.memo:
            return self.memo[key]
        i = len(self.seen)
        outcome = self.forced[i] if i < len(self.forced) else bool(real)
        d = _Decision((cond_expr, outcome))
        d.foreign, d.where = foreign, where
        self.seen.append(d)
        if self.memo is not None:
            self.memo[key] = outcome
        return outcome


def _f(x):
    """x's value as a plain float (a SymFloat's without calling its __float__, which refuses)."""
    return float.__float__(x) if isinstance(x, float) else float(x)


class SymFloat(float):
    """A Python float that also carries an optfuse expression (a hyperparameter, the step, or math
    on them). Arithmetic keeps it symbolic; a comparison used as a Python condition is traced both ways."""

    def __new__(cls, value, expr, paths):
        obj = super().__new__(cls, value)
        obj.expr, obj.paths = expr, paths
        return obj

    def _lift(self, other):
        if isinstance(other, _ProbeCount):
            other._refuse()
        if isinstance(other, SymFloat):
            return other.expr
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return _f(other)
        return None

    def _bin(self, other, fn, exprfn, reverse=False):
        o = self._lift(other)
        if o is None:
            return NotImplemented
        a, b = (_f(other), _f(self)) if reverse else (_f(self), _f(other))
        ea, eb = (o, self.expr) if reverse else (self.expr, o)
        return SymFloat(fn(a, b), exprfn(ea, eb), self.paths)

    def __add__(self, o): return self._bin(o, lambda a, b: a + b, lambda a, b: a + b)
    def __radd__(self, o): return self._bin(o, lambda a, b: a + b, lambda a, b: a + b, True)
    def __sub__(self, o): return self._bin(o, lambda a, b: a - b, lambda a, b: a - b)
    def __rsub__(self, o): return self._bin(o, lambda a, b: a - b, lambda a, b: a - b, True)
    def __mul__(self, o): return self._bin(o, lambda a, b: a * b, lambda a, b: a * b)
    def __rmul__(self, o): return self._bin(o, lambda a, b: a * b, lambda a, b: a * b, True)
    def __truediv__(self, o): return self._bin(o, _safe_div, lambda a, b: a / b)
    def __rtruediv__(self, o): return self._bin(o, _safe_div, lambda a, b: a / b, True)
    def __pow__(self, o): return self._bin(o, _safe_pow, lambda a, b: _core.pow(a, b))
    def __rpow__(self, o): return self._bin(o, _safe_pow, lambda a, b: _core.pow(a, b), True)
    def __neg__(self): return SymFloat(-_f(self), -self.expr, self.paths)
    def __pos__(self): return self
    def __abs__(self): return SymFloat(abs(_f(self)), _core.abs(self.expr), self.paths)

    def _cmp(self, o, fn, exprfn):
        e = self._lift(o)
        if e is None:
            return NotImplemented
        return self.paths.decide(exprfn(self.expr, e), fn(_f(self), _f(o)))

    def __lt__(self, o): return self._cmp(o, lambda a, b: a < b, lambda a, b: a < b)
    def __le__(self, o): return self._cmp(o, lambda a, b: a <= b, lambda a, b: a <= b)
    def __gt__(self, o): return self._cmp(o, lambda a, b: a > b, lambda a, b: a > b)
    def __ge__(self, o): return self._cmp(o, lambda a, b: a >= b, lambda a, b: a >= b)
    def __eq__(self, o): return self._cmp(o, lambda a, b: a == b, lambda a, b: a == b)
    def __ne__(self, o): return self._cmp(o, lambda a, b: a != b, lambda a, b: a != b)
    def __bool__(self): return self.paths.decide(self.expr != 0.0, _f(self) != 0.0)
    __hash__ = float.__hash__

    def __int__(self):
        raise TraceError(f"int() of a hyperparameter- or step-dependent value at {_where()}: not traceable")

    def __float__(self):
        # float(x) would return a plain number: the hyperparameter frozen into the trace at its value now
        raise TraceError(f"float() of a hyperparameter- or step-dependent value at {_where()}: its value would be "
                         "frozen into the trace (use the value itself: it is a float)")

    def __mod__(self, o):
        # x % 2 of an integer x (the step's parity: PNM swaps its momenta on even steps) is
        # (1 - (-1)^x) / 2, exact for integers; any other x gives NaN in the kernel where Python gives a
        # fraction, so a use other than a comparison with 0 or 1 shows up as NaN, not as a wrong step.
        # Other moduli need floor, which the IR has not.
        if isinstance(o, (int, float)) and not isinstance(o, (bool, SymFloat)) and o == 2:
            return SymFloat(_f(self) % 2.0, (1.0 - _core.pow(-1.0, self.expr)) * 0.5, self.paths)
        raise TraceError(f"'%' of a hyperparameter- or step-dependent value (by {o!r}) at {_where()}: only x % 2 "
                         "is expressible in the IR (it has no floor)")

    def _no_rounding(self, *_, what):
        raise TraceError(f"{what} of a hyperparameter- or step-dependent value at {_where()}: not expressible in "
                         "the IR (it has no floor/round); its value would be frozen into the trace")

    def __rmod__(self, o): return self._no_rounding(what="'%' by")
    def __floordiv__(self, o): return self._no_rounding(what="'//'")
    def __rfloordiv__(self, o): return self._no_rounding(what="'//' by")
    def __divmod__(self, o): return self._no_rounding(what="divmod()")
    def __rdivmod__(self, o): return self._no_rounding(what="divmod() by")
    def __round__(self, n=None): return self._no_rounding(what="round()")
    def __trunc__(self): return self._no_rounding(what="math.trunc()")
    def __floor__(self): return self._no_rounding(what="math.floor()")
    def __ceil__(self): return self._no_rounding(what="math.ceil()")
    def is_integer(self): return self._no_rounding(what="is_integer()")


def _safe_div(a, b):
    try:
        return a / b
    except ZeroDivisionError:
        return math.copysign(math.inf, a) if a != 0 else math.nan


def _safe_pow(a, b):
    try:
        return a ** b
    except (OverflowError, ZeroDivisionError):
        return math.inf


def _symbolic_math(fn, exprfn):
    """math.sqrt and friends read a float subclass's value directly and return a plain float: during a
    trace they are replaced by versions that keep a SymFloat symbolic (and give NaN, not an error, for
    values outside their domain, which paths explored for the other side of a branch may produce)."""
    def wrapped(x, *rest):
        for v in (x,) + rest:
            if isinstance(v, _ProbeCount):
                v._refuse()
        if isinstance(x, SymFloat) or any(isinstance(r, SymFloat) for r in rest):
            xs = (x,) + rest
            try:
                value = fn(*(_f(v) for v in xs))
            except (ValueError, OverflowError, ZeroDivisionError):
                value = math.nan
            lifted = [v.expr if isinstance(v, SymFloat) else _f(v) for v in xs]
            paths = next(v.paths for v in xs if isinstance(v, SymFloat))
            return SymFloat(value, exprfn(*lifted), paths)
        return fn(x, *rest)
    return wrapped


_MATH = {"sqrt": _core.sqrt, "exp": _core.exp, "pow": _core.pow, "fabs": _core.abs,
         "log": lambda x, base=None: _core.log(x) if base is None else _core.log(x) / _core.log(base)}


def _refusing_math(name, fn):
    """Every other math function returns a plain float, which would freeze a hyperparameter- or
    step-dependent argument into the trace at its value now: refused instead."""
    def wrapped(*xs):
        for v in xs:
            if isinstance(v, _ProbeCount) or isinstance(v, (list, tuple)) and any(isinstance(y, _ProbeCount) for y in v):
                _ProbeCount._refuse(v if isinstance(v, _ProbeCount) else next(y for y in v if isinstance(y, _ProbeCount)))
        if any(isinstance(x, SymFloat) or (isinstance(x, (list, tuple)) and any(isinstance(y, SymFloat) for y in x))
               for x in xs):
            raise TraceError(f"math.{name} of a hyperparameter- or step-dependent value at {_where()}: no optfuse "
                             "equivalent recorded (its value would be frozen into the trace)")
        return fn(*xs)
    return wrapped


def _patched_math():
    """{name: replacement} for the math module while a step is traced."""
    out = {}
    for n in dir(math):
        f = getattr(math, n)
        if n.startswith("_") or not callable(f):
            continue
        out[n] = _symbolic_math(f, _MATH[n]) if n in _MATH else _refusing_math(n, f)
    return out


class _ProbeCount(float):
    """numel() of a probe tensor: the probe's element count, not the real parameter's. Comparisons are
    allowed (a branch on the size, like one on the dimensionality); arithmetic is refused (an RMS,
    norm / sqrt(numel), would freeze the probe's count into the trace: the IR has no element count).
    A float subclass so that 1.0 / n and n ** 0.5 reach its own methods first."""

    def __new__(cls, value, where):
        obj = super().__new__(cls, value)
        obj.where = where
        return obj

    def _refuse(self, *_):
        raise TraceError(f"arithmetic on a tensor's element count (numel() at {self.where}) is not traceable: the "
                         "count is the probe's, it would be frozen into the trace (the IR has no per-tensor "
                         "element count)")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __abs__ = _refuse
    __float__ = __int__ = __round__ = __trunc__ = __divmod__ = __rdivmod__ = _refuse
    __hash__ = float.__hash__


# Ops whose result is a Python value that may carry an expression.
_SCALAR_OUT = ("item", "__bool__", "__float__")
# Ops whose result is a plain Python value read from a tensor's data (it would be frozen): refused on a
# recorded tensor unless that is a constant.
_DATA_OUT = ("__int__", "__index__", "tolist", "numpy", "__complex__", "__array__")

# Reductions of a whole tensor: the 2-norm and the sum of a square are traced (per-tensor sum of squares);
# the others are refused by name (Recorder.reduction).
_REDUCTIONS = ("norm", "linalg_vector_norm", "linalg_norm", "sum", "nansum", "mean", "nanmean", "max", "min",
               "amax", "amin", "prod", "std", "var", "logsumexp", "count_nonzero", "any", "all", "median",
               "nanmedian", "linalg_matrix_norm", "frobenius_norm", "nuclear_norm")


def _same_expr(a, b):
    """Whether two expressions are one node (hash-consed: the same value; == would build a comparison)."""
    return repr(a) == repr(b)


class _Recorder(TorchFunctionMode):
    def __init__(self, b, paths, reductions=False):
        super().__init__()
        self.b, self.paths = b, paths
        # Reductions are traced only where the trace also runs other parameters beside the probe (kind
        # "foreign", see _trace_once): a sum over the group's parameters in Python must not pass for a
        # per-tensor sum. The function form traces lists of one tensor: reductions stay refused there.
        self.reductions = reductions
        self.mixed_at = None  # where a value of another parameter first met this one's
        # Tensors are known by their memory, not their Python object, so aliases (p.data, views of the
        # same elements) share one expression and an in-place op through one is seen through all.
        # kind: "element" (depends on the parameter, its gradient or its state, element by element),
        # "tensor" (one value per tensor: a norm, or math on one), "uniform" (hyperparameters, the step,
        # constants; also a parameter-shaped tensor filled with one such value) or "foreign" (depends on
        # another parameter of the probe group: must not reach this parameter's update)
        self.expr = {}      # (data_ptr, numel) -> (expr, kind)
        self.keep = []      # recorded tensors stay alive: their memory is not reused by others
        self.square_of = {}  # key of a tensor that is y*y (y.square(), y**2, y.pow(2), y*y) -> y's expr
        self.param_numel = None  # the probe parameter's element count (the first element tensor bound)

    @staticmethod
    def key(t):
        return (t.data_ptr(), t.numel())

    def bind(self, t, expr, kind):
        self.expr[self.key(t)] = (expr, kind)
        self.square_of.pop(self.key(t), None)  # rebound (an in-place op): no longer the square it was
        self.keep.append(t)
        if kind == "element" and self.param_numel is None:
            self.param_numel = t.numel()

    def of(self, x, where):
        """(expr, kind) of an argument: a recorded tensor, a SymFloat, a number; else TraceError."""
        if isinstance(x, _ProbeCount):
            x._refuse()
        if isinstance(x, SymFloat):
            return x.expr, "uniform"
        if isinstance(x, bool):
            return self.b.constant(1.0 if x else 0.0), "uniform"
        if isinstance(x, (int, float)):
            return self.b.constant(float(x)), "uniform"
        if torch.is_tensor(x):
            hit = self.expr.get(self.key(x))
            if hit is not None:
                return hit
            if x.numel() == 1 and x.dim() == 0:  # a tensor the step made from a Python number
                return self.b.constant(float(x)), "uniform"
            raise TraceError(f"a tensor of shape {tuple(x.shape)} that is not the parameter, its gradient or "
                             f"its state is used at {where}")
        raise TraceError(f"an argument of type {type(x).__name__} at {where} is not traceable")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in ("__getitem__", "__setitem__", "index_put_", "masked_fill_", "scatter_", "index_copy_"):
            raise TraceError(f"indexing ('{name}') at {_where()} is not traceable: the update must be element-wise")
        if name.startswith("_foreach_"):
            # a multi-tensor op returns a list (or None in place): it would escape the recorder unseen
            raise TraceError(f"torch.{name} at {_where()} (a multi-tensor op) is not traceable; construct the "
                             "optimizer with foreach=False so that its step runs per parameter")
        out = func(*args, **kwargs)
        if isinstance(out, (list, tuple)) and any(torch.is_tensor(o) for o in out):
            raise TraceError(f"torch op '{name}' at {_where()} returns several tensors: not traceable")
        if name in ("numel", "nelement") and args and torch.is_tensor(args[0]) and self.key(args[0]) in self.expr \
                and self.expr[self.key(args[0])][1] != "uniform":
            return _ProbeCount(out, _where())
        if name in _DATA_OUT and args and torch.is_tensor(args[0]):
            hit = self.expr.get(self.key(args[0]))
            if hit is not None and (hit[1] != "uniform" or not repr(hit[0]).endswith(" const>")):
                what = {"element": "per-element data", "uniform": "a hyperparameter- or step-dependent value"}.get(
                    hit[1], "a per-tensor value (a norm, or math on one)")
                shown = f"{name[2:-2]}()" if name.startswith("__") else f".{name}()"
                raise TraceError(f"{shown} of {what} at {_where()}: its value now would be frozen into the trace "
                                 "(data-dependent, or an input that changes)")
        if name in ("__get__", "__set__") or (not torch.is_tensor(out) and name not in _SCALAR_OUT):
            return out  # attribute access (p.grad, p.shape, numel(), ...): nothing to record
        return self.record(name, args, kwargs, out, _where())

    def record(self, name, args, kw, out, where):
        b = self.b
        base = name[2:-2] if name.startswith("__") and name.endswith("__") else name
        inplace = base.endswith("_") and base != "_" or base.startswith("i") and name.startswith("__i")
        if name.startswith("__i"):
            base = base[1:]
        elif name.startswith("__r") and base[1:] in ("add", "sub", "mul", "truediv", "div", "pow"):
            args = (args[1], args[0]) + tuple(args[2:])
            base = base[1:]
        if base.endswith("_") and base not in ("copy_",):
            base = base[:-1]
        def arg(i, key, default=None):
            """Argument i, given by position or by its keyword (torch's name for it)."""
            return args[i] if len(args) > i else kw.get(key, default)

        E = lambda i: self.of(args[i], where)  # noqa: E731

        def kind(*ks):
            if "foreign" in ks:
                if ("element" in ks or "tensor" in ks) and self.mixed_at is None:
                    self.mixed_at = where
                return "foreign"
            return "element" if "element" in ks else "tensor" if "tensor" in ks else "uniform"

        if base in ("item",):
            e, k = E(0)
            if k == "element":
                raise TraceError(f".item() of per-element data at {where}: data-dependent, not traceable")
            if k in ("tensor", "foreign"):
                raise TraceError(f".item() of a per-tensor value (a norm, or math on one) at {where}: its value "
                                 "is data-dependent (read on the host); use the 0-dim tensor itself")
            return SymFloat(float(out), e, self.paths)
        if base in ("bool",):
            e, k = E(0)
            if k == "element":
                raise TraceError(f"Python control flow on per-element data (bool of a tensor) at {where}")
            return self.paths.decide(e != 0.0, bool(out), foreign=k == "foreign", where=where)
        if base in ("float",) and name == "__float__":
            e, k = E(0)
            if k == "element":
                raise TraceError(f"float() of per-element data at {where}")
            if k in ("tensor", "foreign"):
                raise TraceError(f"float() of a per-tensor value (a norm, or math on one) at {where}: its value is "
                                 "data-dependent (read on the host); use the 0-dim tensor itself")
            return SymFloat(float(out), e, self.paths)
        unary = {"sqrt": _core.sqrt, "rsqrt": _core.rsqrt, "exp": _core.exp, "log": _core.log, "abs": _core.abs,
                 "sign": _core.sign, "sgn": _core.sign, "neg": lambda x: -x, "negative": lambda x: -x,
                 "reciprocal": lambda x: 1.0 / x, "square": lambda x: x * x,
                 # same elements, another shape or copy: element-wise math does not see the difference
                 "clone": lambda x: x, "detach": lambda x: x, "contiguous": lambda x: x, "view_as": lambda x: x,
                 "reshape_as": lambda x: x, "view": lambda x: x, "reshape": lambda x: x, "flatten": lambda x: x,
                 "conj": lambda x: x, "conj_physical": lambda x: x, "resolve_conj": lambda x: x}  # real tensors
        binary = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "subtract": lambda x, y: x - y,
                  "mul": lambda x, y: x * y, "multiply": lambda x, y: x * y, "div": lambda x, y: x / y,
                  "truediv": lambda x, y: x / y, "divide": lambda x, y: x / y, "pow": _core.pow,
                  # max/min of two tensors (with a dim they return (values, indices): not recorded, so refused)
                  "maximum": _core.max, "minimum": _core.min, "max": _core.max, "min": _core.min,
                  "gt": lambda x, y: x > y, "lt": lambda x, y: x < y, "ge": lambda x, y: x >= y,
                  "le": lambda x, y: x <= y, "eq": lambda x, y: x == y, "ne": lambda x, y: x != y,
                  "greater": lambda x, y: x > y, "less": lambda x, y: x < y}
        if base in _REDUCTIONS and not (base in ("max", "min") and (len(args) >= 2 or "other" in kw)):
            res, rk = self.reduction(name, base, args, kw, where)
        elif base in unary and len(args) >= 1:
            e, k = E(0)
            res, rk = unary[base](e), k
        elif base in binary and (len(args) >= 2 or "other" in kw or "exponent" in kw):
            if base in ("div", "truediv", "divide") and kw.get("rounding_mode") is not None:
                raise TraceError(f"division with rounding_mode at {where} is not traceable")
            (x, kx), (y, ky) = E(0), self.of(arg(1, "exponent" if base == "pow" else "other"), where)
            alpha = kw.get("alpha")
            if alpha is not None and base in ("add", "sub"):
                y = self.of(alpha, where)[0] * y
            res, rk = binary[base](x, y), kind(kx, ky)
        elif base in ("addcmul", "addcdiv"):
            (x, kx), (t1, k1), (t2, k2) = E(0), self.of(arg(1, "tensor1"), where), self.of(arg(2, "tensor2"), where)
            v = self.of(arg(3, "value", 1.0), where)[0]
            res = x + (v * t1) * t2 if base == "addcmul" else x + (v * t1) / t2
            rk = kind(kx, k1, k2)
        elif base == "lerp":
            (x, kx), (y, ky), (w, kw_) = E(0), self.of(arg(1, "end"), where), self.of(arg(2, "weight"), where)
            res, rk = _core.lerp(x, y, w), kind(kx, ky, kw_)
        elif base in ("clamp", "clip", "clamp_min", "clamp_max"):
            e, k = E(0)
            lo = kw.get("min", args[1] if len(args) > 1 and base in ("clamp", "clip", "clamp_min") else None)
            hi = kw.get("max", args[2] if len(args) > 2 else (args[1] if base == "clamp_max" and len(args) > 1 else None))
            res = e
            if lo is not None:
                res = _core.max(res, self.of(lo, where)[0])
            if hi is not None:
                res = _core.min(res, self.of(hi, where)[0])
            rk = k
        elif base == "where":
            (c, kc), (x, kx), (y, ky) = (self.of(arg(0, "condition"), where), self.of(arg(1, "input"), where),
                                         self.of(arg(2, "other"), where))
            res, rk = _core.select(c, x, y), kind(kc, kx, ky)
        elif base in ("zeros_like", "ones_like", "full_like", "empty_like"):
            e, k = E(0)
            v = {"zeros_like": 0.0, "ones_like": 1.0, "empty_like": 0.0}.get(base)
            if base == "full_like":
                v = kw.get("fill_value", args[1] if len(args) > 1 else None)
            res, rk = self.of(v, where)  # every element the fill value: of its kind, not an element value
        elif base in ("zero", "fill"):
            E(0)
            res, rk = (b.constant(0.0), "uniform") if base == "zero" else self.of(arg(1, "value"), where)
        elif base == "copy_":
            E(0)
            res, rk = E(1)
            if rk == "foreign" and self.mixed_at is None and E(0)[1] in ("element", "tensor"):
                self.mixed_at = where
        elif base in ("to", "float", "type_as", "type") and torch.is_tensor(args[0]):
            e, k = E(0)
            res, rk = e, k
        elif base in ("tensor", "as_tensor", "scalar_tensor"):
            res, rk = self.of(args[0], where)
        else:
            raise TraceError(f"torch op '{name}' at {where} is not traceable (no optfuse equivalent recorded)")
        target = args[0] if inplace or base == "copy_" else out
        if torch.is_tensor(target):
            self.bind(target, res, rk)
        if torch.is_tensor(out) and out is not target:
            self.bind(out, res, rk)
        root = self.square_root(base, args, kw, rk, where)
        if root is not None:  # y*y: a later .sum() of it is y's sum of squares
            for t in (target, out):
                if torch.is_tensor(t):
                    self.square_of[self.key(t)] = root
        return out

    def square_root(self, base, args, kw, rk, where):
        """y's expression when this op computed y*y (y.square(), y**2, y.pow(2), y*y) of an element value y."""
        if base not in ("square", "pow", "mul", "multiply") or rk not in ("element", "foreign") or not args or not torch.is_tensor(args[0]):
            return None
        y = self.of(args[0], where)[0]
        if base == "square":
            return y
        if base == "pow":
            ex = args[1] if len(args) > 1 else kw.get("exponent")
            # a plain number only: a SymFloat exponent is a hyperparameter (2 now, maybe not later)
            return y if type(ex) in (int, float) and ex == 2 else None
        if base in ("mul", "multiply"):
            other = args[1] if len(args) > 1 else kw.get("other")
            if torch.is_tensor(other) and self.key(other) in self.expr and _same_expr(self.of(other, where)[0], y):
                return y
        return None

    def reduction(self, name, base, args, kw, where):
        """A whole-tensor reduction the IR has (per tensor: the sum of squares), as (expr, "tensor");
        TraceError naming the construct otherwise."""
        x = args[0] if args else kw.get("input")
        if not self.reductions:
            raise TraceError(f"torch op '{name}' at {where} (a reduction) is not traceable here: the function "
                             "form traces one tensor per list, where a sum over the list would pass for a "
                             "per-tensor one")

        def arg(i, key, default=None):
            return args[i] if len(args) > i else kw.get(key, default)

        if base in ("norm", "linalg_vector_norm", "linalg_norm"):
            pkey = "p" if base == "norm" else "ord"
            p = arg(1, pkey, {"norm": "fro", "linalg_vector_norm": 2, "linalg_norm": None}[base])
            dim, keepdim = arg(2, "dim"), arg(3, "keepdim", False)
            call = "norm" if base == "norm" else f"torch.linalg.{base[len('linalg_'):]}"
            what = f"{call}({pkey}={p!r}{'' if dim is None else f', dim={dim!r}'}) at {where}"
        else:
            p, dim = None, arg(1, "dim")
            keepdim = arg(2, "keepdim", False)
            what = f"{base}(){'' if dim is None else f' with dim={dim!r}'} at {where}"
        if dim is not None:
            raise TraceError(f"{what}: a reduction along dimensions (dim=) is not traceable; the IR reduces whole "
                             "tensors only (a norm or sum of squares of the whole parameter-shaped tensor)")
        if keepdim:
            raise TraceError(f"{what}: keepdim=True is not traceable (reduce to a 0-dim value, keepdim=False)")
        if kw.get("out") is not None:
            raise TraceError(f"{what}: out= is not traceable")
        dtype = kw.get("dtype")
        if dtype is not None and dtype not in (torch.float32, torch.float64):
            raise TraceError(f"{what}: dtype={dtype} is not traceable (float32 or float64 only)")
        if base in ("max", "min", "amax", "amin"):
            raise TraceError(f"{what}: the IR has no max/min reduction (the largest |x|, x.abs().max(), the inf-norm, "
                             "is not a reduction optfuse has; per tensor it has the sum of squares)")
        if base in ("mean", "nanmean"):
            raise TraceError(f"{what}: a mean needs the tensor's element count, which the IR has not (per tensor "
                             "it has the sum of squares: norm(), x.pow(2).sum())")
        if base not in ("norm", "linalg_vector_norm", "linalg_norm", "sum"):
            raise TraceError(f"{what}: a reduction the IR has not (per tensor it has the sum of squares: "
                             "norm(), x.pow(2).sum())")
        if not torch.is_tensor(x):
            raise TraceError(f"{what}: not of a tensor")
        if base != "sum":
            nd = x.dim()
            if isinstance(p, SymFloat):
                raise TraceError(f"{what}: the norm's order comes from a hyperparameter or the step: not traceable "
                                 "(only the 2-norm is a reduction the IR has)")
            two = type(p) in (int, float) and p == 2
            ok = {"norm": p in ("fro", None) or two,
                  "linalg_vector_norm": two,
                  # linalg.norm: None is the 2-norm of the flattened tensor; 'fro' is it of a matrix; ord=2 is
                  # the vector 2-norm of a vector but the spectral norm of a matrix
                  "linalg_norm": p is None or (p == "fro" and nd == 2) or (two and nd == 1)}[base]
            if not ok:
                inf = type(p) in (int, float) and p == float("inf")
                why = ("the largest |x| (a max-of-abs reduction), which the IR has not" if inf else
                       "a matrix norm (singular values), not traceable" if base == "linalg_norm" and nd == 2 else
                       "only the 2-norm (the square root of a sum of squares) is a reduction the IR has")
                raise TraceError(f"{what}: {why}")
        e, k = self.of(x, where)
        if k not in ("element", "foreign"):
            raise TraceError(f"{what}: of a {'per-tensor' if k == 'tensor' else 'uniform'} value (a tensor whose "
                             "elements all hold one value per tensor or per step): the IR reduces per-element "
                             "values only (the element count is not an input)")
        if self.param_numel is not None and x.numel() != self.param_numel:
            raise TraceError(f"{what}: of a tensor of shape {tuple(x.shape)} ({x.numel()} elements), not the "
                             f"parameter's ({self.param_numel}): the IR reduces whole parameter-shaped tensors only")
        if base == "sum":
            root = self.square_of.get(self.key(x))
            if root is None:
                raise TraceError(f"{what}: the sum of a tensor that is not a square (x*x, x**2, x.pow(2), "
                                 "x.square()); the only per-tensor sum the IR has is the sum of squares")
            return _core.tensor_sum_of_squares(root), "tensor" if k == "element" else k
        return _core.sqrt(_core.tensor_sum_of_squares(e)), "tensor" if k == "element" else k


# --- from an optimizer to a rule

PROBE_ELEMENTS = 8   # a probe parameter's size when the group has none to copy the dimensions of
LATER_STEP = 3       # the step count a "later step" trace starts from
MAX_PATHS = 16       # symbolic Python branches: at most this many paths per trace


def _numeric(v):
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or (torch.is_tensor(v) and v.numel() == 1)


def hyper_values(group, counters=()):
    """The param group's numeric options as rule hyperparameters: {"lr": 1e-3, "betas#0": 0.9, ...}.
    `counters` are group entries the step increments (a step count kept in the group): the rule's
    step input, not hyperparameters."""
    out = {}
    for k, v in group.items():
        if k == "params" or k in counters:
            continue
        if _numeric(v):
            out[k] = float(v)
        elif isinstance(v, (tuple, list)) and v and all(_numeric(x) for x in v):
            for i, x in enumerate(v):
                out[f"{k}_{i}"] = float(x)
    return out


def structure(group, counters=()):
    """What a trace depends on besides hyperparameters: the group's other options (flags, None, strings)."""
    h = hyper_values(group, counters)
    return tuple((k, repr(v)) for k, v in sorted(group.items())
                 if k != "params" and k not in counters and k not in h and f"{k}_0" not in h)


def _group_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Layout:
    """What the optimizer keeps per parameter, found by stepping a probe twice without recording; and
    what its step writes into the param group (a step count kept there: pytorch-optimizer's
    group['step'], schedulefree's group['k'])."""

    def __init__(self, opt, group):
        probe, p = _probe(opt, group, None)
        g = probe.param_groups[0]
        seen = [{k: _private(v) for k, v in g.items()}]
        for _ in range(2):
            p.grad = torch.randn_like(p)
            probe.step()
            seen.append({k: _private(v) for k, v in g.items()})
        self.counters, self.group_states = _group_writes(type(opt).__name__, seen)
        st = probe.state.get(p, {})
        self.states, self.step_key, self.step_is_tensor = [], None, False
        for k, v in st.items():
            if v is None:  # a slot the optimizer does not use with these options (SGDW's buffer without momentum)
                continue
            if torch.is_tensor(v) and v.shape == p.shape:
                self.states.append(k)
            elif k == "step" and (torch.is_tensor(v) or _numeric(v)):
                self.step_key, self.step_is_tensor = k, torch.is_tensor(v)
            else:
                raise TraceError(f"{type(opt).__name__} keeps a per-parameter state '{k}' "
                                 f"({type(v).__name__}{tuple(v.shape) if torch.is_tensor(v) else ''}) that is neither "
                                 "a tensor of the parameter's shape nor the step count: not traceable yet")
        if self.counters and self.step_key is not None:
            raise TraceError(f"{type(opt).__name__} keeps a step count both per parameter (state '{self.step_key}') "
                             f"and in the param group ({', '.join(self.counters)}): not traceable yet")


def _group_writes(cls, seen):
    """The param group's entries as a probe stepped twice (seen: before, after 1, after 2 steps):
    counters (Python numbers the step adds exactly 1 to, from 0 or absent on a fresh group) and the
    keys of other values the step writes into the group (a running sum or maximum of
    hyperparameters kept across steps: a per-group scalar state, which the IR has not)."""
    counters, written = [], []
    for k in sorted(set(seen[1]) | set(seen[2])):
        if k == "params":
            continue
        vals = [d.get(k) for d in seen]
        if (k not in seen[0] or _same(vals[0], vals[1])) and _same(vals[1], vals[2]):
            continue  # not written, or only created on the first step with a value it keeps (MADGRAD's 'step')
        if (all(_group_number(v) for v in vals[1:]) and vals[2] == vals[1] + 1
                and (vals[1] == 1 if k not in seen[0] else _group_number(vals[0]) and vals[1] == vals[0] + 1)):
            counters.append(k)
        else:
            written.append(k)
    return tuple(counters), tuple(written)


def _same(a, b):
    if type(a) is not type(b):
        return False
    if torch.is_tensor(a):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool((a == b).all())
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _group_state_message(cls, keys):
    more = f", as are {', '.join(keys[1:])}" if keys[1:] else ""
    return (f"{cls}'s step writes group['{keys[0]}'] (a value it computes and keeps in the param group{more}): a "
            "per-group scalar state, which the IR has not")


def group_counters(opt):
    """The group entries every group's step increments (see _Layout), for hyper_values/structure."""
    keys = set()
    for g in opt.param_groups:
        keys |= set(_Layout(opt, g).counters)
    return frozenset(keys)


def _private(v):
    return v.detach().clone() if torch.is_tensor(v) else v


def probe_shape(group, like=None):
    """A small shape with the dimensions of `like` (default: the group's first parameter), each at most
    4: optimizer code may branch on p.dim() (timm's SGDP projects matrices differently from vectors)."""
    like = like if like is not None else (group["params"][0] if group.get("params") else torch.empty(PROBE_ELEMENTS))
    return tuple(min(d, 4) for d in like.shape) or ()


def _probe(opt, group, hyper_subst, shape=None):
    """A shallow copy of `opt` whose only parameter is a small probe tensor, in a copy of `group`."""
    p = torch.randn(shape if shape is not None else probe_shape(group))
    # tensors are copied: the probe's step must not change the optimizer's own (timm's group["step"])
    g = {k: _private(hyper_subst(k, v) if hyper_subst else v) for k, v in group.items() if k != "params"}
    g["params"] = [p]
    probe = object.__new__(type(opt))
    # not opt's own step: an lr scheduler stores a wrapper there that steps opt, whatever it is called on
    probe.__dict__.update({k: _private(v) for k, v in opt.__dict__.items() if k != "step"})
    probe.param_groups = [g]
    probe.state = __import__("collections").defaultdict(dict)
    return probe, p


def _trace_once(opt, group, layout, b, first, forced, shape=None):
    """One run of opt.step() on a probe under the recorder; returns (param expr, {state: expr}, paths).
    The probe group holds two other parameters, one before and one after the probe: their values are
    "foreign", and any that reaches the probe's update (a sum or norm over the group's parameters in
    Python, a branch on one) is refused, never taken as the probe's own."""
    paths = _Paths(forced, memo=True)
    hypers = hyper_values(group, layout.counters)

    def subst(k, v):
        if k in layout.counters:
            # the group's step count before this step: step - 1 (0 on the first step, as a fresh group has)
            return SymFloat(0.0 if first else float(LATER_STEP), b.step() - 1.0, paths)
        if k in hypers:
            return SymFloat(float(v), b.hyper(k), paths)
        if isinstance(v, (tuple, list)) and f"{k}_0" in hypers:
            return type(v)(SymFloat(float(x), b.hyper(f"{k}_{i}"), paths) for i, x in enumerate(v))
        return v

    probe, p = _probe(opt, group, subst, shape)
    for k in layout.counters:  # a fresh group has none yet: the optimizer's own code would start it at 0
        if k not in probe.param_groups[0]:
            probe.param_groups[0][k] = subst(k, 0)
    rec = _Recorder(b, paths, reductions=True)
    others = [torch.randn_like(p), torch.randn_like(p)]
    probe.param_groups[0]["params"] = [others[0], p, others[1]]
    for q, kind in ((p, "element"), (others[0], "foreign"), (others[1], "foreign")):
        # the others have the probe's expressions (the same math on them is the same nodes) but their own kind
        rec.bind(q, b.param(), kind)
        q.grad = torch.randn_like(q)
        rec.bind(q.grad, b.update(), kind)
        if not first:
            st = probe.state[q]
            for k in layout.states:
                t = torch.rand_like(q) + 0.5
                rec.bind(t, b.state(k), kind)
                st[k] = t
            if layout.step_key is not None:
                before = b.step() - 1.0
                if layout.step_is_tensor:
                    t = torch.tensor(float(LATER_STEP))
                    rec.bind(t, before, "uniform")
                    st[layout.step_key] = t
                else:
                    st[layout.step_key] = SymFloat(float(LATER_STEP), before, paths)
    inputs = dict(probe.param_groups[0])
    patched = _patched_math()
    saved = {n: getattr(math, n) for n in patched}
    try:
        for n, f in patched.items():
            setattr(math, n, f)
        with rec:
            probe.step()
    finally:
        for n, f in saved.items():
            setattr(math, n, f)
    for k, v in probe.param_groups[0].items():
        # a value computed from hyperparameters or the step and kept in the group (for the next step to
        # read, or for logging): a per-group scalar state; the fused optimizer would never write it
        if k not in layout.counters and (k not in inputs or v is not inputs[k]) and (
                isinstance(v, SymFloat) or isinstance(v, (tuple, list)) and any(isinstance(x, SymFloat) for x in v)):
            raise TraceError(_group_state_message(type(opt).__name__, [k]))
    st = probe.state.get(p, {})

    def expr_of(t, what):
        if isinstance(t, SymFloat):
            return t.expr
        hit = rec.expr.get(rec.key(t))
        if hit is None:
            raise TraceError(f"{what} after the step is a tensor the trace did not produce")
        if hit[1] == "foreign":
            raise TraceError(f"{what} after the step depends on other parameters' values (first met at "
                             f"{rec.mixed_at or '?'}): a sum or norm over the group's parameters (global-norm "
                             "clipping) is not traceable yet; a traced step must update each parameter from "
                             "its own values")
        return hit[0]

    states = {k: expr_of(st[k], f"state '{k}'") for k in layout.states if k in st}
    return expr_of(p, "the parameter"), states, paths.seen


def _explore(opt, group, layout, b, first, shape=None):
    """Every path through the symbolic branches, merged with selects into one set of expressions."""
    return explore_paths(lambda forced: _trace_once(opt, group, layout, b, first, forced, shape))


def explore_paths(trace_once, infeasible=(), skipped=None):
    """Runs trace_once(forced) -> (param expr, {state: expr}, paths seen) down every path through the
    symbolic branches (the outcomes in `forced` first) and merges the results with selects. A path
    other than the real one that raises one of `infeasible` is taken as unreachable (no select); its
    condition is appended to `skipped` (the caller must then check, when values change, that the
    real path stays the one traced)."""
    count = [0]

    def run(forced):
        count[0] += 1
        if count[0] > MAX_PATHS:
            raise TraceError(f"more than {MAX_PATHS} paths through Python branches on hyperparameters or the step")
        param, states, seen = trace_once(forced)
        return merge(forced, param, states, seen)

    def merge(forced, param, states, seen):
        # seen[i] for i >= len(forced) were decided by real values; trace the other outcome of each
        for i in range(len(seen) - 1, len(forced) - 1, -1):
            cond, outcome = seen[i]
            try:
                other = run([o for _, o in seen[:i]] + [not outcome])
            except infeasible:
                if skipped is not None:
                    skipped.append(cond)
                continue
            op, ost = other
            if getattr(seen[i], "foreign", False):
                # a branch on another parameter's values: fine where it changes only that parameter's update
                if not (_same_expr(op, param) and set(ost) == set(states)
                        and all(_same_expr(ost[k], states[k]) for k in states)):
                    raise TraceError(f"a Python branch on other parameters' values at {seen[i].where} changes "
                                     "this parameter's update: not traceable (each parameter's update must "
                                     "depend on its own values only)")
                continue
            t_param, f_param = (param, op) if outcome else (op, param)
            param = _core.select(cond, t_param, f_param)
            merged = {}
            for k in set(states) | set(ost):
                a, c = states.get(k), ost.get(k)
                if a is None or c is None:
                    merged[k] = a if c is None else c
                else:
                    merged[k] = _core.select(cond, a, c) if outcome else _core.select(cond, c, a)
            states = merged
        return param, states

    return run([])


def traced_rule(opt, group):
    """An optfuse Rule equivalent to one step of `opt` on a parameter of `group` (TraceError if not)."""
    layout = _Layout(opt, group)
    if layout.group_states:
        raise TraceError(_group_state_message(type(opt).__name__, layout.group_states))
    rule = _core.Rule(f"traced_{type(opt).__name__}")
    for k, v in hyper_values(group, layout.counters).items():
        rule.hyper(k, v)
    for k in layout.states:
        rule.state(k, 0.0)

    traced_dim = len(probe_shape(group))
    others = {}  # another dimensionality in the group -> a probe shape of it
    for q in group.get("params", ()):
        if q.dim() != traced_dim and q.dim() not in others:
            others[q.dim()] = probe_shape(group, like=q)

    def update(b):
        p_first, s_first = _explore(opt, group, layout, b, True)
        p_later, s_later = _explore(opt, group, layout, b, False)
        for nd, shape in sorted(others.items()):
            # one rule per group: the step must be the same math for every dimensionality in it (timm's Mars
            # runs AdamW on vectors, MARS on matrices; the IR cannot select on a tensor's dimensionality)
            for first, (pe, se) in ((True, (p_first, s_first)), (False, (p_later, s_later))):
                try:
                    op, ost = _explore(opt, group, layout, b, first, shape)
                except TraceError:
                    raise
                except Exception as e:  # noqa: BLE001
                    op, ost = None, {"?": e}
                if (op is None or not _same_expr(op, pe) or set(ost) != set(se)
                        or any(not _same_expr(ost[k], se[k]) for k in se)):
                    raise TraceError(
                        f"{type(opt).__name__}'s step is other math for a parameter of {nd} dimension(s) than for "
                        f"one of {traced_dim} in the same param group (it branches on the parameter's shape): "
                        "one param group is one traced rule, and the IR cannot select on a tensor's "
                        "dimensionality; not traceable yet")
        is_first = b.step() == 1.0
        for k in layout.states:
            later = s_later.get(k, b.state(k))
            b.set_state(k, _core.select(is_first, s_first[k], later) if k in s_first else later)
        b.set_param_base(_core.select(is_first, p_first, p_later))
        return b.constant(0.0)

    rule.update(update)
    return rule, layout
