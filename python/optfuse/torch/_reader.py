"""How the per-step check reads torch tensors: optfuse._torch_reader where it was built for this very
torch and reads every probe tensor exactly as torch does, else torch.Tensor's DLPack C exchange API
(torch >= 2.10), else Python method calls. See python/bindings/torch_reader.cpp for why the first
exists (the check reads every parameter, gradient and state tensor of a step: about 600 tensors for
GPT-2, at 90-110 ns each through the exchange API, a few through the reader).

OPTFUSE_TORCH_READER=0 in the environment leaves the reader out (the exchange API alone).
"""
import logging
import os

import torch

from .. import _core

_log = logging.getLogger("optfuse")

# Gradients are read through torch.Tensor's DLPack C exchange API where torch has it (>= 2.10): a C
# call per gradient instead of Python method calls (python/bindings/dlpack_exchange.h).
HAS_DLPACK_EXCHANGE = _core._set_torch_exchange(torch.Tensor)

# DLPack's (code, bits) of the dtypes the reader describes (dlpack.h's kDLInt 0, kDLUInt 1, kDLFloat
# 2, kDLBfloat 4, kDLComplex 5, kDLBool 6), to compare with torch's answer where there is no
# exchange API to ask.
_DLPACK_DTYPES = {torch.float32: (2, 32), torch.float64: (2, 64), torch.float16: (2, 16), torch.bfloat16: (4, 16),
                  torch.complex64: (5, 64), torch.complex128: (5, 128), torch.int16: (0, 16), torch.int32: (0, 32),
                  torch.int64: (0, 64),
                  torch.int8: (0, 8), torch.uint8: (1, 8), torch.bool: (6, 8)}


def _probes():
    """Tensors of every kind the reader takes: dtypes, views with offsets and strides, 0-dim,
    empty, a Parameter; and kinds it must leave to torch (conjugate, negative views)."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    out = [base, base[1:, 2:], base.t(), base[:, ::2], base[2], base[1, 3], torch.empty(0), torch.empty(3, 0),
           torch.nn.Parameter(torch.ones(5)), base.unsqueeze(1).expand(4, 3, 6)]
    out += [torch.ones(3, 2, dtype=d) for d in _DLPACK_DTYPES]
    c = torch.ones(4, dtype=torch.complex64)
    out += [c.conj(), torch.ones(4, dtype=torch.complex64)._neg_view() if hasattr(c, "_neg_view") else c]
    return out


def _as_torch_says(t):
    """t's layout as torch's Python API states it, in _core._read_layout's form (None: the reader
    must leave it to torch)."""
    if t.is_conj() or t.is_neg() or t.dtype not in _DLPACK_DTYPES:
        return None
    code, bits = _DLPACK_DTYPES[t.dtype]
    device = (1, 0) if t.device.type == "cpu" else (2, t.device.index)
    return (t.data_ptr(), code, bits, 1) + device + (tuple(t.shape), tuple(t.stride()))


_why_not = "optfuse._torch_reader is in use"


def why_not():
    """Why optfuse._torch_reader is not in use (or that it is)."""
    return _why_not


def _left_out(reason):
    global _why_not
    _why_not = reason
    return False


def install():
    """Puts optfuse._torch_reader in front of the exchange API where it may be; returns whether it is."""
    global _why_not
    if os.environ.get("OPTFUSE_TORCH_READER", "1") == "0":
        return _left_out("OPTFUSE_TORCH_READER=0 in the environment")
    try:
        from .. import _torch_reader
    except ImportError as e:  # (built without torch importable, or against a torch whose libc10 differs)
        return _left_out(f"optfuse._torch_reader is not importable ({e}): optfuse was built where torch was not "
                         "importable (pip's build isolation; install with --no-build-isolation)")
    if _torch_reader.TORCH_VERSION != torch.__version__:
        _log.info("optfuse._torch_reader was built for torch %s, this is %s: tensors are read through torch's "
                  "DLPack exchange API (reinstall optfuse to build it for this torch)",
                  _torch_reader.TORCH_VERSION, torch.__version__)
        return _left_out(f"optfuse._torch_reader was built for torch {_torch_reader.TORCH_VERSION}, "
                         f"this is {torch.__version__}")
    _core._set_torch_reader(_torch_reader.install(torch.Tensor, torch.nn.Parameter))
    for t in _probes():
        expected = _as_torch_says(t)
        got = _core._read_layout(t, "reader")
        if got != expected:
            _core._set_torch_reader(None)
            reason = (f"optfuse._torch_reader read a probe tensor ({t.dtype}, {tuple(t.shape)}, stride {t.stride()}) "
                      f"as {got} where torch says {expected}")
            _log.warning("%s: left out; tensors are read through torch's DLPack exchange API", reason)
            return _left_out(reason)
    _why_not = "optfuse._torch_reader is in use"
    return True


HAS_TORCH_READER = install()


def read_through(mode):
    """How tensors are read from now on (for tests and comparisons): "reader" (optfuse._torch_reader,
    then the exchange API), "exchange" (the exchange API alone), "methods" (Python method calls) or
    "default" (what import chose). Returns whether that mode is available. Tables already built keep
    the exchange table they were built with, but the reader is consulted at every read."""
    if mode not in ("reader", "exchange", "methods", "default"):
        raise ValueError(f"read_through: mode is reader, exchange, methods or default, not {mode!r}")
    exchange = _core._set_torch_exchange(None if mode == "methods" else torch.Tensor)
    if mode in ("exchange", "methods") or (mode == "default" and not HAS_TORCH_READER):
        _core._set_torch_reader(None)
        return mode != "exchange" or exchange
    return install() if mode == "reader" or HAS_TORCH_READER else True
