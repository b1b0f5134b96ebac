"""Reductions and tensor sizes of the recorder of torch ops (_trace_recorder._Recorder; see _trace.py).

The IR reduces a whole parameter-shaped tensor (sums, means, p-norms, the largest |x|) and, of a matrix,
its rows (the last dimension) and columns (the one before); its sizes are the element count and the
matrix view's rows and columns. _Reductions maps torch's reductions (sum, mean, norm, linalg norms,
amax, cosine_similarity ...) and size queries (p.shape, p.size(i)) onto these scopes, checks that
per-row and per-column values broadcast as the IR's do, and refuses the rest by name. A base class of
_Recorder, kept apart for its length: its methods use the recorder's tables (expr, square_of, abs_of,
param_shape, param_numel) and of() / key().
"""
import math

import torch

from .. import _core
from ._trace_values import SymFloat, TraceError, _ProbeDim, _same_expr, _where


# Reductions of a whole tensor: the 2-norm and the sum of a square are traced (per-tensor sum of squares);
# the others are refused by name (Recorder.reduction).
_REDUCTIONS = ("norm", "linalg_vector_norm", "linalg_norm", "sum", "nansum", "mean", "nanmean", "max", "min",
               "amax", "amin", "prod", "std", "var", "logsumexp", "count_nonzero", "any", "all", "median",
               "nanmedian", "linalg_matrix_norm", "frobenius_norm", "nuclear_norm")


class _Reductions:
    """_Recorder's reductions and size queries (see the module docstring)."""

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
