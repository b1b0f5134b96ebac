"""torch.compile support: the fused step as a torch custom op, optfuse::fused_step.

Under Dynamo, FusedOptimizer.step() does not run: it is traced. The traced code (FusedOptimizer.
_step_graph) checks, in Python that Dynamo turns into guards, that the tables built by the last
eager step still fit (every parameter of the tables has a gradient laid out like it, no other
parameter has one, no group changed its structure), collects the tensors in table order and calls
this op, so the step stays inside the graph: no graph break, and a tensor lr is a graph input (a
scheduler's fill_ never recompiles). Anything else (the first step, a rebuild, a closure, hooks)
calls the eager step through torch._dynamo.disable: one graph break, then the next call retraces.

mutates_args is exact: the parameters and the states, nothing else (gradients, hyperparameter
tensors, grad_scale and found_inf are only read; the engine's step counters are its own memory).
Under functionalization the op may be handed copies of the parameters and states (the results are
copied back afterwards), and hyperparameter tensors that are not the ones in param_groups (a
scheduler's fill_ traced in the same graph): the op acts on the tensors it is passed. It re-points
the tables at them (Optimizer::set_pointers, only when a pointer differs) and binds the
hyperparameter tensors given; the next eager step points the tables back at the optimizer's own
tensors (FusedOptimizer._restore_home).

CUDA graphs (mode="reduce-overhead"): the op is tagged cudagraph_unsafe where torch has the tag, so
Inductor keeps it out of its CUDA graphs (the step runs as an op call between graph partitions): a
replay never reads hyperparameters or table pointers bound for another graph. Without the tag the
traced step falls back to the eager step on CUDA (a graph break, as before).
"""
import inspect
import itertools
import weakref
from typing import List, Optional

import torch

_REGISTRY = {}                 # optimizer id -> weakref to the optimizer
_ids = itertools.count(1)
_OP_NAME = "optfuse::fused_step"


def compiling():
    """True while Dynamo traces (a constant True in the traced code), False when running eagerly."""
    return _is_compiling()


def _find_is_compiling():
    for owner in (getattr(torch, "compiler", None), getattr(torch, "_dynamo", None)):
        f = getattr(owner, "is_compiling", None)
        if f is not None:
            return f
    return lambda: False


_is_compiling = _find_is_compiling()


def register(opt):
    """A new id for opt, under which the op finds it (weakly held)."""
    key = next(_ids)
    _REGISTRY[key] = weakref.ref(opt, lambda _, k=key: _REGISTRY.pop(k, None))
    return key


def _cudagraph_unsafe_tag():
    tag_cls = getattr(getattr(torch, "_C", None), "Tag", None)
    return getattr(tag_cls, "cudagraph_unsafe", None)


def _define():
    """The op, or None where this torch cannot define it (no torch.library.custom_op)."""
    library = getattr(torch, "library", None)
    custom_op = getattr(library, "custom_op", None)
    if custom_op is None:
        return None, False
    kwargs = {"mutates_args": ("params", "states")}
    tag = _cudagraph_unsafe_tag()
    tagged = False
    try:
        if tag is not None and "tags" in inspect.signature(custom_op).parameters:
            kwargs["tags"] = (tag,)
            tagged = True
    except (TypeError, ValueError):
        pass

    def fused_step(key: str, params: List[torch.Tensor], grads: List[torch.Tensor], states: List[torch.Tensor],
                   hypers: List[torch.Tensor], values: List[float], kinds: List[int],
                   grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> None:
        _run(key, params, grads, states, hypers, values, kinds, grad_scale, found_inf)

    try:
        op = custom_op(_OP_NAME, fused_step, **kwargs)
    except RuntimeError:  # already defined (this module imported twice, e.g. under two names)
        return getattr(torch.ops.optfuse, "fused_step", None), tagged
    register_fake = getattr(op, "register_fake", None)
    if register_fake is not None:
        register_fake(lambda *args: None)
    return op, tagged


def _run(key, params, grads, states, hypers, values, kinds, grad_scale, found_inf):
    from ._base import OptfuseError
    ident = int(key.split(".", 1)[0])
    ref = _REGISTRY.get(ident)
    opt = ref() if ref is not None else None
    if opt is None:
        raise OptfuseError(f"{_OP_NAME}: the optimizer this compiled step was traced for no longer exists")
    opt._step_from_graph(key, params, grads, states, hypers, values, kinds, grad_scale, found_inf)


OP, CUDAGRAPH_TAGGED = _define()
