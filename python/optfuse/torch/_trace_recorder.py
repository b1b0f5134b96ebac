"""The recorder of torch ops (see _trace.py): a TorchFunctionMode that maps every torch op an optimizer
step runs on the probe to the optfuse expression of its result.

_Recorder knows each tensor by its memory ((data_ptr, numel): aliases and views share one expression)
with a kind that says what its value depends on (element, tensor, uniform, row, col, foreign), refuses
what the IR cannot express (indexing, multi-tensor ops, data read back to Python) by name and place, and
translates element-wise ops (record). Reductions and tensor sizes (p.shape, size(i)) are its methods
too, kept in _trace_reductions.py (_Reductions, a base class of _Recorder) for their length.
"""
import torch
from torch.overrides import TorchFunctionMode

from .. import _core
from ._trace_reductions import _REDUCTIONS, _Reductions
from ._trace_values import SymFloat, TraceError, _ProbeCount, _ProbeDim, _where


# Ops whose result is a Python value that may carry an expression.
_SCALAR_OUT = ("item", "__bool__", "__float__")
# Ops whose result is a plain Python value read from a tensor's data (it would be frozen): refused on a
# recorded tensor unless that is a constant.
_DATA_OUT = ("__int__", "__index__", "tolist", "numpy", "__complex__", "__array__")


class _Recorder(_Reductions, TorchFunctionMode):
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
        if name in ("__getitem__", "__setitem__", "index_put_", "scatter_", "index_copy_"):
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

    def record(self, name, args, kw, out, where):
        b = self.b
        base = name[2:-2] if name.startswith("__") and name.endswith("__") else name
        augmented = name.startswith("__i") and name != "__invert__"  # x += y, x &= y (not ~x)
        inplace = base.endswith("_") and base != "_" or augmented
        if augmented:
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
        elif base in ("and", "or", "xor", "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
                      "bitwise_xor") and (len(args) >= 2 or "other" in kw):
            # of conditions (bool tensors: comparisons' results) only: on integers & and | are bitwise
            other = arg(1, "other")
            for v in (args[0], other):
                if not (isinstance(v, bool) or torch.is_tensor(v) and v.dtype == torch.bool) and not base.startswith("logical"):
                    raise TraceError(f"'{name}' of a non-boolean value at {where}: bitwise math is not traceable")
            (x, kx), (y, ky) = E(0), self.of(other, where)
            x, y = x != 0.0, y != 0.0
            op = base.replace("logical_", "").replace("bitwise_", "")
            res = (_core.logical_and(x, y) if op == "and" else _core.logical_or(x, y) if op == "or"
                   else _core.logical_and(_core.logical_or(x, y), _core.logical_not(_core.logical_and(x, y))))
            rk = kind(kx, ky)
        elif base in ("logical_not", "invert", "bitwise_not") and args:
            if base != "logical_not" and not (torch.is_tensor(args[0]) and args[0].dtype == torch.bool):
                raise TraceError(f"'{name}' of a non-boolean value at {where}: bitwise math is not traceable")
            e, k = E(0)
            res, rk = _core.logical_not(e != 0.0), k
        elif base == "nan_to_num" and args and torch.is_tensor(args[0]) and args[0].is_floating_point():
            # NaN -> nan (0), +inf -> posinf (the dtype's largest), -inf -> neginf (its lowest)
            e, k = E(0)
            fi = torch.finfo(args[0].dtype)
            nan, pinf, ninf = (arg(i, key, None) for i, key in ((1, "nan"), (2, "posinf"), (3, "neginf")))
            nan = self.of(0.0 if nan is None else nan, where)[0]
            pinf = self.of(fi.max if pinf is None else pinf, where)[0]
            ninf = self.of(fi.min if ninf is None else ninf, where)[0]
            res = _core.select(e != e, nan, _core.select(e == float("inf"), pinf,
                                                         _core.select(e == -float("inf"), ninf, e)))
            rk = k
        elif base == "masked_fill" and args and torch.is_tensor(args[0]):
            # x where not mask, value where mask (FTRL's p.masked_fill_(|z| <= lambda_1, 0)): element-wise
            mask = arg(1, "mask")
            if not (torch.is_tensor(mask) and mask.dtype == torch.bool
                    and (tuple(mask.shape) == tuple(args[0].shape) or mask.numel() == 1)):
                raise TraceError(f"masked_fill at {where} with a mask that is not a boolean tensor of the tensor's "
                                 "shape: not traceable")
            (x, kx), (m, km), (v, kv) = E(0), self.of(mask, where), self.of(arg(2, "value"), where)
            res, rk = _core.select(m != 0.0, v, x), kind(kx, km, kv)
        elif base == "normalize" and args and torch.is_tensor(args[0]):
            # F.normalize(x, p, dim, eps): x / max(norm(x, p, dim, keepdim=True), eps) (TAM's)
            if kw.get("out") is not None:
                raise TraceError(f"normalize at {where} with out=: not traceable")
            pn, dim, eps = arg(1, "p", 2.0), arg(2, "dim", 1), arg(3, "eps", 1e-12)
            n, nk = self.reduction("norm", "norm", (args[0], pn, dim, True), {}, where)
            e, k = E(0)
            res, rk = e / _core.max(n, self.of(eps, where)[0]), kind(k, nk)
            if rk in ("row", "col"):  # (of a filled tensor: per row or column, in the tensor's shape)
                rk = "element"
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
