"""Checks the binding (_binding.py) makes before any memory is touched: what a step can read from
torch's objects safely and what torch itself would refuse, each refusal naming the group and the
parameter's index in it."""
import math

import torch

from .. import _core
from . import _dtensor
from ._engine import dtype_code, real_view
from ._group_values import _is_dense, _plain

OptfuseError = _core.OptfuseError


def _step_value(v):
    """A step (a number or a one-element tensor) as a float, or (None, (exception class, reason)):
    a step count is a whole number from 0 to 2**53 (NaN, inf, fractions and 1e30 are no optimizer's)."""
    if torch.is_tensor(v):
        if v.numel() != 1:
            return None, (ValueError, f"a 'step' of shape {tuple(v.shape)}; expected one number")
        v = _plain(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None, (TypeError, f"a 'step' of type {type(v).__name__}; expected a number or a one-element tensor")
    if not math.isfinite(v) or v < 0 or v != int(v) or v > 2 ** 53:
        return None, (ValueError, f"step={v!r}; a step count is a whole number from 0 to 2**53")
    return v, None


def _step_count(name, v):
    """A state's step as an int, or a clear error."""
    x, why = _step_value(v)
    if why is not None:
        raise OptfuseError(f"{name}: a parameter's state has {why[1]}")
    return int(x)


def _check_loaded_steps(name, state_dict):
    """Refuses, before anything is loaded, a step count no optimizer could have taken: torch would
    step with it and fail or go wrong later."""
    for pid, st in state_dict.get("state", {}).items():
        if isinstance(st, dict) and "step" in st:
            _, why = _step_value(st["step"])
            if why is not None:
                raise why[0](f"{name}.load_state_dict: state {pid!r} has {why[1]}")


def _check_grad(name, p, grad, tg, i):
    """Refuses, before anything is stepped, a gradient the kernel would read past or misread:
    another shape (torch raises a size mismatch) or device than its parameter, or a dtype no
    kernel reads (a gradient may have another float dtype than its parameter: param.grad_dtype)."""
    p, grad = real_view(p), real_view(grad)
    if grad.shape != p.shape:
        raise OptfuseError(f"{name}: the gradient of parameter {i} of group {tg} has shape {tuple(grad.shape)}; "
                           f"the parameter's is {tuple(p.shape)}")
    if dtype_code(grad) is None:
        raise OptfuseError(f"{name}: the gradient of parameter {i} of group {tg} is {grad.dtype}; optfuse steps "
                           "float32, float64, float16 and bfloat16 gradients")
    if grad.device != p.device:
        raise OptfuseError(f"{name}: the gradient of parameter {i} of group {tg} is on {grad.device}; the parameter "
                           f"is on {p.device}")


def _check_aliasing(name, groups):
    """Refuses a parameter listed twice (torch warns and steps it twice: the fused step reads and
    writes each element once) and parameters whose memory overlaps (views of one tensor: elements
    stepped by two threads at once)."""
    seen = {}
    spans = []
    for tg, g in enumerate(groups):
        for i, p in enumerate(g["params"]):
            if id(p) in seen:
                raise OptfuseError(f"{name}: parameter {i} of group {tg} is also parameter {seen[id(p)][1]} of group "
                                   f"{seen[id(p)][0]}; list each parameter once")
            seen[id(p)] = (tg, i)
            lp = _dtensor.local(p)
            if lp.numel() == 0 or lp.device.type == "meta" or not _is_dense(lp):
                continue  # (views with gaps may interleave without sharing an element: stepped via copies)
            span = sum((n - 1) * s for n, s in zip(lp.shape, lp.stride()) if n > 1) + 1
            start = lp.data_ptr()
            spans.append((lp.device, start, start + span * lp.element_size(), tg, i))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise OptfuseError(f"{name}: parameter {a[4]} of group {a[3]} and parameter {b[4]} of group {b[3]} share "
                               "memory (views of one tensor); optfuse steps each element once per step, so "
                               "parameters must not overlap")
