"""Drop-in replacements for torch.optim.SGD, Adam, AdamW, Adagrad, RMSprop, and Lion (as
lion-pytorch), built from optfuse's registry of named optimizers (the same chains as C++ and SPEC
text). Constructor arguments, defaults and validation are torch's own: each class asks the torch
class it replaces for its defaults dict, so param_groups and state_dict have exactly torch's keys
for the installed torch version (`foreach`, `fused` and `capturable` are kept but ignored)."""
import torch

from .. import _core
from ._base import FusedOptimizer, OptfuseError


def _torch_defaults(cls, kwargs):
    """The defaults dict torch's own class builds from these arguments (and its ValueErrors)."""
    dummy = torch.zeros(1, requires_grad=True)
    return cls([dummy], **kwargs).defaults


def _reject(name, kwargs):
    if kwargs.get("differentiable"):
        raise OptfuseError(f"{name}: differentiable=True is not supported (optfuse steps parameters in place, "
                           "outside autograd)")


def _wd_arg(features, groups):
    """weight_decay for the chain: a non-zero value when some group needs the rule (each group's own
    value is pushed as a hyperparameter afterwards), else 0 so the rule is left out."""
    if "weight_decay" not in features:
        return 0.0
    return next(float(g["weight_decay"]) for g in groups if float(g["weight_decay"]) != 0)


class SGD(FusedOptimizer):
    __doc__ = "Fused drop-in for torch.optim.SGD (same arguments and defaults)."
    _step_in_state = False  # torch's SGD state is only momentum_buffer
    _sig_keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None):
        kw = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                  maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        _reject("SGD", kw)
        super().__init__(params, _torch_defaults(torch.optim.SGD, kw))

    def _structure(self, g):
        return (bool(g["maximize"]), float(g["momentum"]) != 0, bool(g["nesterov"]))

    def _features(self, g):
        return frozenset({"weight_decay"}) if float(g["weight_decay"]) != 0 else frozenset()

    def _make_chain(self, key, features, groups):
        maximize, has_momentum, nesterov = key
        g = groups[0]
        return _core.make_builtin("sgd", lr=float(g["lr"]), momentum=float(g["momentum"]) if has_momentum else 0.0,
                                  dampening=float(g["dampening"]) if has_momentum else 0.0,
                                  weight_decay=_wd_arg(features, groups), nesterov=nesterov, maximize=maximize)

    def _hypers(self, g):
        return {"lr": g["lr"], "momentum": g["momentum"], "dampening": g["dampening"],
                "weight_decay": g["weight_decay"]}

    def _initial_step(self, state):
        return 1 if "momentum_buffer" in state else 0

    def _adjust_step(self, state, step, engine):
        # torch starts a momentum buffer from the gradient the first time it has none; the trace
        # rule does that on step 1, so a parameter without a buffer restarts its count.
        if "momentum_buffer" in engine.state_names and "momentum_buffer" not in state:
            return 0
        return step


class Adam(FusedOptimizer):
    __doc__ = "Fused drop-in for torch.optim.Adam (same arguments and defaults)."
    _sig_keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
    _torch_cls = torch.optim.Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None, **extra):
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, foreach=foreach,
                  maximize=maximize, capturable=capturable, differentiable=differentiable, fused=fused, **extra)
        _reject(type(self).__name__, kw)
        self._init(params, kw)

    def _init(self, params, kw):
        defaults = _torch_defaults(self._torch_cls, kw)
        defaults.setdefault("decoupled_weight_decay", self._torch_cls is torch.optim.AdamW)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for g in self.param_groups:  # state dicts of torch versions before decoupled_weight_decay
            g.setdefault("decoupled_weight_decay", self._torch_cls is torch.optim.AdamW)

    def _structure(self, g):
        return (bool(g["amsgrad"]), bool(g["maximize"]), bool(g.get("decoupled_weight_decay", False)))

    def _features(self, g):
        return frozenset({"weight_decay"}) if float(g["weight_decay"]) != 0 else frozenset()

    def _make_chain(self, key, features, groups):
        amsgrad, maximize, decoupled = key
        g = groups[0]
        b1, b2 = (float(b) for b in g["betas"])
        return _core.make_builtin("adamw" if decoupled else "adam", lr=float(g["lr"]), betas=(b1, b2),
                                  eps=float(g["eps"]), weight_decay=_wd_arg(features, groups), amsgrad=amsgrad,
                                  maximize=maximize)

    def _hypers(self, g):
        b1, b2 = g["betas"]
        return {"lr": g["lr"], "b1": b1, "b2": b2, "eps": g["eps"],
                "weight_decay": g["weight_decay"]}


class AdamW(Adam):
    __doc__ = "Fused drop-in for torch.optim.AdamW (same arguments and defaults)."
    _torch_cls = torch.optim.AdamW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                  foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)
        _reject("AdamW", kw)
        self._init(params, kw)

    def _structure(self, g):
        return (bool(g["amsgrad"]), bool(g["maximize"]), bool(g.get("decoupled_weight_decay", True)))


class Adagrad(FusedOptimizer):
    __doc__ = "Fused drop-in for torch.optim.Adagrad (same arguments and defaults)."
    _sig_keys = ("lr", "lr_decay", "eps", "weight_decay", "maximize")

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None):
        kw = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                  initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=foreach, maximize=maximize,
                  differentiable=differentiable, fused=fused)
        _reject("Adagrad", kw)
        super().__init__(params, _torch_defaults(torch.optim.Adagrad, kw))
        # torch's Adagrad creates its state at construction (step 0, sum = initial value)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["step"] = torch.tensor(0.0, dtype=torch.float32 if torch.get_default_dtype() != torch.float64
                                          else torch.float64)
                st["sum"] = torch.full_like(p, float(group["initial_accumulator_value"]),
                                            memory_format=torch.preserve_format)

    def _structure(self, g):
        return (bool(g["maximize"]), float(g["initial_accumulator_value"]))

    def _features(self, g):
        return frozenset({"weight_decay"}) if float(g["weight_decay"]) != 0 else frozenset()

    def _make_chain(self, key, features, groups):
        maximize, init = key
        g = groups[0]
        return _core.make_builtin("adagrad", lr=float(g["lr"]), lr_decay=float(g["lr_decay"]),
                                  weight_decay=_wd_arg(features, groups), initial_accumulator_value=init,
                                  eps=float(g["eps"]), maximize=maximize)

    def _hypers(self, g):
        return {"lr": g["lr"], "lr_decay": g["lr_decay"], "eps": g["eps"],
                "weight_decay": g["weight_decay"]}


class RMSprop(FusedOptimizer):
    __doc__ = "Fused drop-in for torch.optim.RMSprop (same arguments and defaults)."
    _sig_keys = ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize")

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 capturable=False, foreach=None, maximize=False, differentiable=False):
        kw = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, centered=centered,
                  capturable=capturable, foreach=foreach, maximize=maximize, differentiable=differentiable)
        _reject("RMSprop", kw)
        super().__init__(params, _torch_defaults(torch.optim.RMSprop, kw))

    def _structure(self, g):
        return (bool(g["centered"]), bool(g["maximize"]), float(g["momentum"]) != 0)

    def _features(self, g):
        return frozenset({"weight_decay"}) if float(g["weight_decay"]) != 0 else frozenset()

    def _make_chain(self, key, features, groups):
        centered, maximize, has_momentum = key
        g = groups[0]
        return _core.make_builtin("rmsprop", lr=float(g["lr"]), alpha=float(g["alpha"]), eps=float(g["eps"]),
                                  weight_decay=_wd_arg(features, groups),
                                  momentum=float(g["momentum"]) if has_momentum else 0.0,
                                  centered=centered, maximize=maximize)

    def _hypers(self, g):
        return {"lr": g["lr"], "alpha": g["alpha"], "eps": g["eps"],
                "weight_decay": g["weight_decay"], "momentum": g["momentum"]}


class Lion(FusedOptimizer):
    """Lion (Chen et al. 2023) as lion-pytorch: lr=1e-4, betas=(0.9, 0.99), weight_decay=0
    (decoupled: p *= 1 - lr*wd). State per parameter: exp_avg (no step, as lion-pytorch)."""

    _step_in_state = False
    _sig_keys = ("lr", "betas", "weight_decay")

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        if not lr > 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"Invalid betas: {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _features(self, g):
        return frozenset({"weight_decay"}) if float(g["weight_decay"]) != 0 else frozenset()

    def _make_chain(self, key, features, groups):
        g = groups[0]
        b1, b2 = (float(b) for b in g["betas"])
        return _core.make_builtin("lion", lr=float(g["lr"]), betas=(b1, b2), weight_decay=_wd_arg(features, groups))

    def _hypers(self, g):
        b1, b2 = g["betas"]
        return {"lr": g["lr"], "b1": b1, "b2": b2, "weight_decay": g["weight_decay"]}
