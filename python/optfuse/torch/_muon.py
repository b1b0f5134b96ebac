"""optfuse.torch.Muon (drop-in for torch.optim.Muon) and MuonWithAuxAdam (Muon for the groups marked
use_muon=True, optfuse AdamW for the others, one step()).

A Muon step is three steps of the core, run in order from here: an element-wise pass, the core's
matrix phase, an element-wise pass:

  (a) momentum pass: one fused optfuse element-wise launch over every Muon parameter of a device
      and dtype (rule `muon_momentum`, written in Python below):
          buf <- lerp(buf, g, 1 - momentum)                 (state momentum_buffer, torch's name)
          u   <- lerp(g, buf, momentum) if nesterov else buf
      The pass's *parameter role is a scratch buffer*, not the parameter: u is written there
      (set_param_base(u) plus an update of -0.0, which is exact: x + (-0.0) == x for every x), so
      the pass reads g and buf and writes buf and u. The scratch of same-shape matrices is one
      contiguous (B, m, n) tensor per (device, dtype, shape, Newton-Schulz settings): the pass
      writes the batch directly, no stacking copy.
  (b) matrix phase: Newton-Schulz in bfloat16 as torch.optim.Muon computes it (convert to bf16,
      transpose tall matrices, divide by the Frobenius norm clamped to eps, ns_steps quintic
      iterations with ns_coefficients), batched over the B matrices of a bucket and run in place on
      the scratch. On CUDA by the core (optfuse._core.NewtonSchulz, include/optfuse/newton_schulz.h):
      cuBLAS strided-batched bf16 GEMMs (no transposition copied) and four small kernels of its own
      for the norms and conversions. On the CPU by torch.bmm / baddbmm (newton_schulz_batched
      below), whose bf16 products beat the core's OpenBLAS path there (_matrix_phase_engine). No
      GEMM of our own either way. The bf16 result lands in the scratch in its dtype (exact for
      float32 and bfloat16).
  (c) apply pass: one fused launch per device and dtype (rule `muon_apply`):
          p <- fma(u, -adjusted_lr, p * (1 - lr * weight_decay))
      which is how torch rounds `p.mul_(1 - lr*wd); p.add_(u, alpha=-adjusted_lr)` (torch's add
      with alpha is a fused multiply-add on the CPU's vector path and under nvcc). The
      shape-dependent lr (adjust_lr_fn) is a hyperparameter of *internal groups* keyed by (torch
      group, lr ratio): computed in Python exactly as torch computes it (lr * ratio in float64),
      so no extra rounding is introduced by folding it elsewhere.

So a step is 2 element-wise launches plus, per bucket, 4 small kernels and 3 * ns_steps batched
GEMMs (and 2 * ns_steps device copies: a cuBLAS GEMM reads C where it writes it); a GPT-2-small
model has 4 buckets, Llama-1B-like shapes 4, instead of torch's dozen kernels and 15 matrix
products per parameter.
"""
import collections
import contextlib
import math
import os
import signal
import struct
import threading

import torch

from .. import _core
from ._base import OptfuseError, _dynamo_opaque
from ._engine import Engine, dtype_code
from ._optimizers import AdamW

_ROUND = {torch.float32: None, torch.bfloat16: _core.round_to_bf16, torch.float16: _core.round_to_f16}


def _rounded(x, dtype):
    """x rounded as torch stores an intermediate tensor of `dtype` (nothing for float32)."""
    r = _ROUND[dtype]
    return x if r is None else r(x)


def _f32(x):
    """x rounded to float32 (as torch passes a Python scalar to a float32 kernel)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def lerp_hypers(name, weight):
    """Hyperparameters of torch_lerp for a Python-number weight: the float32 weight, whether torch
    takes the small-weight branch (|w| < 0.5 in float32), and w - 1 computed in float32."""
    w = _f32(float(weight))
    return {name: w, name + "_small": 1.0 if abs(w) < 0.5 else 0.0, name + "_m1": _f32(w - 1.0)}


def torch_lerp(b, start, end, name):
    """torch.lerp(start, end, w) with a scalar weight as torch's kernels round it: the CPU vector
    path computes fma(w, end - start, start) for |w| < 0.5 and fma(w - 1, end - start, end) else,
    and nvcc contracts the CUDA kernel's `start + w*(end - start)` / `end - (end - start)*(1 - w)`
    into the same two fmas (optfuse's lerp op rounds the product separately: 1 ulp apart)."""
    d = end - start
    return _core.select(b.hyper(name + "_small"), _core.fma(b.hyper(name), d, start),
                        _core.fma(b.hyper(name + "_m1"), d, end))


def momentum_rule(dtype=torch.float32, device_type="cpu"):
    """The element-wise pass before the matrix phase. The pass's parameter is the scratch buffer:
    its new value is the pre-orthogonalisation update. The lerp weights (1 - momentum, momentum)
    and `nesterov` (0/1) are hyperparameters: one kernel serves every group. For bfloat16/float16
    parameters the buffer is rounded before the Nesterov mix, as torch stores it then reads it."""
    def update(b):
        g = b.update()
        buf = torch_lerp(b, b.state("momentum_buffer"), g, "buf_weight")
        b.set_state("momentum_buffer", buf)
        stored = _rounded(buf, dtype)
        u = _core.select(b.hyper("nesterov"), torch_lerp(b, g, stored, "mix_weight"), stored)
        b.set_param_base(b.name(u, "muon_update"))
        return b.constant(-0.0)  # x + (-0.0) is x exactly: the scratch gets u as computed
    rule = _core.Rule("muon_momentum")
    for name, w in (("buf_weight", 0.05), ("mix_weight", 0.95)):
        for k, v in lerp_hypers(name, w).items():
            rule.hyper(k, v)
    return rule.hyper("nesterov", 1.0, _core.Range(0.0, 1.0, False, False)).state("momentum_buffer", 0.0).update(update)


def apply_rule(dtype=torch.float32, device_type="cpu"):
    """The element-wise pass after the matrix phase: the incoming 'gradient' is the orthogonalised
    update; the parameter is decayed by `decay` = 1 - lr * weight_decay, then moved by
    -adjusted_lr * update, rounded as torch's p.mul_(decay); p.add_(u, alpha=-adjusted_lr) is:
    one fma, except in torch's CPU kernels for bfloat16/float16, which round alpha to the
    parameter's dtype first and, when the update is a transposed view (tall matrices), also round
    alpha * u before adding (both measured on torch 2.15; its CUDA kernels keep alpha in float32).
    `rounded_product` (0/1) selects that last form per internal group. The values are
    hyperparameters computed in Python as torch computes them (apply_hypers)."""
    def update(b):
        decayed = _rounded(b.param() * b.hyper("decay"), dtype)
        step = -b.hyper("adjusted_lr")
        u = b.update()
        if device_type == "cpu" and dtype != torch.float32:
            step = _rounded(step, dtype)
            new = _core.select(b.hyper("rounded_product"), decayed + _rounded(step * u, dtype),
                               _core.fma(u, step, decayed))
        else:
            new = _core.fma(u, step, decayed)
        b.set_param_base(new)
        return b.constant(-0.0)
    return (_core.Rule("muon_apply")
            .hyper("decay", 1.0)
            .hyper("adjusted_lr", 1e-3, _core.Range.non_negative())
            .hyper("rounded_product", 0.0)
            .update(update))


def apply_hypers(lr, weight_decay, ratio):
    """decay = 1 - lr * weight_decay and adjusted_lr = lr * ratio as torch.optim.Muon gets them: in
    float64 for a Python lr; for a tensor lr, torch's 0-dim tensor arithmetic in the tensor's dtype
    (float32: every operation rounded to float32, the Python operands first)."""
    if torch.is_tensor(lr) and lr.dtype != torch.float64:
        v = float(lr)  # a CUDA lr is read back here (a device sync per step; see docs/python.md)
        r = _f32
        return {"decay": r(1 - r(v * r(float(weight_decay)))), "adjusted_lr": r(v * r(ratio))}
    v = float(lr)
    return {"decay": 1 - v * float(weight_decay), "adjusted_lr": v * ratio}


def adjusted_lr_ratio(adjust_lr_fn, shape):
    """torch.optim.Muon's _adjust_lr as a ratio (lr * ratio is the adjusted lr, as torch computes it)."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    if adjust_lr_fn == "spectral_unclamped":
        return math.sqrt(A / B)
    return 1.0


def newton_schulz_batched(X, coefficients, steps, eps, use_addmm=True):
    """torch.optim.Muon's _zeropower_via_newtonschulz over a batch of same-shape matrices X (B, m, n):
    the same bfloat16 operations in the same order, each one batched (bmm / baddbmm). Returns a
    bfloat16 (B, m, n) tensor (a transposed view for tall matrices)."""
    if steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = coefficients
    Y = X.to(dtype=torch.bfloat16, copy=True)
    tall = X.size(-2) > X.size(-1)
    if tall:
        Y = Y.mT
    # torch: ortho_grad.div_(ortho_grad.norm().clamp(min=eps)), per matrix
    Y.div_(torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True).clamp_(min=eps))
    for _ in range(steps):
        G = torch.bmm(Y, Y.mT)
        if use_addmm:
            U = torch.baddbmm(G, G, G, beta=b, alpha=c)
            Y = torch.baddbmm(Y, U, Y, beta=a)
        else:  # torch versions with use_addmm=False: b * G + c * G @ G, a * Y + U @ Y
            U = b * G + torch.bmm(c * G, G)
            Y = a * Y + torch.bmm(U, Y)
    return Y.mT if tall else Y


def _torch_muon_defaults(kwargs):
    """The defaults dict torch.optim.Muon builds from these arguments, with its ValueErrors (so
    param_groups have exactly the installed torch's keys); torch's own checks where it has no Muon."""
    cls = getattr(torch.optim, "Muon", None)
    if cls is not None:
        return cls([torch.zeros(1, 1, requires_grad=True)], **kwargs).defaults
    lr, wd, mom, fn = kwargs["lr"], kwargs["weight_decay"], kwargs["momentum"], kwargs["adjust_lr_fn"]
    if torch.is_tensor(lr) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= mom:
        raise ValueError(f"momentum should be >= 0 but is: {mom}")
    if not 0.0 <= wd:
        raise ValueError(f"weight decay should be >= 0 but is: {wd}")
    if fn is not None and fn not in ("original", "match_rms_adamw", "spectral_unclamped"):
        raise ValueError(f"Adjust learning rate function {fn} is not supported")
    return dict(kwargs)


def _matrix_phase_engine(device):
    """Which matrix phase a bucket on `device` runs: 'core' (optfuse._core.NewtonSchulz) on CUDA
    where cuBLAS loads; 'torch' (batched torch.bmm / baddbmm, newton_schulz_batched) on the CPU,
    where torch's bf16 products (oneDNN, AMX where the CPU has it) ran 6x faster than the core's
    OpenBLAS float32 sgemm on the development VM (docs/performance.md, "Muon's matrix phase in
    the core"), and wherever no GEMM library loads. OPTFUSE_MUON_MATMUL = core | torch forces one
    (tests run both; benchmarks compare them)."""
    forced = os.environ.get("OPTFUSE_MUON_MATMUL", "")
    if forced in ("core", "torch"):
        return forced
    if forced:
        raise OptfuseError(f"OPTFUSE_MUON_MATMUL must be 'core' or 'torch', got {forced!r}")
    if device.type != "cuda":
        return "torch"
    if device.type not in _GEMM_AVAILABLE:
        _GEMM_AVAILABLE[device.type] = _core.gemm_available(device.type)[0]
    return "core" if _GEMM_AVAILABLE[device.type] else "torch"


_GEMM_AVAILABLE = {}


def _on_device(device):
    """torch.cuda.device(device) for a CUDA device (the core works in the current device's context),
    nothing for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _Bucket:
    """Same-shape matrices of one device and dtype with the same Newton-Schulz settings: their
    scratch is one (B, m, n) tensor, orthogonalised together, in place: by the core's matrix phase
    (one NewtonSchulz per bucket, its bf16 work buffers kept from step to step) or by
    newton_schulz_batched (_matrix_phase_engine says which; torch's use_addmm=False form always
    takes the latter)."""

    def __init__(self, device, dtype, shape, ns, count):
        self.ns = ns  # (coefficients, steps, eps, use_addmm)
        self.scratch = torch.empty((count,) + tuple(shape), dtype=dtype, device=device)
        coefficients, steps, eps, use_addmm = ns
        self.core = None
        if use_addmm and _matrix_phase_engine(device) == "core":
            with _on_device(device):  # the core builds for the current device's context
                self.core = _core.NewtonSchulz(device.type, dtype_code(self.scratch), count, shape[0], shape[1],
                                               tuple(coefficients), steps, eps)

    def orthogonalise(self):
        if self.core is None:
            coefficients, steps, eps, use_addmm = self.ns
            self.scratch.copy_(newton_schulz_batched(self.scratch, coefficients, steps, eps, use_addmm))
            return
        with _on_device(self.scratch.device):
            stream = torch.cuda.current_stream().cuda_stream if self.scratch.is_cuda else 0
            self.core.run(self.scratch.data_ptr(), stream)


class Muon(torch.optim.Optimizer):
    """Fused, batched drop-in for torch.optim.Muon: same arguments, defaults, errors, param_groups and
    state_dict (state `momentum_buffer` per parameter). See the module docstring for the schedule
    of a step and docs/python.md ("Muon") for how it compares with torch."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, **extra):
        kw = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                  ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, **extra)
        self._init_private()
        super().__init__(params, _torch_muon_defaults(kw))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}")

    def _init_private(self):
        self._of_dirty = True
        self._watch = None
        self._sigs = None
        self._engines_in = {}   # (device, dtype) -> Engine of the momentum pass
        self._engines_out = {}  # (device, dtype) -> Engine of the apply pass
        self._buckets = []
        self._out_groups = []   # internal group of the apply pass -> (torch group index, lr ratio, tall)
        self._copies = []       # (gradient, contiguous copy the momentum pass reads)
        self._gathers = []      # (strided parameter, contiguous copy the apply pass steps)

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_engines_in" not in self.__dict__:
            self._init_private()
        else:
            self._of_dirty = True

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if not torch.is_complex(p) and (dtype_code(p) is None or p.dtype == torch.float64):
                raise OptfuseError(f"Muon: parameters must be float32, float16 or bfloat16, got {p.dtype} "
                                   f"(shape {tuple(p.shape)})")
        self._of_dirty = True

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._of_dirty = True

    # --- the step
    @staticmethod
    def _structure(g):
        """Group values whose change rebuilds the tables (the rest are hyperparameters pushed per step)."""
        return (tuple(float(c) for c in g["ns_coefficients"]), int(g["ns_steps"]), float(g["eps"]),
                bool(g.get("use_addmm", True)), g["adjust_lr_fn"])

    @_dynamo_opaque
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            # its hyperparameters are host values pushed at each step (a tensor lr is read with float()),
            # so a replayed graph would keep the capture-time values whatever a scheduler sets later
            raise OptfuseError(f"{type(self).__name__}: step() cannot be captured in a CUDA graph (not built for "
                               "Muon: its hyperparameters are pushed from the host at each step, so replays would "
                               "keep the values of the capture); run it eagerly")
        for g in groups:  # torch raises these in the Newton-Schulz call, before the parameter moves
            if g["ns_steps"] >= 100:
                raise ValueError("Number of steps must be less than 100 for computational efficiency")
            if len(g["ns_coefficients"]) != 3:
                raise ValueError("Coefficients must be a tuple of exactly 3 values")
        sigs = [self._structure(g) for g in groups]
        if self._of_dirty or sigs != self._sigs or not self._fresh():
            self._rebuild(sigs)
        self._push_hypers()
        # the momentum pass, Newton-Schulz and the apply pass happen together or not at all: a
        # KeyboardInterrupt during them is raised once they are done
        with _interrupts_deferred():
            for src, dst in self._copies:
                dst.copy_(src)
            for p, dense in self._gathers:
                dense.copy_(p)
            for e in self._engines_in.values():
                e.step(None, None)
            for bucket in self._buckets:
                bucket.orthogonalise()
            for e in self._engines_out.values():
                e.step(None, None)
            for p, dense in self._gathers:
                p.copy_(dense)
        self._watch.release()  # (the gradients the check read stayed alive through the launches)
        return loss

    def _fresh(self):
        r = self._watch.check(self.state)  # (parameters and momentum buffers too: _watch_tables)
        if r == 0:
            return True
        if r == 1 and not self._copies:  # new gradient tensors of the same parameters: patch pointers
            for e in self._engines_in.values():
                e.core._take_grads(self._watch)
            return True
        return False

    def _push_hypers(self):
        """Every group's values, read now (schedulers, hand edits): set_hyper only where one changed."""
        groups = self.param_groups
        for e in self._engines_in.values():
            for tg in {tg for tg, _ in e.groups}:
                g = groups[tg]
                mom = float(g["momentum"])  # torch: buf.lerp_(grad, 1 - momentum); grad.lerp(buf, momentum)
                e.push_hypers(tg, dict(lerp_hypers("buf_weight", 1 - mom), **lerp_hypers("mix_weight", mom),
                                       nesterov=1.0 if g["nesterov"] else 0.0))
        for e in self._engines_out.values():
            for og in {og for og, _ in e.groups}:
                tg, ratio, tall = self._out_groups[og]
                g = groups[tg]
                e.push_hypers(og, dict(apply_hypers(g["lr"], g["weight_decay"], ratio), rounded_product=float(tall)))

    def _rebuild(self, sigs):
        groups = self.param_groups
        params = [p for g in groups for p in g["params"]]
        from ._dtensor import is_dtensor
        for p in params:
            if is_dtensor(p):
                raise OptfuseError(f"{type(self).__name__}: the parameter of shape {tuple(p.shape)} is a DTensor (FSDP2 "
                                   "fully_shard); Newton-Schulz orthogonalises whole matrices and each rank holds rows "
                                   "of one (gathering them is not built)")
        self._watch = _core._TableWatch(params)
        grads = self._watch.snapshot()
        items, w = [], 0
        for tg, g in enumerate(groups):
            for p in g["params"]:
                grad = grads[w]
                if grad is not None:
                    if torch.is_complex(p):
                        raise RuntimeError("Muon does not support complex parameters")
                    if grad.is_sparse:
                        raise RuntimeError("Muon does not support sparse gradients")
                    if grad.ndim != 2:
                        raise ValueError("Param gradient must be a 2D matrix")
                    items.append((p, grad, tg, w))
                w += 1
        buckets, members, copies, gathers = {}, {}, [], []
        for p, grad, tg, w in items:
            key = (p.device, p.dtype, tuple(p.shape), sigs[tg][:4])
            members.setdefault(key, []).append((p, grad, tg, w))
        in_entries, out_entries, out_groups, out_index = {}, {}, [], {}
        for key, ms in members.items():
            device, dtype, shape, ns = key
            bucket = _Bucket(device, dtype, shape, ns, len(ms))
            buckets[key] = bucket
            for j, (p, grad, tg, w) in enumerate(ms):
                scratch = bucket.scratch[j]
                st = self.state[p]
                buf = st.get("momentum_buffer")
                if buf is None:
                    buf = torch.zeros_like(grad, memory_format=torch.preserve_format)
                if buf.dtype != p.dtype or buf.device != p.device or buf.shape != p.shape or not buf.is_contiguous():
                    fixed = torch.empty_like(p)
                    fixed.copy_(buf)
                    buf = fixed
                st["momentum_buffer"] = buf
                if grad.dtype != p.dtype or not grad.is_contiguous():
                    copy = torch.empty_like(p)
                    copies.append((grad, copy))
                    grad = copy
                # (last two: no stochastic rounding of the stores, random stream key unused)
                in_entries.setdefault((device, dtype), []).append((scratch, grad, [buf], tg, 0, w, (False, False), 0))
                og_key = (tg, adjusted_lr_ratio(sigs[tg][4], p.shape), shape[0] > shape[1])
                if og_key not in out_index:
                    out_index[og_key] = len(out_groups)
                    out_groups.append(og_key)
                dense = None
                if not p.is_contiguous():  # (a strided matrix: stepped through a contiguous copy)
                    dense = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                    gathers.append((p.detach(), dense))
                out_entries.setdefault((device, dtype), []).append(
                    (p, scratch, [], out_index[og_key], 0, w, (False, False), 0, None, dense))
        self._out_groups = out_groups
        self._engines_in = self._engines(self._engines_in, in_entries, momentum_rule)
        self._engines_out = self._engines(self._engines_out, out_entries, apply_rule)
        self._buckets = list(buckets.values())
        self._copies = copies
        self._gathers = gathers  # (strided parameter, its contiguous copy): gathered and scattered per step
        # every step checks the parameters and momentum buffers the tables point at (TableWatch)
        self._watch.watch_tables(self.state, [w for _, _, _, w in items], [self.state[p] for p, _, _, _ in items],
                                 [["momentum_buffer"] for _ in items])
        self._sigs = sigs
        self._of_dirty = False

    @staticmethod
    def _engines(old, entries, make_rule):
        out = {}
        for (device, dtype), es in entries.items():
            engine = old.get((device, dtype)) or Engine([make_rule(dtype, device.type)], device)
            engine.build(es, lambda g: {})  # hyperparameters are pushed by _push_hypers every step
            out[(device, dtype)] = engine
        return out


class _interrupts_deferred:
    """Holds a KeyboardInterrupt (SIGINT with Python's default handler, main thread only) until the
    block ends, then raises it: the block's launches happen together or not at all."""

    def __enter__(self):
        self.old, self.hit = None, False
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self.old = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame):
        self.hit = True

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            if self.hit and exc[0] is None:
                raise KeyboardInterrupt


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon for the param groups marked use_muon=True, AdamW (optfuse.torch.AdamW: torch.optim.AdamW's
    math, arguments and defaults) for the groups marked use_muon=False, stepped by one step():

        hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
        other = [p for p in model.parameters() if all(p is not h for h in hidden)]
        opt = optfuse.torch.MuonWithAuxAdam([
            dict(params=hidden, use_muon=True, lr=0.02, weight_decay=0.01),
            dict(params=other, use_muon=False, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01)])

    Keys a group leaves out take torch.optim.Muon's / torch.optim.AdamW's defaults. param_groups are
    the groups given (the same dicts, in the same order: schedulers see every group); the state and
    state_dict are torch's format (Muon groups: momentum_buffer; AdamW groups: step, exp_avg,
    exp_avg_sq), so a state dict round-trips through load_state_dict."""

    def __init__(self, param_groups):
        self._muon = None
        self._adam = None
        groups = list(param_groups)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise ValueError("MuonWithAuxAdam takes a list of param group dicts, each with use_muon=True or False")
        super().__init__(groups, {})

    def add_param_group(self, param_group):
        if not isinstance(param_group, dict) or "use_muon" not in param_group:
            raise ValueError("MuonWithAuxAdam: every param group needs a 'use_muon' key (True: Muon, False: AdamW)")
        params = param_group["params"]
        param_group["params"] = [params] if torch.is_tensor(params) else list(params)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in param_group["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        if param_group["use_muon"]:
            if self._muon is None:
                self._muon = Muon([param_group])
            else:
                self._muon.add_param_group(param_group)
            self._muon.state = self.state
        else:
            if self._adam is None:
                self._adam = AdamW([param_group])
            else:
                self._adam.add_param_group(param_group)
            self._adam.state = self.state
        self.param_groups.append(param_group)

    @_dynamo_opaque
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._muon is not None:
            self._muon.step()
        if self._adam is not None:
            self._adam.step()
        return loss

    def state_dict(self):
        if self._adam is not None:
            # FusedOptimizer.state_dict's refresh of state["step"] from the kernel's counters (its own
            # state_dict() would pack only its parameters, and the state here is shared)
            self._adam._sync_steps(write_state=True)
        return super().state_dict()

    def load_state_dict(self, state_dict):
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        parts = {True: ([], {}), False: ([], {})}
        for s, g in zip(saved, self.param_groups):
            if bool(s.get("use_muon")) != bool(g["use_muon"]):
                raise ValueError("loaded state dict marks a parameter group use_muon="
                                 f"{s.get('use_muon')!r} where this optimizer's is {g['use_muon']!r}")
            groups, state = parts[bool(g["use_muon"])]
            first = sum(len(x["params"]) for x in groups)
            renumbered = list(range(first, first + len(s["params"])))
            for old, new in zip(s["params"], renumbered):
                if old in state_dict["state"]:
                    state[new] = state_dict["state"][old]
            groups.append(dict(s, params=renumbered))
        new_groups = {}
        for flag, sub in ((True, self._muon), (False, self._adam)):
            if sub is None:
                continue
            groups, state = parts[flag]
            sub.load_state_dict({"state": state, "param_groups": groups})
            new_groups[flag] = iter(sub.param_groups)
        self.param_groups = [next(new_groups[bool(g["use_muon"])]) for g in self.param_groups]
        self.state = collections.defaultdict(dict)
        for sub in (self._muon, self._adam):
            if sub is not None:
                self.state.update(sub.state)
        for sub in (self._muon, self._adam):
            if sub is not None:
                sub.state = self.state
