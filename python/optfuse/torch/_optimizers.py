"""Drop-in replacements for torch.optim.SGD, Adam, AdamW, Adagrad, RMSprop, RAdam, NAdam, Adamax, Adadelta,
Rprop, ASGD, Lion (as lion-pytorch) and AdEMAMix (as apple/ml-ademamix), built from optfuse's registry of named optimizers (the
same chains as C++ and SPEC text). Constructor arguments, defaults and validation are torch's own:
each class asks the torch class it replaces for its defaults dict, so param_groups and state_dict
have exactly torch's keys for the installed torch version (`foreach`, `fused` and `capturable` are
kept but ignored)."""
import torch

from .. import _core
from ._base import DeviceValue, FusedOptimizer, OptfuseError, _plain, _scalar_dtype


def _torch_defaults(cls, kwargs):
    """The defaults dict torch's own class builds from these arguments, with torch's errors (e.g.
    "`fused` does not support `differentiable`"). differentiable=True is accepted: those groups are
    stepped by torch's own class (FusedOptimizer._step_differentiable)."""
    dummy = torch.zeros(1, requires_grad=True)
    return cls([dummy], **kwargs).defaults


def _wd_arg(features, groups):
    """weight_decay for the chain: a non-zero value when some group needs the rule (each group's own
    value is pushed or bound as a hyperparameter afterwards), else 0 so the rule is left out."""
    if "weight_decay" not in features:
        return 0.0
    # (all zero: a CUDA tensor that is 0 now; the kernel reads the tensor)
    return next((float(g["weight_decay"]) for g in groups if float(g["weight_decay"]) != 0), 1.0)


class _OptionalWeightDecay(FusedOptimizer):
    """Optimizers whose weight decay is a rule of its own, left out of the chain when every group of
    the chain has weight_decay 0 (the rule costs nothing then, not even a read of the parameter)."""

    def _features(self, g):
        wd = g["weight_decay"]
        return frozenset({"weight_decay"}) if isinstance(wd, DeviceValue) or float(wd) != 0 else frozenset()


class MomentumFromFirstGradient:
    """Step counting of optimizers whose state is only a momentum_buffer that starts as the first
    gradient (torch's SGD, timm's Lars): no 'step' in the state, so a parameter with a buffer has
    stepped, and one without restarts its count (the trace rule starts the buffer on step 1)."""

    def _initial_step(self, state):
        return 1 if "momentum_buffer" in state else 0

    def _adjust_step(self, state, step, engine):
        if "momentum_buffer" in engine.state_names and "momentum_buffer" not in state:
            return 0
        return step


class SGD(MomentumFromFirstGradient, _OptionalWeightDecay):
    __doc__ = "Fused drop-in for torch.optim.SGD (same arguments and defaults)."
    _step_in_state = False  # torch's SGD state is only momentum_buffer
    _sig_keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None):
        kw = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                  maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        super().__init__(params, _torch_defaults(torch.optim.SGD, kw))

    def _structure(self, g):
        return (bool(g["maximize"]), float(g["momentum"]) != 0, bool(g["nesterov"]))

    def _make_chain(self, key, features, groups):
        maximize, has_momentum, nesterov = key
        g = groups[0]
        return _core.make_builtin("sgd", lr=float(g["lr"]), momentum=float(g["momentum"]) if has_momentum else 0.0,
                                  dampening=float(g["dampening"]) if has_momentum else 0.0,
                                  weight_decay=_wd_arg(features, groups), nesterov=nesterov, maximize=maximize)

    def _hypers(self, g):
        return {"lr": g["lr"], "momentum": g["momentum"], "dampening": g["dampening"],
                "weight_decay": g["weight_decay"]}


class Adam(_OptionalWeightDecay):
    __doc__ = "Fused drop-in for torch.optim.Adam (same arguments and defaults)."
    _sig_keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
    _torch_cls = torch.optim.Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None, **extra):
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, foreach=foreach,
                  maximize=maximize, capturable=capturable, differentiable=differentiable, fused=fused, **extra)
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
        self._init(params, kw)

    def _structure(self, g):
        return (bool(g["amsgrad"]), bool(g["maximize"]), bool(g.get("decoupled_weight_decay", True)))


class Adagrad(_OptionalWeightDecay):
    __doc__ = "Fused drop-in for torch.optim.Adagrad (same arguments and defaults)."
    _sig_keys = ("lr", "lr_decay", "eps", "weight_decay", "maximize")

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None):
        kw = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                  initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=foreach, maximize=maximize,
                  differentiable=differentiable, fused=fused)
        super().__init__(params, _torch_defaults(torch.optim.Adagrad, kw))
        # torch's Adagrad creates its state at construction (step 0, sum = initial value)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["step"] = torch.tensor(0.0, dtype=torch.float32 if torch.get_default_dtype() != torch.float64
                                          else torch.float64)
                init = float(group["initial_accumulator_value"])
                # (a complex parameter's sum: init in both parts, as torch's)
                st["sum"] = torch.full_like(p, complex(init, init) if torch.is_complex(p) else init,
                                            memory_format=torch.preserve_format)

    def _structure(self, g):
        return (bool(g["maximize"]), float(g["initial_accumulator_value"]))

    def _make_chain(self, key, features, groups):
        maximize, init = key
        g = groups[0]
        return _core.make_builtin("adagrad", lr=float(g["lr"]), lr_decay=float(g["lr_decay"]),
                                  weight_decay=_wd_arg(features, groups), initial_accumulator_value=init,
                                  eps=float(g["eps"]), maximize=maximize)

    def _hypers(self, g):
        return {"lr": g["lr"], "lr_decay": g["lr_decay"], "eps": g["eps"],
                "weight_decay": g["weight_decay"]}


class RMSprop(_OptionalWeightDecay):
    __doc__ = "Fused drop-in for torch.optim.RMSprop (same arguments and defaults)."
    _sig_keys = ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize")

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 capturable=False, foreach=None, maximize=False, differentiable=False):
        kw = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, centered=centered,
                  capturable=capturable, foreach=foreach, maximize=maximize, differentiable=differentiable)
        super().__init__(params, _torch_defaults(torch.optim.RMSprop, kw))

    def _structure(self, g):
        return (bool(g["centered"]), bool(g["maximize"]), float(g["momentum"]) != 0)

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


class Lion(_OptionalWeightDecay):
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

    def _make_chain(self, key, features, groups):
        g = groups[0]
        b1, b2 = (float(b) for b in g["betas"])
        return _core.make_builtin("lion", lr=float(g["lr"]), betas=(b1, b2), weight_decay=_wd_arg(features, groups))

    def _hypers(self, g):
        b1, b2 = g["betas"]
        return {"lr": g["lr"], "b1": b1, "b2": b2, "weight_decay": g["weight_decay"]}


class _DecoupledWeightDecayOption(_OptionalWeightDecay):
    """RAdam's and NAdam's structure: maximize and decoupled_weight_decay, an option newer than some
    state dicts (torch fills it in on load, and so do we)."""

    def __setstate__(self, state):
        super().__setstate__(state)
        for g in self.param_groups:
            g.setdefault("decoupled_weight_decay", False)

    def _structure(self, g):
        return (bool(g["maximize"]), bool(g["decoupled_weight_decay"]))


class RAdam(_DecoupledWeightDecayOption):
    __doc__ = "Fused drop-in for torch.optim.RAdam (same arguments and defaults)."
    _sig_keys = ("lr", "betas", "eps", "weight_decay", "maximize", "decoupled_weight_decay")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, decoupled_weight_decay=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False):
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
                  foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable)
        super().__init__(params, _torch_defaults(torch.optim.RAdam, kw))

    def _make_chain(self, key, features, groups):
        maximize, decoupled = key
        g = groups[0]
        b1, b2 = (float(b) for b in g["betas"])
        return _core.make_builtin("radam", lr=float(g["lr"]), betas=(b1, b2), eps=float(g["eps"]),
                                  weight_decay=_wd_arg(features, groups), decoupled_weight_decay=decoupled,
                                  maximize=maximize)

    def _hypers(self, g):
        b1, b2 = g["betas"]
        return {"lr": g["lr"], "b1": b1, "b2": b2, "eps": g["eps"], "weight_decay": g["weight_decay"]}


class NAdam(_DecoupledWeightDecayOption):
    """Fused drop-in for torch.optim.NAdam (same arguments and defaults, state keys step, mu_product,
    exp_avg, exp_avg_sq). mu_product is a uniform state of the core (one value per internal group,
    committed on the device where the step is not skipped, so a GradScaler's skipped step keeps it);
    it is seeded from each parameter's state and written back into it by state_dict()."""
    _sig_keys = ("lr", "betas", "eps", "weight_decay", "momentum_decay", "maximize", "decoupled_weight_decay")

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, *, foreach=None, maximize=False, capturable=False, differentiable=False):
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay,
                  decoupled_weight_decay=decoupled_weight_decay, foreach=foreach, maximize=maximize,
                  capturable=capturable, differentiable=differentiable)
        super().__init__(params, _torch_defaults(torch.optim.NAdam, kw))

    def _make_chain(self, key, features, groups):
        maximize, decoupled = key
        g = groups[0]
        b1, b2 = (float(b) for b in g["betas"])
        return _core.make_builtin("nadam", lr=float(_plain(g["lr"])), betas=(b1, b2), eps=float(g["eps"]),
                                  weight_decay=_wd_arg(features, groups), momentum_decay=float(g["momentum_decay"]),
                                  decoupled_weight_decay=decoupled, maximize=maximize)

    def _hypers(self, g):
        b1, b2 = g["betas"]
        return {"lr": g["lr"], "b1": b1, "b2": b2, "eps": g["eps"], "weight_decay": g["weight_decay"],
                "momentum_decay": g["momentum_decay"]}


class Adamax(_OptionalWeightDecay):
    __doc__ = "Fused drop-in for torch.optim.Adamax (same arguments and defaults)."
    _sig_keys = ("lr", "betas", "eps", "weight_decay", "maximize")

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *,
                 maximize=False, differentiable=False, capturable=False):
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach, maximize=maximize,
                  differentiable=differentiable, capturable=capturable)
        super().__init__(params, _torch_defaults(torch.optim.Adamax, kw))

    def _structure(self, g):
        return (bool(g["maximize"]),)

    def _make_chain(self, key, features, groups):
        (maximize,) = key
        g = groups[0]
        b1, b2 = (float(b) for b in g["betas"])
        return _core.make_builtin("adamax", lr=float(g["lr"]), betas=(b1, b2), eps=float(g["eps"]),
                                  weight_decay=_wd_arg(features, groups), maximize=maximize)

    def _hypers(self, g):
        b1, b2 = g["betas"]
        return {"lr": g["lr"], "b1": b1, "b2": b2, "eps": g["eps"], "weight_decay": g["weight_decay"]}


class Adadelta(_OptionalWeightDecay):
    __doc__ = "Fused drop-in for torch.optim.Adadelta (same arguments and defaults)."
    _sig_keys = ("lr", "rho", "eps", "weight_decay", "maximize")

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach=None, *, capturable=False,
                 maximize=False, differentiable=False):
        kw = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, foreach=foreach, capturable=capturable,
                  maximize=maximize, differentiable=differentiable)
        super().__init__(params, _torch_defaults(torch.optim.Adadelta, kw))

    def _structure(self, g):
        return (bool(g["maximize"]),)

    def _make_chain(self, key, features, groups):
        (maximize,) = key
        g = groups[0]
        return _core.make_builtin("adadelta", lr=float(g["lr"]), rho=float(g["rho"]), eps=float(g["eps"]),
                                  weight_decay=_wd_arg(features, groups), maximize=maximize)

    def _hypers(self, g):
        return {"lr": g["lr"], "rho": g["rho"], "eps": g["eps"], "weight_decay": g["weight_decay"]}


class Rprop(FusedOptimizer):
    """Fused drop-in for torch.optim.Rprop (same arguments and defaults). A parameter's step sizes
    start at the group's lr on its first step, as in torch; later lr changes do not affect them."""
    _sig_keys = ("lr", "etas", "step_sizes", "maximize")

    def __init__(self, params, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), *, capturable=False, foreach=None,
                 maximize=False, differentiable=False):
        kw = dict(lr=lr, etas=etas, step_sizes=step_sizes, capturable=capturable, foreach=foreach, maximize=maximize,
                  differentiable=differentiable)
        super().__init__(params, _torch_defaults(torch.optim.Rprop, kw))

    def _structure(self, g):
        return (bool(g["maximize"]),)

    def _make_chain(self, key, features, groups):
        (maximize,) = key
        g = groups[0]
        etaminus, etaplus = (float(e) for e in g["etas"])
        lo, hi = (float(s) for s in g["step_sizes"])
        return _core.make_builtin("rprop", lr=float(g["lr"]), etas=(etaminus, etaplus), step_sizes=(lo, hi),
                                  maximize=maximize)

    def _hypers(self, g):
        etaminus, etaplus = g["etas"]
        lo, hi = g["step_sizes"]
        return {"lr": g["lr"], "etaminus": etaminus, "etaplus": etaplus, "step_size_min": lo, "step_size_max": hi}


def _warmup_steps(name, v):
    """A warm-up length: None (no warm-up, 0 for the kernel) or a number of steps >= 0."""
    if v is None:
        return 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ValueError(f"Invalid {name} value: {v!r} (None or a number of steps >= 0)")
    return float(v)


class AdEMAMix(_OptionalWeightDecay):
    """AdEMAMix (Pagliardini, Ablin, Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, Older"),
    with the arguments, defaults, param_group keys and state keys of its reference implementation
    (apple/ml-ademamix, pytorch/ademamix.py): betas=(b1, b2, b3), alpha, beta3_warmup and
    alpha_warmup (None: no warm-up), eps, weight_decay; state step, exp_avg_fast, exp_avg_slow,
    exp_avg_sq. t_alpha_beta3 (keyword only) sets both warm-ups to one length, as other ports write it.

    Per step t: m1 = b1 m1 + (1-b1) g; m2 = b3_t m2 + (1-b3_t) g; nu = b2 nu + (1-b2) g^2;
    p -= lr * ((m1 / (1-b1^t) + alpha_t m2) / (sqrt(nu) / sqrt(1-b2^t) + eps) + weight_decay p),
    with alpha_t rising linearly from 0 and b3_t from b1 (linearly in half-life) over their warm-ups.
    Every value here is a runtime hyperparameter: changing any of them never recompiles.
    The reference's step is a Python int; here it is a 0-dim tensor, as torch.optim's (both load)."""

    _sig_keys = ("lr", "betas", "alpha", "beta3_warmup", "alpha_warmup", "eps", "weight_decay")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=2.0, beta3_warmup=None,
                 alpha_warmup=None, eps=1e-8, weight_decay=0, *, t_alpha_beta3=None):
        if t_alpha_beta3 is not None:
            if beta3_warmup is not None or alpha_warmup is not None:
                raise ValueError("AdEMAMix: give t_alpha_beta3 or beta3_warmup/alpha_warmup, not both")
            beta3_warmup = alpha_warmup = t_alpha_beta3
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 3:
            raise ValueError(f"Invalid betas: {betas} (three values: b1, b2, b3)")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not 0.0 <= alpha:
            raise ValueError(f"Invalid alpha value: {alpha}")
        _warmup_steps("beta3_warmup", beta3_warmup)
        _warmup_steps("alpha_warmup", alpha_warmup)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, alpha=alpha, beta3_warmup=beta3_warmup,
                                      alpha_warmup=alpha_warmup, weight_decay=weight_decay))

    def _make_chain(self, key, features, groups):
        g = groups[0]
        b1, b2, b3 = (float(b) for b in g["betas"])
        return _core.make_builtin("ademamix", lr=float(_plain(g["lr"])), betas=(b1, b2, b3), alpha=float(g["alpha"]),
                                  t_beta3=_warmup_steps("beta3_warmup", g["beta3_warmup"]),
                                  t_alpha=_warmup_steps("alpha_warmup", g["alpha_warmup"]), eps=float(g["eps"]),
                                  weight_decay=_wd_arg(features, groups))

    def _hypers(self, g):
        b1, b2, b3 = g["betas"]
        return {"lr": g["lr"], "b1": b1, "b2": b2, "b3": b3, "alpha": g["alpha"], "eps": g["eps"],
                "t_beta3": _warmup_steps("beta3_warmup", g["beta3_warmup"]),
                "t_alpha": _warmup_steps("alpha_warmup", g["alpha_warmup"]),
                "weight_decay": g["weight_decay"]}


class ASGD(_OptionalWeightDecay):
    """Fused drop-in for torch.optim.ASGD (same arguments and defaults, state keys step, eta, mu, ax).

    torch keeps eta and mu per parameter (0-dim float32 tensors on the parameter's device), starts
    them at lr and 1, and at the end of every step sets them from the new step count and the group's
    lr, lambd, alpha and t0 of that step. Here they are uniform states of the rule averaged_sgd (one
    value per internal group, as NAdam's mu_product): a step uses the values the previous one left
    and commits new ones where it is not skipped (a GradScaler's skipped step keeps them, as torch,
    which does not step). They are seeded from each parameter's eta and mu when the tables are built
    and written back by state_dict()."""

    _sig_keys = ("lr", "lambd", "alpha", "t0", "weight_decay", "maximize")

    def __init__(self, params, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0, foreach=None, maximize=False,
                 differentiable=False, capturable=False):
        kw = dict(lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay, foreach=foreach,
                  maximize=maximize, differentiable=differentiable, capturable=capturable)
        super().__init__(params, _torch_defaults(torch.optim.ASGD, kw))

    def _structure(self, g):
        return (bool(g["maximize"]),)

    def _make_chain(self, key, features, groups):
        (maximize,) = key
        g = groups[0]
        return _core.make_builtin("asgd", lr=float(g["lr"]), lambd=float(g["lambd"]), alpha=float(g["alpha"]),
                                  t0=float(g["t0"]), weight_decay=_wd_arg(features, groups), maximize=maximize)

    def _hypers(self, g):
        return {"lr": g["lr"], "lambd": g["lambd"], "alpha": g["alpha"], "t0": g["t0"],
                "weight_decay": g["weight_decay"]}

    def _rebuild(self):
        self.__dict__["_asgd_group_of"] = {id(q): g for g in self.param_groups for q in g["params"]}
        try:
            super()._rebuild()
        finally:
            del self.__dict__["_asgd_group_of"]

    def _states_for(self, p, st, engine, prec):
        if "eta" not in st:  # torch's keys, order and initial values: step 0, eta = lr, mu = 1, ax = 0
            if "step" not in st:
                st["step"] = torch.tensor(float(self._steps.get(p, 0)), dtype=_scalar_dtype())
            lr = _plain(self._asgd_group_of[id(p)]["lr"])
            self._put_ustate(p, st, "eta", torch.as_tensor(lr, device=p.device, dtype=_scalar_dtype()).clone().detach())
            self._put_ustate(p, st, "mu", torch.ones((), device=p.device, dtype=_scalar_dtype()))
        return super()._states_for(p, st, engine, prec)

    def _torch_step_on_device(self, group):
        return True  # (torch.optim.ASGD keeps every step on the parameter's device)
