"""optfuse.torch.Adafactor: the fused drop-in for torch.optim.Adafactor. One chain for matrices and
vectors: a matrix (a parameter of 2 dimensions) is viewed with its last dimension as columns and
keeps torch's row_var (shape (R, 1)) and col_var (shape (1, C)); a parameter of more than 2
dimensions is a batch of such matrices, each factored on its own as torch does (row_var
(..., R, 1), col_var (..., 1, C); the core's TensorRef::matrix_rows); a vector has no view, its
per-row state is torch's full-size `variance`, and its per-column state (one number the math does
not use for vectors) is kept out of the state dict."""
import torch

from .. import _core
from ._base import OptfuseError
from ._optimizers import _OptionalWeightDecay, _torch_defaults, _wd_arg


def _eps1(g):
    """torch's eps[0], or its None: the machine epsilon of the group's first parameter with a
    gradient (torch takes the first one it steps)."""
    eps1 = g["eps"][0]
    if eps1 is not None:
        return eps1
    params = [p for p in g["params"] if p.grad is not None] or g["params"]
    return torch.finfo(params[0].dtype).eps if params else torch.finfo(torch.float32).eps


class Adafactor(_OptionalWeightDecay):
    __doc__ = ("Fused drop-in for torch.optim.Adafactor (same arguments, defaults and state dict); a parameter of "
               "more than 2 dimensions is factored matrix by matrix, as torch does. Three passes over memory.")
    _sig_keys = ("lr", "beta2_decay", "eps", "d", "weight_decay", "maximize")

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0, *, foreach=None,
                 maximize=False):
        kw = dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay, foreach=foreach,
                  maximize=maximize)
        super().__init__(params, _torch_defaults(torch.optim.Adafactor, kw))

    def _check_param(self, p):
        if torch.is_complex(p):
            return  # refused when stepped, with torch's error (its optim_db expects it there)
        super()._check_param(p)

    def _rebuild(self):
        if any(torch.is_complex(p) for g in self.param_groups for p in g["params"]):
            raise OptfuseError("Adafactor does not support complex parameters")  # torch's words, at step()
        super()._rebuild()

    def _structure(self, g):
        return (bool(g["maximize"]),)

    def _make_chain(self, key, features, groups):
        (maximize,) = key
        g = groups[0]
        return _core.make_builtin("adafactor", lr=float(g["lr"]), beta2_decay=float(g["beta2_decay"]),
                                  eps=(float(_eps1(g)), float(g["eps"][1])), d=float(g["d"]),
                                  weight_decay=_wd_arg(features, groups), maximize=maximize)

    def _hypers(self, g):
        return {"lr": g["lr"], "beta2_decay": g["beta2_decay"], "eps1": _eps1(g), "eps2": g["eps"][1], "d": g["d"],
                "weight_decay": g["weight_decay"]}

    # torch's state keys and shapes: row_var (R, 1) and col_var (1, C) for a matrix; `variance` (the
    # parameter's shape) for a vector, whose col_var (one number) torch does not have.
    def _saved_key(self, p, name):
        if p.dim() > 1:
            return name
        return {"row_var": "variance", "col_var": None}.get(name, name)

    def _state_shape(self, p, name):
        if name == "row_var" and p.dim() > 1:
            return (*p.shape[:-1], 1)
        if name == "col_var":
            return (*p.shape[:-2], 1, p.shape[-1]) if p.dim() > 1 else (1,)
        return None
