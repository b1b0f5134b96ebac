"""One compiled chain over the parameters of one device: the bridge between torch tensors and
optfuse._core.Optimizer.

torch keeps a step count per parameter, the core keeps one per group. An engine therefore runs
*internal groups* keyed by (torch group index, step count): parameters of one torch group whose
step counts agree share an internal group, so every parameter's step stays exact after
add_param_group, load_state_dict, or steps on which some parameters had no gradient.

Step counts live on the device (a GradScaler's skipped step is decided there). While no step could
have been skipped (no found_inf given, no CUDA graph captured) the engine also knows them on the
host, so a rebuild never has to read them back: nothing in the training loop waits for the GPU.

Uniform states (one float64 value per group, kept across steps, e.g. NAdam's mu_product) live in the
core's scalar table. Parameters that share an internal group share them, so internal groups are
keyed by (torch group index, step count, uniform-state values): parameters of one torch group whose
values disagree (a state dict from elsewhere) get groups of their own rather than one value forced
on all. uniform_states() reads them back (from the device for CUDA: on state_dict and rebuilds only).

Hyperparameters given as tensors (torch's capturable style) are *bound*: the kernel reads a
float32/float64 tensor on the engine's device at every step, so `lr.fill_(x)` (a scheduler) takes
effect without a host round trip, also between replays of a captured CUDA graph.
"""
import logging
import math
import time

import torch

from .. import _core
from ._dtensor import local
from . import _reader  # noqa: F401 (importing it installs the tensor readers)

# optfuse DType codes (include/optfuse/dtype.h); int16 only for master-weight remainder states
# (torch.int8: a q8 state's storage, _q8.py)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int16: 3, torch.float64: 4, torch.int8: 5}
_FLOAT_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 4}
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int16": torch.int16,
                "float64": torch.float64}


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_log = logging.getLogger("optfuse")


def real_view(t):
    """t, or for a complex tensor its real view (torch.view_as_real: the last dimension of 2 holds
    the real and imaginary parts), which is what the kernel steps, as torch's optimizers do."""
    return torch.view_as_real(t) if t.is_complex() else t


def dtype_code(t):
    """The optfuse code of a parameter's dtype, None if optfuse cannot step it."""
    return _FLOAT_CODES.get(t.dtype)


# torch's C functions behind torch.cuda.current_device() / current_stream(), called directly on the
# step's path (the Python wrappers cost several microseconds of a step's host time).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def current_device():
    """torch's current CUDA device index (CUDA is initialised: the caller holds CUDA tensors)."""
    return _get_device() if _get_device is not None else torch.cuda.current_device()


def current_stream(device):
    """The raw CUDA stream torch is using on `device`, as an int (0: the legacy default stream)."""
    if _raw_stream is not None:
        return _raw_stream(device.index if device.index is not None else current_device())
    return torch.cuda.current_stream(device).cuda_stream


class Engine:
    """A core optimizer for one chain on one device, and the tensor table it steps."""

    def __init__(self, chain, device, skips_only_on_found_inf=True, master_weights="none", kahan=None):
        self.device = device
        # False for chains that may skip a step for other reasons (skip_if_nonfinite, user rules):
        # their step counts are always read back from the device.
        self.countable = skips_only_on_found_inf
        self.captured = False
        self.backend = "cuda" if device.type == "cuda" else "cpu"
        start = time.perf_counter()
        with _on_device(device):
            self.core = _core.Optimizer(chain, self.backend, 1, master_weights=master_weights, kahan=kahan)
        # one line per kernel built: how long, and whether the compiler ran or the cache answered
        # (logging.getLogger("optfuse"), INFO; the first step of a new chain takes this long)
        _log.info("%s kernel for %s: %s; built in %.3f s", self.backend, _core.chain_text(chain),
                  self.core.backend_status(), time.perf_counter() - start)
        self.state_names = list(self.core.state_names)
        self.state_inits = [init for _, _, init in self.core.state_specs]
        # per state: (starts as a copy of the parameter, its fixed torch dtype or None)
        self.state_storage = [(from_param, _DTYPE_NAMES[fixed] if fixed else None)
                              for from_param, fixed in self.core.state_storage]
        self.hyper_names = set(self.core.hyper_short_names) | set(self.core.hyper_names)
        # Row and column states (Adafactor): each parameter's matrix view is its last dimension
        self.matrix = self.core.plan.matrix
        # uniform states: (short name, init value) per slot, in the core's order
        self.uniform_state_specs = [(name, init) for name, _, init in self.core.uniform_state_specs]
        self.params = []    # parameters in table order
        self.states = []    # their state tensors in table order (len(state_names) per parameter)
        self.indices = []   # their slots in the optimizer's GradWatch
        self.groups = []    # internal group -> (torch group index, step count when the table was built)
        self.group_of = []  # per table entry: internal group
        self.pushed = {}    # internal group -> {hyper name: key of the value last pushed}
        self.bound = {}     # (internal group, hyper name) -> the tensor the kernel reads
        self.exact = False  # steps() may count on the host: no step could have been skipped unseen
        self.base_steps = []  # per internal group: its step count when the table was built
        self.taken_base = 0   # the core's launch count then
        # the dtype the kernel's math runs in for the value checks of _number (float64 only where
        # every parameter is float64)
        self.math_dtype = torch.float32

    def build(self, entries, hypers_of_torch_group):
        """entries: (param, grad, states, torch group index, step, watch index, stochastic, rng key) per
        parameter that steps; grad and states are tensors of the parameter's layout (each its own dtype),
        already checked; stochastic: (parameter, states) whether their float16/bfloat16 stores round
        stochastically, with the random stream rng: a key, or (key, offset of the tensor's first element
        in the tensor the key names; a shard's offset). An optional 9th field: the parameter's uniform-state
        values (a tuple in uniform_state_specs order; their init values when absent). An optional 10th: the
        tensor the kernel steps in the parameter's place (a dense copy of a parameter with gaps)."""
        keys = {}
        inits = tuple(init for _, init in self.uniform_state_specs)
        ustates_of = lambda e: tuple(e[8]) if len(e) > 8 and e[8] is not None else inits  # noqa: E731
        self.groups, self.group_of, self.params, self.indices, self.states = [], [], [], [], []
        self.math_dtype = (torch.float64 if entries and all(e[0].dtype == torch.float64 for e in entries)
                           else torch.float32)
        self.group_ustates = []  # per internal group: its uniform-state values when the table was built
        for e in entries:
            tg, step = e[3], e[4]
            key = (tg, step, ustates_of(e))
            if key not in keys:
                keys[key] = len(self.groups)
                self.groups.append((tg, step))
                self.group_ustates.append(key[2])
        while self.core.num_groups < max(1, len(self.groups)):
            self.core.add_group()
        self.pushed = {}
        for gi in range(self.core.num_groups):  # bindings of the previous table's groups
            for name in self.hyper_names:
                if (gi, name) in self.bound:
                    self.core._bind_hyper_raw(gi, name, 0, False)
        self.bound = {}
        self.base_steps = [step for _, step in self.groups]
        self.taken_base = self.core._steps_taken  # (the core counts launches: _launch's atomic call)
        self.exact = self.countable and not self.captured
        for gi, (tg, step) in enumerate(self.groups):
            self.core.set_step_count(gi, step)
            for (name, _), value in zip(self.uniform_state_specs, self.group_ustates[gi]):
                self.core.set_uniform_state(gi, name, float(value))
            self._push(gi, hypers_of_torch_group(tg))
        ptrs_p, ptrs_g, ptrs_s, numels, dtypes, groups, rounding, rng_keys, rng_offsets = [], [], [], [], [], [], [], [], []
        # matrix plans: each parameter's last dimension (0: a vector, no matrix view) and, for more than 2
        # dimensions, its next-to-last (a batch of matrices, each factored on its own, as torch's Adafactor)
        cols, matrix_rows = [], []
        for e in entries:
            p, g, states, tg, step, widx, stochastic, rng = e[:8]
            gi = keys[(tg, step, ustates_of(e))]
            self.params.append(p)
            self.indices.append(widx)
            self.group_of.append(gi)
            self.states.extend(states)
            # A DTensor (FSDP2) parameter, gradient or state: the kernel steps its local shard; a
            # complex one, its real view.
            if len(e) > 9 and e[9] is not None:
                p = e[9]  # a parameter with gaps: the dense copy the front end gathers and scatters
            p, g, states = real_view(local(p)), real_view(local(g)), [real_view(local(s)) for s in states]
            ptrs_p.append(p.data_ptr())
            ptrs_g.append(g.data_ptr())
            ptrs_s.extend(s.data_ptr() for s in states)
            numels.append(p.numel())
            if self.matrix:
                cols.append(p.shape[-1] if p.dim() > 1 else 0)
                matrix_rows.append(p.shape[-2] if p.dim() > 2 and p.shape[-1] > 0 else 0)  # (no columns: no view)
            roles = [p, g] + list(states)
            dtypes.extend(_DTYPE_CODES[t.dtype] for t in roles)
            rounding.extend(k != 1 and stochastic[min(k, 1)] and t.dtype in (torch.float16, torch.bfloat16)
                            for k, t in enumerate(roles))
            key, offset = rng if isinstance(rng, tuple) else (rng, 0)
            rng_keys.append(key)
            rng_offsets.append(offset)
            groups.append(gi)
        device_id = self.device.index if self.device.type == "cuda" else -1
        self.core._set_tensors_raw(ptrs_p, ptrs_g, ptrs_s, numels, dtypes, groups,
                                   -1 if device_id is None else device_id, self.indices, rounding, rng_keys, rng_offsets,
                                   cols, matrix_rows)

    def _push(self, gi, hypers):
        done = self.pushed.setdefault(gi, {})
        for name, value in hypers.items():
            if name not in self.hyper_names:
                continue
            bind = self._bindable(name, value)
            key = ("bound", id(value)) if bind else self._number(gi, name, value)
            if done.get(name) == key:
                continue
            if bind:
                self.core._bind_hyper_raw(gi, name, value.data_ptr(), value.dtype == torch.float64)
                self.bound[(gi, name)] = value  # kept alive while the kernel reads it
            else:
                if self.bound.pop((gi, name), None) is not None:
                    self.core._bind_hyper_raw(gi, name, 0, False)
                # torch validates constructor arguments only: a value set in param_groups later
                # (NaN, inf, negative) is stepped with, as torch does
                self.core._set_hyper_unchecked(gi, name, key)
            done[name] = key

    def _number(self, gi, name, value):
        """A group value as the float the kernel reads, refused where torch's step refuses it: not a
        number (TypeError), or too large for the float32 math of float32/16-bit parameters
        (torch: "value cannot be converted to type float without overflow")."""
        if torch.is_tensor(value):
            if value.numel() != 1:
                raise _core.OptfuseError(f"hyperparameter {name} must be a number or a one-element tensor, "
                                         f"got a tensor of shape {tuple(value.shape)}")
            return float(value.detach().item())
        if isinstance(value, (str, bytes)) or not isinstance(value, (int, float)):
            raise TypeError(f"hyperparameter {name} of group {self.groups[gi][0]} must be a number, "
                            f"got {type(value).__name__} {value!r}")
        x = float(value)
        if math.isfinite(x) and abs(x) > _FLOAT32_MAX and self.math_dtype == torch.float32:
            raise RuntimeError(f"hyperparameter {name}={x!r} of group {self.groups[gi][0]}: value cannot be converted "
                               "to type float without overflow")
        return x

    def _bindable(self, name, value):
        """A tensor hyperparameter the kernel can read at every step (else its value is pushed)."""
        if not torch.is_tensor(value):
            return False
        if value.numel() != 1:
            raise _core.OptfuseError(f"hyperparameter {name} must be a number or a one-element tensor, "
                                     f"got a tensor of shape {tuple(value.shape)}")
        on_engine = value.device == self.device if self.device.type == "cuda" else value.device.type == "cpu"
        if value.is_cuda and not on_engine:
            raise _core.OptfuseError(f"hyperparameter {name} is a tensor on {value.device} but the parameters are "
                                     f"on {self.device}")
        if on_engine and value.dtype not in (torch.float32, torch.float64):
            if value.is_cuda:
                raise _core.OptfuseError(f"hyperparameter {name} is a {value.dtype} CUDA tensor; the kernel reads "
                                         "float32 or float64 tensors")
            return False  # a CPU tensor of another dtype: its value is pushed when it changes
        return on_engine

    def push_hypers(self, tg, hypers):
        """New hyperparameter values of torch group tg (an lr scheduler ran): set_hyper, never a recompile."""
        for gi, (g, _) in enumerate(self.groups):
            if g == tg:
                self._push(gi, hypers)

    def steps(self):
        """Current step count of every parameter in the table (reads the device only when a step
        may have been skipped there)."""
        if self.exact:
            taken = self.core._steps_taken - self.taken_base
            counts = [s + taken for s in self.base_steps]
        else:
            counts = [self.core.step_count(gi) for gi in range(len(self.groups))]
        return [(p, counts[gi]) for p, gi in zip(self.params, self.group_of)]

    def uniform_states(self):
        """Each parameter's uniform-state values in the table ({short name: value}), as the last step
        that was not skipped left them (read from the device for CUDA)."""
        if not self.uniform_state_specs or not self.params:
            return []
        with _on_device(self.device):
            values = [{name: self.core.uniform_state(gi, name) for name, _ in self.uniform_state_specs}
                      for gi in range(len(self.groups))]
        return [(p, values[gi]) for p, gi in zip(self.params, self.group_of)]

    def launch(self, grad_scale, found_inf, capturing=False):
        """The step's launch as (callable, args) for _core._call_each (None: an empty table), with
        the tensors behind grad_scale and found_inf on this engine's device (kept alive by the
        caller until the launch is queued: a tensor freed after that is reused only by later work on
        the same stream)."""
        if not self.params:
            return None, None, None
        gs = _scalar_ptr(grad_scale, self.device)
        fi = _scalar_ptr(found_inf, self.device)
        if found_inf is not None or capturing:
            self.exact = False  # skips (or graph replays) happen where the host cannot count them
            self.captured = self.captured or capturing
        stream = current_stream(self.device) if self.backend == "cuda" else 0
        return (self.core._step_raw, (gs[0], fi[0], stream)), gs[1], fi[1]

    def step(self, grad_scale, found_inf, capturing=False):
        """One launch now (callers without step tensors to advance with it)."""
        call, gs, fi = self.launch(grad_scale, found_inf, capturing)
        if call is not None:
            with _on_device(self.device):
                call[0](*call[1])
        return gs, fi


def _scalar_ptr(t, device):
    """(pointer, keep-alive) of a one-element float32 tensor on `device` (moved there if needed)."""
    if t is None:
        return 0, None
    if not torch.is_tensor(t):
        t = torch.tensor(float(t), dtype=torch.float32, device=device)
    if t.numel() != 1:
        raise _core.OptfuseError(f"grad_scale / found_inf must hold one value, got shape {tuple(t.shape)}")
    if t.dtype != torch.float32 or t.device != device:
        t = t.to(device=device, dtype=torch.float32, non_blocking=True)
    return t.data_ptr(), t


class _on_device:
    """Makes `device` torch's current CUDA device for a block (the core uses the current context)."""

    def __init__(self, device):
        self.device = device
        self.prev = None

    def __enter__(self):
        if self.device.type == "cuda" and self.device.index is not None:
            cur = current_device()
            if cur != self.device.index:
                self.prev = cur
                torch.cuda.set_device(self.device.index)

    def __exit__(self, *exc):
        if self.prev is not None:
            torch.cuda.set_device(self.prev)
            self.prev = None
