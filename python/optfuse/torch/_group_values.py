"""The values of a torch param group as the engines see them: numbers on the host (a CUDA tensor's
value read once, when the optimizer first sees it: a DeviceValue), and the keys that decide whether
a group changed between steps. No optimizer state here: pure functions of torch's objects."""
import torch
from torch.utils.weak import WeakIdKeyDictionary

def _scalar_dtype():
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _plain(v):
    return v.detach().item() if torch.is_tensor(v) else v


class DeviceValue(float):
    """The value a CUDA-tensor hyperparameter had when the optimizer first saw it (see the module
    docstring); the kernel reads the tensor itself. Optional rules treat it as present even at 0."""


# CUDA tensor -> DeviceValue, by identity (a WeakKeyDictionary would compare tensors with ==: a
# device read, the very wait this avoids)
_FIRST_SEEN = WeakIdKeyDictionary()


def _host_number(v):
    """A one-element CUDA tensor as its DeviceValue (read from the device the first time only); any
    other value unchanged."""
    if torch.is_tensor(v) and v.is_cuda and v.numel() == 1:
        x = _FIRST_SEEN.get(v)
        if x is None:
            x = _FIRST_SEEN[v] = DeviceValue(v.item())
        return x
    return v


def _host_view(g):
    """The group as the chain is built from it: CUDA-tensor values (alone or in a tuple, as betas)
    replaced by their DeviceValues, so that nothing built from it reads the device."""
    def host(v):
        if isinstance(v, tuple):
            return tuple(_host_number(x) for x in v)
        return _host_number(v)
    return {k: (v if k == "params" else host(v)) for k, v in g.items()}


def _sig_key(v):
    """What decides whether a group value changed: the value itself for numbers and CPU tensors
    (read with no device round trip), the tensor's identity for CUDA tensors (the kernel reads
    them in place, so a fill_ needs no push)."""
    if torch.is_tensor(v):
        return ("tensor", id(v)) if v.is_cuda else v.detach().item()
    if isinstance(v, (tuple, list)):
        return tuple(_sig_key(x) for x in v)
    return v




def _is_dense(t):
    """Non-overlapping and without gaps (contiguous, channels_last, any permutation): the kernel may
    then walk its memory linearly, provided every role of the parameter has the same strides."""
    if t.is_contiguous():
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expect = 1
    for stride, size in dims:
        if stride != expect:
            return False
        expect *= size
    return True

