"""optfuse.torch.AdamWScheduleFree: a drop-in for the schedulefree package's AdamWScheduleFree
(Defazio et al. 2024, "The Road Less Scheduled"), one fused pass per step.

The reference keeps its schedule in the param group: the step k, the largest scheduled lr so far
lr_max, and weight_sum, the sum of the averaging weights (k+1)^r * lr_max^weight_lr_power. This
class keeps the same keys and updates them on the host exactly as the reference does (Python
floats); the kernel (rule schedule_free_adamw) gets what it needs from them as hyperparameters set
every step: ckp1 = weight / weight_sum and group_step = k + 1 (the warm-up and the bias correction
are computed from it in the rule). Everything per element (exp_avg_sq, the normalised gradient,
decay at y, y and z) is one pass over memory that writes the parameter (y) and z.

train() / eval() move the parameters between y (where gradients are taken) and x (the average) as
the reference does, with the same torch ops: p.lerp_(z, 1 - b1) and p.lerp_(z, 1 - 1/b1).
"""
import torch

from .. import _core
from ._base import FusedOptimizer, OptfuseError, _plain

_NOT_TRAIN = ("Optimizer was not in train mode when step is called. "
              "Please insert .train() and .eval() calls on the "
              "optimizer. See documentation for details.")


class AdamWScheduleFree(FusedOptimizer):
    """Schedule-free AdamW with the arguments, defaults, param_group keys (lr, betas, eps, r, k,
    warmup_steps, train_mode, weight_sum, lr_max, scheduled_lr, weight_lr_power, weight_decay,
    foreach) and state keys (z, exp_avg_sq) of schedulefree.AdamWScheduleFree (1.4). Call train()
    before training steps and eval() before evaluating or saving, as with the reference. foreach is
    stored and ignored (the step is always one fused pass).

    Per step, for each group (k its step count, t = k + 1): sched = t / warmup_steps while
    k < warmup_steps, else 1; lr_t = lr * sched; lr_max = max(lr_max, lr_t); weight_sum +=
    t^r * lr_max^weight_lr_power; ckp1 = that weight / weight_sum. Per element:
    exp_avg_sq = b2 exp_avg_sq + (1-b2) g^2; gn = g / (sqrt(exp_avg_sq / (1 - b2^t)) + eps) +
    weight_decay * y; y = lerp(y, z, ckp1) + lr_t (b1 (1 - ckp1) - 1) gn; z -= lr_t gn.

    Unlike the reference, the step leaves p.grad as it was (the reference divides it in place)."""

    _step_in_state = False              # the reference's state is z and exp_avg_sq; k is per group
    # The schedule (k, weight_sum, lr_max) advances on the host before the kernel runs, so a step
    # must not be skipped inside the kernel: GradScaler unscales and skips step() itself, as it does
    # for the reference.
    _step_supports_amp_scaling = False
    _sig_keys = ("lr", "betas", "eps", "weight_decay", "warmup_steps", "k", "weight_sum", "lr_max")

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, warmup_steps=0, r=0.0,
                 weight_lr_power=2.0, foreach=hasattr(torch, "_foreach_mul_")):
        defaults = dict(lr=lr, betas=betas, eps=eps, r=r, k=0, warmup_steps=warmup_steps, train_mode=False,
                        weight_sum=0.0, lr_max=-1.0, scheduled_lr=0.0, weight_lr_power=weight_lr_power,
                        weight_decay=weight_decay, foreach=foreach)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        g = {**self.defaults, **param_group}  # checked before the group is added: a refused one is not kept
        if g.get("master_weights") == "remainders" or g.get("kahan", False):
            what = "master_weights='remainders'" if g.get("master_weights") == "remainders" else "kahan=True"
            raise OptfuseError(f"AdamWScheduleFree: {what} is not supported: train()/eval() move the parameters "
                               "between y and x outside the kernel, which would leave the remainder or compensation "
                               "stale; use master_weights=True (a float32 master copy) instead")
        super().add_param_group(param_group)

    def _make_chain(self, key, features, groups):
        g = groups[0]
        b1, b2 = (float(b) for b in g["betas"])
        return _core.make_builtin("adamw_schedule_free", lr=float(_plain(g["lr"])), betas=(b1, b2),
                                  eps=float(g["eps"]), weight_decay=float(g["weight_decay"]),
                                  warmup_steps=float(g["warmup_steps"]))

    def _hypers(self, g):
        b1, b2 = g["betas"]
        return {"lr": float(_plain(g["lr"])), "b1": b1, "b2": b2, "eps": g["eps"],
                "weight_decay": g["weight_decay"], "warmup_steps": float(g["warmup_steps"]),
                "ckp1": _ckp1(g), "group_step": float(g["k"] + 1)}

    # --- step: the reference's group schedule on the host, then the fused pass
    def _step_impl(self, closure=None, *, grad_scale=None, found_inf=None):
        if not self.param_groups[0]["train_mode"]:
            raise Exception(_NOT_TRAIN)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            k = g["k"]
            warmup_steps = g["warmup_steps"]
            sched = (k + 1) / warmup_steps if k < warmup_steps else 1.0
            lr = _plain(g["lr"]) * sched
            g["scheduled_lr"] = lr
            lr_max = g["lr_max"] = max(lr, g["lr_max"])
            g["weight_sum"] = g["weight_sum"] + ((k + 1) ** g["r"]) * (lr_max ** g["weight_lr_power"])
        super()._step_impl(None, grad_scale=grad_scale, found_inf=found_inf)
        for g in self.param_groups:
            g["k"] = g["k"] + 1
        return loss

    # --- train / eval: y <-> x
    @torch.no_grad()
    def eval(self):
        self._switch(train=False)

    @torch.no_grad()
    def train(self):
        self._switch(train=True)

    def _switch(self, train):
        for group in self.param_groups:
            if bool(group["train_mode"]) == train:
                continue
            beta1, _ = group["betas"]
            weight = 1 - beta1 if train else 1 - 1 / beta1
            for p in group["params"]:
                state = self.state[p]
                if "z" in state:
                    master = state.get("master_param")
                    if master is not None:  # the float32 master is the parameter the kernel steps
                        master.lerp_(end=state["z"].to(master.device), weight=weight)
                        p.copy_(master)
                    else:
                        p.lerp_(end=state["z"].to(p.device), weight=weight)
            group["train_mode"] = train


def _ckp1(g):
    """The weight of the newest z in the average at the step being taken (the reference's
    weight / weight_sum, after the host has added this step's weight). -1 (the rule's 1/t) before
    any step has set the group's schedule."""
    if g["lr_max"] < 0:
        return -1.0
    k = g["k"]
    weight = ((k + 1) ** g["r"]) * (g["lr_max"] ** g["weight_lr_power"])
    try:
        return weight / g["weight_sum"]
    except ZeroDivisionError:
        return 0.0
