"""The symbolic values of a trace (see _trace.py): what a traced optimizer step computes with in Python.

SymFloat is a Python float that carries an optfuse expression (a hyperparameter, the step, or math on
them), so the scalar arithmetic an optimizer does in Python stays symbolic; _Paths records the outcome
of each Python condition on one (a branch, traced both ways by _trace.explore_paths). _ProbeCount and
_ProbeDim are a probe tensor's numel() and sizes: comparable, and refused as numbers where the IR has
no such size (the probe's would be frozen into the trace). The math module's functions are replaced
during a trace by versions that keep a SymFloat symbolic or refuse it (_patched_math). TraceError,
raised by every part of the tracer for a construct it cannot express, _where / _frame_of (the
optimizer code's file:line for its messages) and _same_expr are here too, for the other modules of
the tracer to share. Nothing here touches torch; the function tracer (_fuse_fn.py) uses these values
as well as the optimizer tracer.
"""
import linecache
import math
import sys
import traceback

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
    """file:line of the optimizer code being traced (the innermost frame outside this module and torch).
    Called for every op a trace records: frames are walked, not extracted (traceback.extract_stack
    reads every frame's source line, two thirds of a trace's time)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "optfuse" not in name and "/torch/" not in name:
            return f"{name}:{f.f_lineno} ({linecache.getline(name, f.f_lineno).strip()})"
        f = f.f_back
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


def _same_expr(a, b):
    """Whether two expressions are one node (hash-consed: the same value; == would build a comparison)."""
    return repr(a) == repr(b)
