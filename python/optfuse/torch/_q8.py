"""q8 states (state_dtype=torch.int8): each is one 1-D torch.int8 tensor of
_core.q8_storage_bytes(numel) bytes: the block-quantized codes, then the block scales as float32
(the format is optfuse/dtype.h's; the kernels encode and decode it). Here: the conversions the front
end needs outside a step (a float state loaded into a q8 optimizer, a non-zero initial value, and
float32 states for export), written with torch ops on any device, mirroring the codec of
src/ir/low_precision_code.h operation for operation."""
import torch

from .. import _core

OptfuseError = _core.OptfuseError

BLOCK = _core.q8_block
ALIGN = _core.q8_scales_align


def storage_bytes(numel):
    return _core.q8_storage_bytes(numel)


def _scales_offset(numel):
    return (numel + ALIGN - 1) // ALIGN * ALIGN


def is_q8_state(t, numel):
    """Whether t has the q8 storage of a state of numel elements."""
    return t.dtype == torch.int8 and t.dim() == 1 and t.numel() == storage_bytes(numel) and t.is_contiguous()


def quantize(x, out=None):
    """The q8 storage of float tensor x (any shape; its elements in row-major order)."""
    n = x.numel()
    out = torch.zeros(storage_bytes(n), dtype=torch.int8, device=x.device) if out is None else out
    if n == 0:
        return out
    v = x.detach().reshape(-1).to(torch.float32)
    blocks = (n + BLOCK - 1) // BLOCK
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = v
    a = padded.abs().reshape(blocks, BLOCK)
    finite = torch.isfinite(a)
    scale = torch.where(finite, a, torch.zeros_like(a)).amax(dim=1)  # the largest finite |x| of each block
    t = torch.where(scale[:, None] > 0, a / scale[:, None], torch.zeros_like(a))
    q = torch.round(torch.sqrt(torch.sqrt(t)) * 127.0)  # (round: half to even, as rintf)
    q = torch.where(padded.reshape(blocks, BLOCK) < 0, -q, q)
    q = torch.where(finite, q, torch.full_like(q, -128.0)).reshape(-1)[:n]
    out[:n] = q.to(torch.int8)
    off = _scales_offset(n)
    out[off:off + 4 * blocks].view(torch.float32).copy_(scale)
    return out


def dequantize(buf, shape):
    """The float32 values of a q8 storage `buf` holding a state of `shape`."""
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.zeros(shape, dtype=torch.float32, device=buf.device)
    blocks = (n + BLOCK - 1) // BLOCK
    off = _scales_offset(n)
    scale = buf[off:off + 4 * blocks].view(torch.float32)
    q = buf[:n].to(torch.float32)
    a = q.abs() * (1.0 / 127.0)
    a2 = a * a
    v = a2 * a2 * scale.repeat_interleave(BLOCK)[:n]
    v = torch.where(q < 0, -v, v)
    v = torch.where(q == -128, torch.full_like(v, float("nan")), v)
    return v.reshape(shape)


def state_for(p, t, init, from_param, where):
    """A q8 state of parameter p: t itself where it is one already; else a new one (a copy of p, or init
    everywhere), or t (a float state of p's shape: a torch state dict, a changed state_dtype) quantized.
    where(): the state's name and position, for the error on anything else."""
    numel = p.numel()
    if t is not None and is_q8_state(t, numel) and t.device == p.device:
        return t
    if t is None:
        if not from_param and init == 0:
            return torch.zeros(storage_bytes(numel), dtype=torch.int8, device=p.device)
        t = p.detach() if from_param else torch.full(p.shape, float(init), device=p.device)
    elif t.dtype == torch.int8 or t.shape != p.shape:
        raise OptfuseError(f"{where()} (shape {tuple(p.shape)}) is a {t.dtype} tensor of shape {tuple(t.shape)}; a q8 "
                           f"state (state_dtype=torch.int8) is 1-D int8 of {storage_bytes(numel)} bytes, or give a "
                           "float tensor of the parameter's shape")
    with torch.no_grad():
        return quantize(t.to(p.device))
