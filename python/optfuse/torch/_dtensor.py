"""DTensor parameters (torch's FSDP2, `torch.distributed.fsdp.fully_shard`): each rank steps the local
shards of its parameters, gradients and states in the same one launch.

The optimizer keeps the DTensors where torch.optim does (param_groups, the keys of `state`, states
created with `torch.empty_like(p)`: DTensors with the parameter's mesh, placements and global shape,
so state dicts and torch.distributed.checkpoint see torch's format); the engine's tables get the
local tensors (`_local_tensor`: pointer, numel, dtype). A rank whose shard is empty steps an empty
entry. Only element-wise chains: a reduction (global-norm clip, Lamb's and Lars's per-tensor norms,
a non-finite check) over local shards would be a per-rank value, so it is refused (see
reduction_error).

No DTensor can exist before torch.distributed.tensor is imported: until then the checks here cost
one dict lookup and import nothing.
"""
import sys

import torch


def _dtensor_class():
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t):
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t):
    """The tensor the kernel steps: a DTensor's local shard (the very tensor it holds, no copy), else t."""
    return t._local_tensor if is_dtensor(t) else t


class LocalGrad:
    """What the GradWatch watches in place of a DTensor parameter: `.grad` is the local shard of the
    parameter's DTensor gradient (FSDP2 sets a new DTensor after each backward; its local tensor is
    what the kernel reads)."""
    __slots__ = ("param",)

    def __init__(self, param):
        self.param = param

    @property
    def grad(self):
        g = self.param.grad
        return None if g is None else local(g)


def check_grad(name, p, tg):
    """A DTensor parameter's gradient must be sharded as the parameter (FSDP2's reduce-scattered
    gradient): then its local tensor and the parameter's hold the same elements."""
    g = p.grad
    if not is_dtensor(g):
        raise _error(f"{name}: the parameter of shape {tuple(p.shape)} (group {tg}) is a DTensor but its gradient "
                     f"is a {type(g).__name__}; FSDP2 (fully_shard) gives DTensor gradients sharded like the parameter")
    if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements) or g.shape != p.shape:
        raise _error(f"{name}: the gradient of the DTensor parameter of shape {tuple(p.shape)} (group {tg}) has "
                     f"placements {tuple(g.placements)} (shape {tuple(g.shape)}), the parameter "
                     f"{tuple(p.placements)}: optfuse steps each rank's local shard, which needs the gradient "
                     "sharded as the parameter (reduce it first)")
    if g._local_tensor.shape != p._local_tensor.shape:
        raise _error(f"{name}: the local gradient shard of the DTensor parameter of shape {tuple(p.shape)} "
                     f"(group {tg}) has shape {tuple(g._local_tensor.shape)}, the parameter's local shard "
                     f"{tuple(p._local_tensor.shape)}")


def as_state(t, p):
    """A state tensor for DTensor parameter p from a plain tensor (a state dict saved without
    FSDP2): of p's global shape, this rank's shard of it (every rank holds the whole tensor: no
    communication); of p's local shape, taken as this rank's shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if t.shape == p.shape:
        return distribute_tensor(t.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    if t.shape == p._local_tensor.shape:
        return DTensor.from_local(t.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    raise _error(f"a state of shape {tuple(t.shape)} for the DTensor parameter of global shape {tuple(p.shape)} "
                 f"(local shard {tuple(p._local_tensor.shape)}): neither")


def reduction_error(name, scopes, p, tg):
    return _error(
        f"{name}: the chain has reductions (scopes: {', '.join(sorted(set(map(str, scopes))))}) and the parameter of shape {tuple(p.shape)} (group {tg}) is a "
        "DTensor (FSDP2 fully_shard). Each rank holds a shard cut at rows, not at optfuse's chunks, so a norm or "
        "non-finite check over the local shards would be a per-rank value, not the model's; reductions across DTensor "
        "shards are not built. Use an element-wise optimizer on DTensor parameters (clip with "
        "torch.nn.utils.clip_grad_norm_, which reduces DTensor norms over the mesh, before step()), or "
        "optfuse.torch.distributed.ZeRO, whose shards are cut at chunks and whose reductions are exact.")


def _error(msg):
    from .. import _core
    return _core.OptfuseError(msg)
