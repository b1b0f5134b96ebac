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

Reductions (Recorder.reduction): sums, means, p-norms and the largest |x| of a whole parameter-shaped
tensor are the IR's per-tensor reductions; along the last or first dimension of a matrix, its row and
column reductions (kinds "row" and "col"); cosine_similarity is sums in its scope; the rest are refused
by name. Sizes (numel(), size(i), shape) are the real tensor's (Op::Shape: _ProbeDim, SymFloat). So that a
sum over the group's parameters in Python is never taken for a per-tensor one, the probe group holds two
other parameters whose values (and sizes) are "foreign": one reaching the probe's update is refused.
A step that is other math for vectors than for matrices is both traces, selected on Op::Shape is_matrix.
"""
import math
import traceback

import torch
from torch.overrides import TorchFunctionMode

from .. import _core


class TraceError(_core.OptfuseError):
    pass


def _frame_of(e):
    """file:line of the optimizer code where exception e was raised (as _where)."""
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        if "optfuse" not in fr.filename and "/torch/" not in fr.filename:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "?"


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

    def decide(self, cond_expr, real, foreign=False, where="?", canon=None):
        """`canon`: (key, negated) of a comparison, so that a condition and its complement (`momentum != 0`
        in init_group, `momentum == 0` in the step: MADGRAD) are one branch with opposite outcomes."""
        key, negated = canon if canon is not None else (repr(cond_expr), False)
        key = (key, foreign)
        if self.memo is not None and key in self.memo:
            return self.memo[key] != negated
        i = len(self.seen)
        outcome = self.forced[i] if i < len(self.forced) else bool(real)
        d = _Decision((cond_expr, outcome))
        d.foreign, d.where = foreign, where
        self.seen.append(d)
        if self.memo is not None:
            self.memo[key] = outcome != negated
        return outcome


def _canon(op, ea, eb):
    """(key, negated) of the comparison `ea op eb`: a < b, b > a, not a >= b and not b <= a are one key
    (so are a == b, b == a, not a != b); NaN aside, which branches on hyperparameters do not meet."""
    a, b = repr(ea), repr(eb)
    return {"lt": (("lt", a, b), False), "gt": (("lt", b, a), False), "ge": (("lt", a, b), True),
            "le": (("lt", b, a), True), "eq": (("eq",) + tuple(sorted((a, b))), False),
            "ne": (("eq",) + tuple(sorted((a, b))), True)}[op]


def _f(x):
    """x's value as a plain float (a SymFloat's without calling its __float__, which refuses)."""
    return float.__float__(x) if isinstance(x, float) else float(x)


class SymFloat(float):
    """A Python float that also carries an optfuse expression (a hyperparameter, the step, or math
    on them). Arithmetic keeps it symbolic; a comparison used as a Python condition is traced both ways.
    `foreign`: where it was made from another parameter of the probe group (its size): it must not reach
    this parameter's update (see _Recorder)."""

    foreign = None

    def __new__(cls, value, expr, paths, foreign=None):
        obj = super().__new__(cls, value)
        obj.expr, obj.paths = expr, paths
        if foreign:
            obj.foreign = foreign
        return obj

    def _lift(self, other):
        if isinstance(other, _ProbeCount):
            other._refuse()
        if isinstance(other, _ProbeDim):
            return other.expr_or_refuse()
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
        return SymFloat(fn(a, b), exprfn(ea, eb), self.paths, self.foreign or getattr(other, "foreign", None))

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
    def __neg__(self): return SymFloat(-_f(self), -self.expr, self.paths, self.foreign)
    def __pos__(self): return self
    def __abs__(self): return SymFloat(abs(_f(self)), _core.abs(self.expr), self.paths, self.foreign)

    def _cmp(self, o, fn, exprfn, op):
        e = self._lift(o)
        if e is None:
            return NotImplemented
        foreign = self.foreign or getattr(o, "foreign", None)
        return self.paths.decide(exprfn(self.expr, e), fn(_f(self), _f(o)), canon=_canon(op, self.expr, e),
                                 foreign=bool(foreign), where=foreign or "?")

    def __lt__(self, o): return self._cmp(o, lambda a, b: a < b, lambda a, b: a < b, "lt")
    def __le__(self, o): return self._cmp(o, lambda a, b: a <= b, lambda a, b: a <= b, "le")
    def __gt__(self, o): return self._cmp(o, lambda a, b: a > b, lambda a, b: a > b, "gt")
    def __ge__(self, o): return self._cmp(o, lambda a, b: a >= b, lambda a, b: a >= b, "ge")
    def __eq__(self, o): return self._cmp(o, lambda a, b: a == b, lambda a, b: a == b, "eq")
    def __ne__(self, o): return self._cmp(o, lambda a, b: a != b, lambda a, b: a != b, "ne")
    def __bool__(self):
        return self.paths.decide(self.expr != 0.0, _f(self) != 0.0, canon=_canon("ne", self.expr, 0.0),
                                 foreign=bool(self.foreign), where=self.foreign or "?")
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
        x, rest = _dim_sym(x), tuple(_dim_sym(v) for v in rest)
        if isinstance(x, SymFloat) or any(isinstance(r, SymFloat) for r in rest):
            xs = (x,) + rest
            try:
                value = fn(*(_f(v) for v in xs))
            except (ValueError, OverflowError, ZeroDivisionError):
                value = math.nan
            lifted = [v.expr if isinstance(v, SymFloat) else _f(v) for v in xs]
            paths = next(v.paths for v in xs if isinstance(v, SymFloat))
            foreign = next((v.foreign for v in xs if isinstance(v, SymFloat) and v.foreign), None)
            return SymFloat(value, exprfn(*lifted), paths, foreign)
        return fn(x, *rest)
    return wrapped


_MATH = {"sqrt": _core.sqrt, "exp": _core.exp, "pow": _core.pow, "fabs": _core.abs,
         "log": lambda x, base=None: _core.log(x) if base is None else _core.log(x) / _core.log(base)}


def _refusing_math(name, fn):
    """Every other math function returns a plain float, which would freeze a hyperparameter- or
    step-dependent argument into the trace at its value now: refused instead."""
    def wrapped(*xs):
        for v in xs:
            if isinstance(v, _ProbeDim) or isinstance(v, (list, tuple)) and any(isinstance(y, _ProbeDim) for y in v):
                d = v if isinstance(v, _ProbeDim) else next(y for y in v if isinstance(y, _ProbeDim))
                raise TraceError(f"math.{name} of a tensor's size ({d.what} at {d.where}): no optfuse equivalent "
                                 "recorded (the probe's size would be frozen into the trace)")
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


class _ProbeDim(int):
    """A size of a probe tensor (`p.shape[i]`, `p.size(i)`): an int, so that it still shapes views
    (`x.view(x.size(0), -1)`), that carries the expression of the real tensor's size where one is known
    (the element count, the columns of the matrix view: its last dimension, its rows: the next-to-last).
    Used as a number (math.sqrt(x.size(1)): timm's AdamP), it is that expression; where none is known it
    is refused, since the probe's size would be frozen into the trace."""

    def __new__(cls, value, expr, paths, what, where, foreign=None):
        obj = super().__new__(cls, value)
        obj.expr, obj.paths, obj.what, obj.where, obj.foreign = expr, paths, what, where, foreign
        return obj

    def expr_or_refuse(self):
        if self.expr is None:
            raise TraceError(f"arithmetic on {self.what} at {self.where}: the probe's size would be frozen into the "
                             "trace, and this size is not one the IR has per tensor (it has the element count, "
                             "and of the matrix view the columns: the last dimension, and the rows: the one before)")
        return self.expr

    def sym(self):
        return SymFloat(float(int(self)), self.expr_or_refuse(), self.paths, self.foreign)

    def _int_op(self, o, fn, exprfn, reverse=False):
        if isinstance(o, bool) or not isinstance(o, int):
            if isinstance(o, (float, SymFloat)) and not isinstance(o, _ProbeCount):
                return fn(self.sym(), o) if not reverse else fn(o, self.sym())
            return NotImplemented
        a, b = (int(o), int(self)) if reverse else (int(self), int(o))
        eo = o.expr if isinstance(o, _ProbeDim) else float(o)
        if isinstance(o, _ProbeDim) and o.expr is None:
            eo = None
        e = None if self.expr is None or eo is None else (exprfn(eo, self.expr) if reverse else exprfn(self.expr, eo))
        return _ProbeDim(fn(a, b), e, self.paths, self.what, self.where,
                         self.foreign or getattr(o, "foreign", None))

    def __add__(self, o): return self._int_op(o, lambda a, b: a + b, lambda a, b: a + b)
    def __radd__(self, o): return self._int_op(o, lambda a, b: a + b, lambda a, b: a + b, True)
    def __sub__(self, o): return self._int_op(o, lambda a, b: a - b, lambda a, b: a - b)
    def __rsub__(self, o): return self._int_op(o, lambda a, b: a - b, lambda a, b: a - b, True)
    def __mul__(self, o): return self._int_op(o, lambda a, b: a * b, lambda a, b: a * b)
    def __rmul__(self, o): return self._int_op(o, lambda a, b: a * b, lambda a, b: a * b, True)
    # sizes divide one another exactly (numel // size(0)): the quotient is the ratio
    def __floordiv__(self, o): return self._int_op(o, lambda a, b: a // b, lambda a, b: a / b)
    def __rfloordiv__(self, o): return self._int_op(o, lambda a, b: a // b, lambda a, b: a / b, True)
    def __truediv__(self, o): return self.sym() / o
    def __rtruediv__(self, o): return o / self.sym()
    def __pow__(self, o): return self.sym() ** o
    def __rpow__(self, o): return o ** self.sym()
    def __float__(self): return float(self.sym())  # refused (SymFloat.__float__): it would be frozen
    __hash__ = int.__hash__


def _dim_sym(v):
    return v.sym() if isinstance(v, _ProbeDim) else v


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
        self.param_shape = None
        self.abs_of = {}  # key of a tensor that is |y| -> y's expr (its max() is y's max-of-abs)

    @staticmethod
    def key(t):
        return (t.data_ptr(), t.numel())

    def bind(self, t, expr, kind):
        self.expr[self.key(t)] = (expr, kind)
        self.square_of.pop(self.key(t), None)  # rebound (an in-place op): no longer the square it was
        self.abs_of.pop(self.key(t), None)
        self.keep.append(t)
        if kind == "element" and self.param_numel is None:
            self.param_numel, self.param_shape = t.numel(), tuple(t.shape)

    def of(self, x, where):
        """(expr, kind) of an argument: a recorded tensor, a SymFloat, a number; else TraceError."""
        if isinstance(x, _ProbeCount):
            x._refuse()
        if isinstance(x, _ProbeDim):
            return x.expr_or_refuse(), "foreign" if x.foreign else "tensor"
        if isinstance(x, SymFloat):
            if x.foreign and self.mixed_at is None:
                self.mixed_at = x.foreign
            return x.expr, "foreign" if x.foreign else "uniform"
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
            if out == self.param_numel and hasattr(self.b, "shape"):
                # the parameter's element count: an input of the rule (Op::Shape), not the probe's number;
                # another parameter's is marked foreign (a count summed over the group must not reach the update)
                foreign = _where() if self.expr[self.key(args[0])][1] == "foreign" else None
                return SymFloat(float(out), self.b.shape("numel"), self.paths, foreign)
            return _ProbeCount(out, _where())
        if (name == "size" or name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "shape") \
                and args and torch.is_tensor(args[0]) and self.key(args[0]) in self.expr \
                and self.expr[self.key(args[0])][1] != "uniform":
            return self.sizes(args[0], out, name, args, kwargs)
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

    def runs(self, shape):
        """Which of the parameter's dimensions each dimension of a tensor of `shape` spans (a reshape of the
        parameter: each dimension a product of consecutive ones of the parameter's), or None."""
        P = self.param_shape
        if P is None or math.prod(shape) != self.param_numel:
            return None
        out, j = [], 0
        for n in shape:
            a, prod = j, 1
            while prod < n and j < len(P):
                prod *= P[j]
                j += 1
            if prod != n:
                return None
            out.append((a, j))
        return out if j == len(P) or all(d == 1 for d in P[j:]) else None

    def size_expr(self, run):
        """The real tensor's size over the parameter's dimensions [a, b), as an expression where the IR has
        it (element count, columns = the last dimension, rows = the one before), else None."""
        a, bnd = run
        d, b = len(self.param_shape), self.b
        if a == bnd:
            return b.constant(1.0)
        if (a, bnd) == (0, d):
            return b.shape("numel")
        if d < 2:
            return None
        return {(d - 1, d): lambda: b.shape("cols"), (d - 2, d - 1): lambda: b.shape("rows"),
                (d - 2, d): lambda: b.shape("rows") * b.shape("cols"),
                (0, d - 1): lambda: b.shape("numel") / b.shape("cols"),
                (0, d - 2): lambda: b.shape("numel") / (b.shape("rows") * b.shape("cols"))}.get((a, bnd), lambda: None)()

    def sizes(self, t, out, name, args, kwargs):
        """p.shape / p.size() / p.size(i) of a recorded tensor: _ProbeDims (see there)."""
        where = _where()
        foreign = where if self.expr[self.key(t)][1] == "foreign" else None
        runs = None if not hasattr(self.b, "shape") else self.runs(tuple(t.shape))
        dims = []
        for i, n in enumerate(t.shape):
            e = self.size_expr(runs[i]) if runs is not None else None
            what = f"dimension {i} of a tensor of shape {tuple(t.shape)}" + (" (another parameter's)" if foreign else "")
            dims.append(_ProbeDim(n, e, self.paths, what, where, foreign))
        if isinstance(out, int):
            i = args[1] if len(args) > 1 else kwargs.get("dim")
            return dims[i]
        return torch.Size(dims)

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
                if any(k in ("element", "tensor", "row", "col") for k in ks) and self.mixed_at is None:
                    self.mixed_at = where
                return "foreign"
            if "rowmax" in ks:
                raise TraceError(f"the largest of per-row values (max() of a per-row reduction) is used at {where} "
                                 "other than in a comparison (max() < x): the IR has no max over rows")
            if "element" in ks or "row" in ks and "col" in ks:
                return "element"
            return "row" if "row" in ks else "col" if "col" in ks else "tensor" if "tensor" in ks else "uniform"

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
                 # composed of IR ops (torch computes them in float32 the same way, to a few ulp)
                 "sigmoid": lambda x: 1.0 / (1.0 + _core.exp(-x)), "relu": lambda x: _core.max(x, 0.0),
                 "tanh": lambda x: 1.0 - 2.0 / (_core.exp(2.0 * x) + 1.0),
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
            if "rowmax" in (kx, ky) and base in ("lt", "gt", "le", "ge", "less", "greater"):
                res, rk = self.rowmax_compare(base, (x, kx), (y, ky), where)
                return self.finish(res, rk, args, kw, out, inplace, base, where)
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
        elif base in ("full", "zeros", "ones", "empty", "new_full", "new_zeros", "new_ones", "new_empty"):
            # a tensor made filled with one value (torch.full(p.shape, 1e-3): AdaBound, AdaMod)
            fill = {"zeros": 0.0, "ones": 1.0, "empty": 0.0}.get(base.replace("new_", ""))
            if fill is None:
                fill = kw.get("fill_value", args[2 if base == "new_full" else 1] if len(args) > (2 if base == "new_full" else 1) else None)
            if base.startswith("new_"):
                E(0)
            res, rk = self.of(fill, where)
        elif base == "cosine_similarity":
            res, rk = self.cosine(args, kw, where)
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
        return self.finish(res, rk, args, kw, out, inplace, base, where)

    def finish(self, res, rk, args, kw, out, inplace, base, where):
        self.check_lines(args, kw, out, rk, where)
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
        if base == "abs" and rk in ("element", "foreign"):  # |y|: a later .max() of it is y's max of abs
            for t in (target, out):
                if torch.is_tensor(t):
                    self.abs_of[self.key(t)] = self.of(args[0], where)[0] if not inplace else res
        return out

    def check_lines(self, args, kw, out, rk, where):
        """A per-row or per-column value (a reduction along dim=) must broadcast over the parameter's matrix
        as the IR's row and column values do: a row value as (rows, 1), a column value as (1, cols). torch
        broadcasts by position: (rows,) against (rows, cols) would be per column (refused)."""
        lines = [a for a in list(args) + list(kw.values()) if torch.is_tensor(a) and self.key(a) in self.expr
                 and self.expr[self.key(a)][1] in ("row", "col")]
        if not lines or not torch.is_tensor(out) or rk not in ("element", "row", "col"):
            return  # (a reduction of them, or another parameter's)
        P = self.param_shape
        rows = self.param_numel // P[-1]
        for a in lines:
            k = self.expr[self.key(a)][1]
            if rk == k:
                ok = out.numel() == (rows if k == "row" else P[-1])
            else:
                sh = (1,) * (out.dim() - a.dim()) + tuple(a.shape)
                ok = (out.numel() == self.param_numel and out.dim() >= 1 and out.shape[-1] == P[-1]
                      and (sh[-1] == 1 and math.prod(sh) == rows if k == "row" else
                           sh[-1] == P[-1] and math.prod(sh) == P[-1]))
            if not ok:
                raise TraceError(
                    f"a per-{'row' if k == 'row' else 'column'} value of shape {tuple(a.shape)} meets a tensor of shape "
                    f"{tuple(out.shape)} at {where} (parameter {tuple(P)}): only as ({rows}, 1) against the "
                    f"parameter's rows or (1, {P[-1]}) against its columns is it the IR's row / column value")

    def rowmax_compare(self, base, xa, ya, where):
        """max() of per-row values compared with a per-tensor or uniform value (timm's AdamP:
        `cosine.max() < delta / sqrt(n)`): the count of rows on the other side, a sum of row values over the
        tensor (no pass). max(r) < y  <=>  no row has not(r < y) (a NaN row makes it false, as torch's max)."""
        (x, kx), (y, ky) = xa, ya
        if kx != "rowmax":  # y op max(r): flip
            base = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le", "less": "gt", "greater": "lt"}[base]
            (x, kx), (y, ky) = (y, ky), (x, kx)
        if ky not in ("tensor", "uniform"):
            raise TraceError(f"max() of per-row values compared with a {ky} value at {where}: not traceable")
        count = lambda c: _core.reduce(c, "sum", "tensor")  # noqa: E731
        nan_free = count(_core.logical_not(x == x)) == 0.0
        base = {"less": "lt", "greater": "gt"}.get(base, base)
        if base == "lt":
            return count(_core.logical_not(x < y)) == 0.0, "tensor"
        if base == "le":
            return count(_core.logical_not(x <= y)) == 0.0, "tensor"
        if base == "gt":
            return _core.logical_and(count(x > y) > 0.0, nan_free), "tensor"
        return _core.logical_and(count(x >= y) > 0.0, nan_free), "tensor"

    def filled_reduction(self, base, p, x, dim, e, k, what):
        """A reduction of a parameter-shaped tensor whose elements all hold one value e (zeros_like(p) on the
        first step, a per-tensor value expanded): from e and the element count of the scope."""
        scope = self.scope_of(x, dim, what)
        n = self.b.shape({"tensor": "numel", "row": "cols", "col": "rows"}[scope])
        rk = "tensor" if scope == "tensor" else scope
        if base in ("sum", "nansum"):
            root = self.square_of.get(self.key(x))
            return (root * root * n if root is not None else e * n), rk
        if base in ("mean", "nanmean", "max", "min", "amax", "amin"):
            root = self.square_of.get(self.key(x))
            return (root * root if root is not None else e), rk
        if base in ("norm", "linalg_vector_norm") or base == "linalg_norm" and (p is None or p == "fro"):
            if p in ("fro", None) or type(p) in (int, float) and p == 2:
                return _core.abs(e) * _core.sqrt(n), rk
            if type(p) in (int, float) and p == float("inf"):
                return _core.abs(e), rk
            if type(p) in (int, float) and p > 0:
                return _core.abs(e) * _core.pow(n, 1.0 / float(p)), rk
        raise TraceError(f"{what}: of a {'per-tensor' if k == 'tensor' else 'uniform'} value (every element one "
                         "value per tensor or per step): not traceable")

    def scope_of(self, x, dims, what):
        """The IR scope of a reduction of x (a tensor of the parameter's elements) over `dims` (None: all):
        "tensor", "row" (the last dimension of the parameter, a matrix) or "col" (the one before)."""
        nd = x.dim()
        if dims is None:
            return "tensor"
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        dims = tuple(sorted(d % nd if nd else 0 for d in dims))
        if not dims or all(x.shape[i] == 1 for i in range(nd) if i not in dims):
            return "tensor"
        P = self.param_shape
        if P is not None and len(P) == 2 and x.numel() == self.param_numel:
            if dims == tuple(range(nd - len(dims), nd)) and math.prod(x.shape[i] for i in dims) == P[-1]:
                return "row"
            if nd >= 2 and dims == (nd - 2,) and x.shape[-1] == P[-1] and x.shape[-2] == P[-2]:
                return "col"
        raise TraceError(f"{what}: a reduction along dims {dims} of a tensor of shape {tuple(x.shape)} (parameter "
                         f"{tuple(P) if P is not None else '?'}): the IR reduces whole tensors, and rows (the last "
                         "dimension) or columns (the one before) of a 2-dimensional parameter only; fusable as the "
                         "whole tensor's, or the rows' or columns' of a matrix")

    def cosine(self, args, kw, where):
        """F.cosine_similarity(x1, x2, dim, eps): sum(x1 * x2) / (max(|x1|, eps) * max(|x2|, eps)) over the
        dimension's scope (torch divides each by its clamped norm before the sum: equal up to rounding)."""
        x1, x2 = args[0], args[1] if len(args) > 1 else kw.get("x2")
        dim = args[2] if len(args) > 2 else kw.get("dim", 1)
        eps = args[3] if len(args) > 3 else kw.get("eps", 1e-8)
        what = f"cosine_similarity(dim={dim!r}) at {where}"
        if not (torch.is_tensor(x1) and torch.is_tensor(x2)) or tuple(x1.shape) != tuple(x2.shape):
            raise TraceError(f"{what}: of tensors of different shapes (broadcast): not traceable")
        scope = self.scope_of(x1, dim, what)
        (a, ka), (c, kc) = self.of(x1, where), self.of(x2, where)
        if "foreign" in (ka, kc):
            return a, "foreign"  # another parameter's (see reduction)
        for k in (ka, kc):
            if k not in ("element", "foreign"):
                raise TraceError(f"{what}: of a {k} value: the IR reduces per-element values only")
        s = "column" if scope == "col" else scope
        e = self.of(eps, where)[0]
        na = _core.max(_core.sqrt(_core.reduce(a, "sum_of_squares", s)), e)
        nc = _core.max(_core.sqrt(_core.reduce(c, "sum_of_squares", s)), e)
        res = _core.reduce(a * c, "sum", s) / (na * nc)
        return res, "foreign" if "foreign" in (ka, kc) else scope

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
        x = args[0] if args else kw.get("input")
        if torch.is_tensor(x) and self.key(x) in self.expr and self.expr[self.key(x)][1] == "foreign":
            # another parameter's value: it must never reach this parameter's update (refused where it does),
            # so what it reduces to only has to be foreign, not right (its per-row values are not tracked)
            try:
                res, _ = self.reduction_of(name, base, args, kw, where)
            except TraceError:
                res = self.expr[self.key(x)][0]
            return res, "foreign"
        return self.reduction_of(name, base, args, kw, where)

    def reduction_of(self, name, base, args, kw, where):
        """A reduction the IR has, as (expr, kind): of the parameter's elements over the whole tensor
        (sum, mean, 2-norms, p-norms, the max of |x|), its rows or its columns (dim= of a matrix: row and
        column values); of per-row values over the tensor (sum, mean; max only compared); of a one-element
        per-tensor value (itself). TraceError naming the construct otherwise."""
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
        if kw.get("out") is not None:
            raise TraceError(f"{what}: out= is not traceable")
        dtype = kw.get("dtype")
        if dtype is not None and dtype not in (torch.float32, torch.float64):
            raise TraceError(f"{what}: dtype={dtype} is not traceable (float32 or float64 only)")
        if not torch.is_tensor(x):
            raise TraceError(f"{what}: not of a tensor")
        e, k = self.of(x, where)
        b = self.b
        if k == "tensor" and x.numel() == 1 and base in ("sum", "mean", "max", "min", "amax", "amin", "nansum",
                                                          "nanmean"):
            return e, k  # of one value per tensor: itself
        if k in ("row", "col"):
            if dim is not None and self.scope_of(x, dim, what) != "tensor":
                raise TraceError(f"{what}: of per-{'row' if k == 'row' else 'column'} values along a dimension")
            lines = b.shape("rows") if k == "row" else b.shape("cols")
            if base in ("sum", "nansum"):
                return _core.reduce(e, "sum", "tensor"), "tensor"
            if base in ("mean", "nanmean"):
                return _core.reduce(e, "sum", "tensor") / lines, "tensor"
            if base in ("max", "amax") and k == "row":
                return e, "rowmax"  # only compared (rowmax_compare)
            raise TraceError(f"{what}: of per-{'row' if k == 'row' else 'column'} values: the IR sums row and column "
                             "values over a tensor (sum(), mean()), and compares their max() with a value; not more")
        if k == "rowmax":
            raise TraceError(f"{what}: of the largest of per-row values: not traceable")
        if k in ("uniform", "tensor") and x.numel() == self.param_numel and x.numel() > 1:
            return self.filled_reduction(base, p, x, dim, e, k, what)
        if k not in ("element", "foreign"):
            raise TraceError(f"{what}: of a {'per-tensor' if k == 'tensor' else 'uniform'} value (a tensor whose "
                             "elements all hold one value per tensor or per step): the IR reduces per-element "
                             "values only")
        if self.param_numel is not None and x.numel() != self.param_numel:
            raise TraceError(f"{what}: of a tensor of shape {tuple(x.shape)} ({x.numel()} elements), not the "
                             f"parameter's ({self.param_numel}): the IR reduces whole parameter-shaped tensors only")
        scope = self.scope_of(x, dim, what)
        s = "column" if scope == "col" else scope
        rk = scope if k == "element" else k
        count = {"tensor": "numel", "row": "cols", "col": "rows"}[scope]
        if base in ("max", "min", "amax", "amin"):
            root = self.abs_of.get(self.key(x))
            if base in ("max", "amax") and root is not None and dim is None:
                return _core.tensor_max_abs(root), rk
            raise TraceError(f"{what}: the IR has no max/min reduction (it has the largest |x| of a whole tensor: "
                             "x.abs().max(), norm(p=inf))")
        if base in ("mean", "nanmean", "sum", "nansum"):
            root = self.square_of.get(self.key(x))
            total = (_core.reduce(root, "sum_of_squares", s) if root is not None
                     else _core.reduce(e, "sum", s))
            if base.endswith("mean"):
                total = total / b.shape(count)
            return total, rk
        if base not in ("norm", "linalg_vector_norm", "linalg_norm"):
            raise TraceError(f"{what}: a reduction the IR has not (it has sums, means, p-norms and the largest |x| of "
                             "a whole tensor, and sums, means and 2-norms of a matrix's rows or columns)")
        nd = x.dim()
        if isinstance(p, SymFloat):
            raise TraceError(f"{what}: the norm's order comes from a hyperparameter or the step: not traceable "
                             "(a norm's order is structure: it decides which reduction)")
        num = type(p) in (int, float)
        if base == "linalg_norm" and nd == 2 and dim is None and not (p is None or p == "fro"):
            raise TraceError(f"{what}: a matrix norm (singular values, or max/sums of rows and columns): not "
                             "traceable (torch.linalg.vector_norm is the vector norm of the elements)")
        if base == "linalg_norm" and p is not None and p != "fro" and nd > 2 and dim is None:
            raise TraceError(f"{what}: torch.linalg.norm of a tensor of {nd} dimensions with ord=: not traceable")
        if p in ("fro", None) or num and p == 2:
            return _core.sqrt(_core.reduce(e, "sum_of_squares", s)), rk
        if not num:
            raise TraceError(f"{what}: a norm of order {p!r}: not traceable")
        if p == float("inf") and scope == "tensor":
            return _core.tensor_max_abs(e), rk
        if p in (float("inf"), -float("inf")):
            raise TraceError(f"{what}: the IR has no max/min reduction "
                             f"{'along dimensions' if p > 0 else '(the smallest |x|)'}")
        if p == 0:
            return _core.reduce(e != 0.0, "sum", s), rk
        if p == 1:
            return _core.reduce(_core.abs(e), "sum", s), rk
        return _core.pow(_core.reduce(_core.pow(_core.abs(e), float(p)), "sum", s), 1.0 / float(p)), rk


# --- from an optimizer to a rule

PROBE_ELEMENTS = 8   # a probe parameter's size when the group has none to copy the dimensions of
LATER_STEP = 3       # the step count a "later step" trace starts from
MAX_PATHS = 64       # symbolic Python branches: at most this many paths per trace


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

    # a slot this path sets to None (timm SGDW's momentum buffer on a momentum == 0 path, where the probe
    # stepped with momentum) is not written on it: the state keeps its value, which the path never reads
    states = {k: expr_of(st[k], f"state '{k}'") for k in layout.states if st.get(k) is not None}
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
        try:
            param, states, seen = trace_once(forced)
        except KeyError as e:
            if not forced or isinstance(e, infeasible if isinstance(infeasible, tuple) else (infeasible,)):
                raise
            raise TraceError(f"the step reads {e} at {_frame_of(e)}, which exists only under other outcomes of its "
                             "Python branches on hyperparameters (a state created at the first step when an option "
                             "was set: reading it after the option changes would fail in the original too); "
                             "not traceable yet: fusable when each such branch is decided once, at the first step "
                             "(a guard that re-traces)") from None
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
    # The rule's update function runs when the rule is compiled, later: it traces the group as it is
    # now, not the live dict (an lr scheduler attached after fuse() adds initial_lr to it)
    group = dict(group)
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
        traces = {traced_dim: (_explore(opt, group, layout, b, True), _explore(opt, group, layout, b, False))}
        for nd, shape in sorted(others.items()):
            try:
                traces[nd] = (_explore(opt, group, layout, b, True, shape), _explore(opt, group, layout, b, False, shape))
            except TraceError:
                raise
            except Exception as e:  # noqa: BLE001
                traces[nd] = e

        def same(t, u):
            if isinstance(t, Exception) or isinstance(u, Exception):
                return False
            return all(_same_expr(x[0], y[0]) and set(x[1]) == set(y[1]) and all(_same_expr(x[1][k], y[1][k]) for k in x[1])
                       for x, y in zip(t, u))

        # one rule per group: the same math for every dimensionality, or one math for vectors (and scalars)
        # and one for matrices and more (timm's Mars: AdamW on vectors, MARS on matrices; AdamP projects
        # matrices only), selected by whether the tensor has a matrix view (Op::Shape is_matrix)
        classes = {}
        for nd, t in traces.items():
            classes.setdefault(nd >= 2, []).append((nd, t))
        for members in classes.values():
            for nd, t in members[1:]:
                if not same(t, members[0][1]):
                    raise TraceError(
                        f"{type(opt).__name__}'s step is other math for a parameter of {nd} dimension(s) than for "
                        f"one of {members[0][0]} in the same param group (it branches on the parameter's shape): "
                        "the IR selects on whether a tensor is a matrix (2 or more dimensions) or not; not "
                        "traceable yet")
        for members in classes.values():
            if isinstance(members[0][1], Exception):
                e = members[0][1]
                raise TraceError(f"{type(opt).__name__}'s step on a parameter of {members[0][0]} dimension(s) raised "
                                 f"{type(e).__name__}: {e}")
        if len(classes) == 2 and not same(classes[False][0][1], classes[True][0][1]):
            vec, mat = classes[False][0][1], classes[True][0][1]
            if not hasattr(b, "shape"):
                raise TraceError(f"{type(opt).__name__}'s step is other math for vectors than for matrices in one "
                                 "param group, and this build of optfuse._core has no RuleBuilder.shape")
            is_mat = b.shape("is_matrix")

            def pick(m, v):
                return _core.select(is_mat, m, v)
            (p_first, s_first), (p_later, s_later) = [
                (pick(mt[0], vt[0]), {k: pick(mt[1].get(k, b.state(k)), vt[1].get(k, b.state(k)))
                                      for k in set(mt[1]) | set(vt[1])})
                for mt, vt in zip(mat, vec)]
        else:
            (p_first, s_first), (p_later, s_later) = traces[traced_dim]
        is_first = b.step() == 1.0
        for k in layout.states:
            later = s_later.get(k, b.state(k))
            b.set_state(k, _core.select(is_first, s_first[k], later) if k in s_first else later)
        b.set_param_base(_core.select(is_first, p_first, p_later))
        return b.constant(0.0)

    rule.update(update)
    return rule, layout
