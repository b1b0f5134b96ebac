"""Drop-in replacements for timm.optim.Lamb and timm.optim.Lars (timm 1.0): the same constructor
arguments and defaults, param_groups keys and state_dict format (Lamb keeps its step count in each
param group, as timm does; neither keeps a per-parameter step). Their per-tensor norms are optfuse
per-tensor reductions: LAMB is three passes over memory (the global gradient norm, the per-tensor
norms, the update), LARS two. timm need not be installed."""
import torch

from .. import _core
from ._base import FusedOptimizer, OptfuseError, _plain, _scalar_dtype
from ._optimizers import MomentumFromFirstGradient


def _check_scalar(name, value):
    v = float(value) if torch.is_tensor(value) else value
    if not v >= 0.0:
        raise ValueError(f"Invalid {name}: {value}")


def _flag(v):
    return 1.0 if v else 0.0


class Lamb(FusedOptimizer):
    """Fused drop-in for timm.optim.Lamb (LAMB with timm's options: global gradient-norm clipping
    max_grad_norm (None: off), trust_clip, always_adapt, decoupled_decay, corrected_weight_decay).
    caution=True is refused (it needs a per-tensor mean of a mask optfuse does not compute yet)."""

    _step_in_state = False  # timm keeps group["step"], not state["step"]
    _sig_keys = ("lr", "betas", "eps", "weight_decay", "bias_correction", "grad_averaging", "trust_clip",
                 "always_adapt", "decoupled_decay", "corrected_weight_decay", "max_lr_snapshot", "caution")

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 grad_averaging=True, max_grad_norm=1.0, trust_clip=False, always_adapt=False, caution=False,
                 decoupled_decay=False, corrected_weight_decay=False, foreach=None):
        _check_scalar("learning rate", lr)
        _check_scalar("epsilon", eps)
        _check_scalar("weight_decay", weight_decay)
        if max_grad_norm is not None and not float(max_grad_norm) > 0:
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (a positive number, or None for no clipping)")
        max_lr = float(lr)
        if corrected_weight_decay and max_lr <= 0:
            raise ValueError("corrected_weight_decay requires a positive initial lr")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm, trust_clip=trust_clip,
                        always_adapt=always_adapt, caution=caution, decoupled_decay=decoupled_decay,
                        corrected_weight_decay=corrected_weight_decay, max_lr_snapshot=max_lr, foreach=foreach)
        super().__init__(params, defaults)

    def _structure(self, g):
        if g.get("caution"):
            raise OptfuseError("Lamb: caution=True is not supported (it scales each update by a per-tensor mean of a "
                               "sign mask, which optfuse does not compute yet)")
        return ()  # one chain for every group: timm's gradient norm spans all of them

    def _make_chain(self, key, features, groups):
        mgn = self.defaults["max_grad_norm"]
        return _core.make_builtin("lamb", max_grad_norm=0.0 if mgn is None else float(mgn))

    def _hypers(self, g):
        b1, b2 = g["betas"]
        decoupled = bool(g.get("decoupled_decay", False))
        max_lr = float(g["max_lr_snapshot"]) if decoupled and g.get("corrected_weight_decay") else 0.0
        return {"lr": g["lr"], "b1": b1, "b2": b2, "eps": g["eps"], "weight_decay": g["weight_decay"],
                "bias_correction": _flag(g["bias_correction"]), "grad_averaging": _flag(g["grad_averaging"]),
                "decoupled_decay": _flag(decoupled), "trust_clip": _flag(g["trust_clip"]),
                "always_adapt": _flag(g["always_adapt"]), "max_lr": max_lr}

    def _rebuild(self):
        # Parameters not counted yet start from their group's step (timm's format, e.g. after load_state_dict).
        for g in self.param_groups:
            if "step" in g:
                for p in g["params"]:
                    self._steps.setdefault(p, int(_plain(g["step"])))
        super()._rebuild()
        devices = {device for _, device, _ in self._engines}
        if self.defaults["max_grad_norm"] is not None and len(devices) > 1:
            raise OptfuseError(f"Lamb: parameters on several devices ({sorted(map(str, devices))}) with max_grad_norm "
                               "set: the global gradient norm would be computed per device. Put the parameters on "
                               "one device, or pass max_grad_norm=None.")

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._fill_missing_options()

    def __setstate__(self, state):
        super().__setstate__(state)
        self._fill_missing_options()

    def _fill_missing_options(self):
        # State dicts of older timm releases lack the newer options (timm's own __setstate__ does this too).
        for g in self.param_groups:
            for key, value in (("caution", False), ("decoupled_decay", False), ("corrected_weight_decay", False),
                               ("max_lr_snapshot", self.defaults["max_lr_snapshot"]), ("foreach", None)):
                g.setdefault(key, value)

    def state_dict(self):
        self._sync_steps()
        for g in self.param_groups:
            counts = [self._steps[p] for p in g["params"] if p in self._steps]
            if counts:
                g["step"] = torch.tensor(float(max(counts)), dtype=_scalar_dtype())
        return super().state_dict()


class Lars(MomentumFromFirstGradient, FusedOptimizer):
    """Fused drop-in for timm.optim.Lars (LARS, and LARC with trust_clip=True)."""

    _step_in_state = False  # timm's Lars state is only momentum_buffer
    _sig_keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "trust_coeff", "eps", "trust_clip",
                 "always_adapt")

    def __init__(self, params, lr=1.0, momentum=0, dampening=0, weight_decay=0, nesterov=False, trust_coeff=0.001,
                 eps=1e-8, trust_clip=False, always_adapt=False, foreach=None):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, trust_coeff=trust_coeff, eps=eps, trust_clip=trust_clip,
                                      always_adapt=always_adapt, foreach=foreach))

    def _structure(self, g):
        return (float(g["momentum"]) != 0, bool(g["nesterov"]))

    def _make_chain(self, key, features, groups):
        has_momentum, nesterov = key
        g = groups[0]
        return _core.make_builtin("lars", lr=float(g["lr"]), momentum=float(g["momentum"]) if has_momentum else 0.0,
                                  dampening=float(g["dampening"]) if has_momentum else 0.0, nesterov=nesterov)

    def _hypers(self, g):
        return {"lr": g["lr"], "momentum": g["momentum"], "dampening": g["dampening"],
                "weight_decay": g["weight_decay"], "trust_coeff": g["trust_coeff"], "eps": g["eps"],
                "trust_clip": _flag(g["trust_clip"]), "always_adapt": _flag(g["always_adapt"])}
