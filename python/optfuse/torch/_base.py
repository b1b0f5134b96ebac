"""The torch.optim.Optimizer subclass every optfuse.torch optimizer derives from.

The layers (docs/architecture.md, "The Python package"):
  _base.py         this adapter: torch.optim.Optimizer's API (param_groups, state, state_dict, hooks,
                   step) and the subclass interface below
  _binding.py      TableBinding: reads torch's live objects, checks the tables at every step,
                   re-points or rebuilds them (the only place that reads torch's state)
  _step_paths.py   StepPaths: the torch.compile custom op and CUDA-graph capture
  _engine.py       Engine: one compiled chain on one device and its tensor table
  _group_values.py, _precision.py: what a param group's values mean (pure functions)
  _checks.py       what the binding refuses before any memory is touched

Subclasses describe how torch's group options map onto optfuse chains (the first three are handed
_host_view(group): numbers only, see "Tensor hyperparameters" below):
  _structure(group) -> hashable key: groups with different keys get different chains (engines)
  _features(group)  -> set of optional rules the group needs (e.g. {"weight_decay"})
  _make_chain(key, features, groups) -> the chain (without unscale_by_grad_scale)
  _hypers(group)    -> {optfuse hyperparameter name: value} (a number, or a one-element tensor that
                       the engine binds so the kernel reads it at every step)
  _sig_keys         -> group keys whose change must be noticed (hyperparameters and structure)

Mixed precision (every subclass; constructor keywords and param_group keys, see _precision.py):
  master_weights=False|True|"remainders", state_dtype=None|torch.float32|torch.bfloat16|torch.float16,
  stochastic_rounding=False, kahan=False. They choose the chain's precision options (master copy,
  remainders, Kahan compensation: extra state slots the core adds) and each role's dtype; a group's
  parameters are bucketed by them and by their dtype, so one model may mix float32 and bfloat16 groups.

Tensor hyperparameters: a CUDA tensor's value is read on the host once, when the optimizer first sees
the tensor (construction, add_param_group, load_state_dict: torch's own constructors read it there too,
to validate it). The chain's structure and literals are decided from that value (a DeviceValue), so
building the tables never waits for the GPU; the kernel reads the tensor itself at every step. Optional
rules whose value is a CUDA tensor are always in the chain (weight decay 0 costs a multiply by zero), so
a later fill_ from 0 to non-zero is never lost; a structural value (momentum 0 or not) keeps the value
it had when first seen.
"""
import inspect
import operator
import sys
import threading

import torch
import torch.optim.optimizer as _torch_opt

from .. import _core
from . import _compile
from ._binding import TableBinding, _with_unscale  # noqa: F401
from ._checks import _check_loaded_steps
from ._engine import dtype_code, real_view
from ._group_values import (DeviceValue, _host_number, _host_view, _is_dense, _plain, _scalar_dtype,  # noqa: F401
                            _sig_key)
from ._precision import PRECISION_DOC, _chain_precision, _check_precision_options, _precision_of, _taking_precision_options
from ._step_paths import StepPaths, _dynamo_opaque  # noqa: F401

OptfuseError = _core.OptfuseError


class FusedOptimizer(TableBinding, StepPaths, torch.optim.Optimizer):
    """Base of the drop-in optimizers: torch's param_groups, state and state_dict format; one fused
    optfuse kernel per (chain, device) does the math."""

    _step_in_state = True              # torch's format keeps state["step"] per parameter
    _skips_only_on_found_inf = True    # the chain skips a step only when found_inf says so
    _sig_keys = ("lr",)
    _graph_step = True                 # under torch.compile, step() is the custom op (see _compile.py)

    @property
    def _step_supports_amp_scaling(self):
        """True only when torch.amp.GradScaler.step asks: it then hands us grad_scale / found_inf and
        the kernel unscales (no unscale pass of its own). Anyone else asking (Lightning refuses
        gradient clipping for optimizers that unscale internally, also under bf16 without a scaler)
        is told False, which is what they see of torch's non-fused optimizers."""
        caller = sys._getframe(1)
        return caller.f_code.co_name == "step" and isinstance(caller.f_locals.get("self"), torch.amp.GradScaler)

    def __init_subclass__(cls, **kw):
        # Every subclass takes the mixed-precision keywords without repeating them in its
        # signature: they are taken out here and become defaults of every param group.
        super().__init_subclass__(**kw)
        if "__init__" in cls.__dict__:
            cls.__init__ = _taking_precision_options(cls.__dict__["__init__"])
            if cls.__doc__ and PRECISION_DOC not in cls.__doc__:
                cls.__doc__ = cls.__doc__.rstrip() + "\n" + PRECISION_DOC

    def __init__(self, params, defaults):
        self._init_private()
        # Only options given become defaults (and param_group keys): without them, state dicts are
        # exactly torch's.
        defaults = dict(defaults)
        for k, v in self.__dict__.get("_precision_defaults", {}).items():
            defaults.setdefault(k, v)
        super().__init__(params, defaults)

    def _init_private(self):
        self._lock = threading.RLock()  # one step or rebuild at a time (an optimizer shared by threads)
        self._init_binding()
        self._graph = None     # what a traced step needs (_GraphLayout), None where it falls back
        self._foreign = False  # the op pointed the tables at tensors other than ours (copies)
        self._graph_id = _compile.register(self)
        self._graph_builds = 0
        keys = self._sig_keys
        if len(keys) > 1:
            get = operator.itemgetter(*keys)
        else:
            get = (lambda g, k=keys[0]: (g[k],)) if keys else (lambda g: ())
        # A precision option changing (a group key, present only where given) rebuilds too.
        self._sig_get = lambda g: (*get(g), g.get("master_weights"), g.get("state_dtype"),
                                   g.get("stochastic_rounding"), g.get("kahan"))

    def __getstate__(self):
        # deepcopy and pickling see torch's state as of the last step (per-parameter scalars the
        # engines keep, such as NAdam's mu_product, written into it first)
        with self._lock:
            self._sync_steps(write_state=True)
            return super().__getstate__()

    def __setstate__(self, state):
        # torch pickles only defaults, state and param_groups; after unpickling the tables are rebuilt
        super().__setstate__(state)
        if "_engines" not in self.__dict__:
            self._init_private()
        else:
            self._of_dirty = True
        self._fill_defaults()

    def _fill_defaults(self):
        """Groups from a state dict without some of this optimizer's keys (torch's, or an older
        torch's: no `maximize`, `nesterov`...) get the constructor's values, as torch's own
        __setstate__ fills them."""
        # (torch's Optimizer.__setstate__ puts `differentiable` in defaults, not in groups: a class
        # whose constructor has no such option keeps it out of its groups, as torch's does)
        cls = self._torch_class()
        fill = dict(_torch_setstate_keys(cls), **{k: v for k, v in self.defaults.items()
                                                  if k != "differentiable" or _torch_has_option(cls, k)})
        for g in self.param_groups:
            for k, v in fill.items():
                g.setdefault(k, v)

    # --- subclass interface (see module docstring)
    def _structure(self, group):
        return ()

    def _features(self, group):
        return frozenset()

    def _make_chain(self, key, features, groups):
        raise NotImplementedError

    def _hypers(self, group):
        return {"lr": float(group["lr"])}

    def _initial_step(self, state):
        """Step count of a parameter whose state has no 'step' (a format without it, e.g. SGD)."""
        return 0

    def _adjust_step(self, state, step, engine):
        return step

    def _check_param(self, p):
        """Refuses a parameter the kernels cannot step, when it is added. A complex parameter is
        stepped as torch steps it: its real view (torch.view_as_real), element-wise rules on real and
        imaginary parts, norms over both (which are the complex values' norms)."""
        if dtype_code(real_view(p)) is None:
            raise OptfuseError(f"{type(self).__name__}: parameters must be float32, float64, float16 or bfloat16, got "
                               f"{p.dtype} (shape {tuple(p.shape)})")

    # --- torch.optim.Optimizer API
    def add_param_group(self, param_group):
        with self._lock:
            super().add_param_group(param_group)
            group = self.param_groups[-1]
            for p in group["params"]:
                self._check_param(p)
            _check_precision_options(type(self).__name__, group)
            prec = _precision_of(group)
            for p in group["params"]:  # (master_weights on float32 parameters: refused now, not at the first step)
                if p.device.type != "meta":
                    _chain_precision(type(self).__name__, prec, real_view(p), len(self.param_groups) - 1)
            _host_view(group)  # CUDA-tensor hyperparameters read now, not when the first step is queued
            if group.get("differentiable", False) and self._torch_class() is None:
                raise OptfuseError(f"{type(self).__name__}: differentiable=True steps through torch's own class (autograd "
                                   "through the step), and torch.optim has no {type(self).__name__}")
            self._of_dirty = True

    def state_dict(self):
        with self._lock:
            self._sync_steps(write_state=True)
            return _steps_where_torch_keeps_them(self, super().state_dict())

    def _torch_step_on_device(self, group):
        """Whether torch's class keeps this group's state["step"] on the parameter's device
        (capturable or fused groups) rather than on the CPU."""
        return bool(group.get("capturable", False) or group.get("fused", False))

    def load_state_dict(self, state_dict):
        with self._lock:
            _check_loaded_steps(type(self).__name__, state_dict)
            saved = state_dict["state"]
            ids = [i for g in state_dict["param_groups"] for i in g["params"]]
            groups_before = list(self.param_groups)
            super().load_state_dict(state_dict)
            # torch puts new dicts in param_groups; the dicts stay ours instead, updated in place, so
            # whoever holds them (an lr scheduler, the optimizer fuse() was made from) keeps
            # steering this optimizer after a resume
            for i, (old, new) in enumerate(zip(groups_before, self.param_groups)):
                if old is not new:
                    old.clear()
                    old.update(new)
                    self.param_groups[i] = old
            self._fill_defaults()
            for g in self.param_groups:
                _host_view(g)  # (as add_param_group)
            # torch casts every state tensor to its parameter's dtype; optfuse states keep their own
            # (a float32 master or float32 moments beside a bfloat16 parameter, an int16 remainder).
            params = [p for g in self.param_groups for p in g["params"]]
            for pid, p in zip(ids, params):
                for k, v in saved.get(pid, {}).items():
                    st = self.state.get(p, {})
                    if k != "step" and torch.is_tensor(v) and torch.is_tensor(st.get(k)) and st[k].dtype != v.dtype:
                        st[k] = v.to(device=p.device, copy=True)
            self._forget_tables()

    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """One fused step. grad_scale / found_inf (one-element float32 tensors) default to the
        attributes torch.amp.GradScaler sets on optimizers with _step_supports_amp_scaling."""
        if _compile.compiling():
            return self._step_graph(closure, grad_scale, found_inf)
        self._opt_called = True  # what an lr scheduler's wrapper of step() would record (see below)
        origin = self.__dict__.get("_fused_from")
        if origin is not None and origin() is not None:  # fuse(opt): a scheduler bound to opt reads it there
            origin()._opt_called = True
        # hooks_active(self), written out: with the call, Dynamo (torch 2.11) compiled this frame's
        # callee _step_impl after a graph break and crashed on its attribute stores
        if (_torch_opt._global_optimizer_pre_hooks or _torch_opt._global_optimizer_post_hooks
                or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                or torch.autograd.profiler._is_profiler_enabled):
            return _step_with_hooks(self, closure, grad_scale=grad_scale, found_inf=found_inf)
        return self._step_impl(closure, grad_scale=grad_scale, found_inf=found_inf)

    # torch wraps step() in a profiler range and hook calls (several microseconds); marked as
    # already wrapped, step() takes that path only when hooks or the profiler are active.
    step.hooked = True
    # torch's lr schedulers replace opt.step by a wrapper (defined in a file Dynamo never traces: a graph
    # break under torch.compile) unless it carries this mark; the wrapper only sets _opt_called, which
    # step() does itself (eagerly: a traced step always follows an eager first step).
    step._wrapped_by_lr_sched = True

    def _step_impl(self, closure=None, *, grad_scale=None, found_inf=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        with self._lock:
            capturing = self._on_cuda and torch.cuda.is_current_stream_capturing()
            if capturing:
                self._check_capture()
            if self._of_dirty or not self._fresh():
                if capturing:
                    raise OptfuseError(f"{type(self).__name__}: the parameters or the set of gradients changed while "
                                       "a CUDA graph is being captured; run step() once outside the capture with the "
                                       "same gradients (torch's warm-up iterations) so that the capture only launches")
                self._rebuild()
            if self._foreign:
                self._restore_home()
            for src, dst in self._copies:
                dst.copy_(src)
            try:
                self._launch(grad_scale, found_inf, capturing)
            finally:  # (the gradients read by the check were kept alive through the launch)
                self._watch.release()
            if self._ustate_bufs:
                self._refresh_uniform_states()
            if self._by_torch:
                self._step_with_torch(grad_scale, found_inf)
        return loss

    # --- what torch's own class steps: differentiable=True groups, sparse gradients
    def _torch_class(self):
        """The torch.optim class this one replaces (None: none)."""
        cls = getattr(self, "_torch_cls", None) or getattr(torch.optim, type(self).__name__, None)
        return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None

    def _step_with_torch(self, grad_scale, found_inf):
        """Steps with torch's own class what a fused kernel cannot: groups that set
        differentiable=True (autograd through the step is their point) and parameters whose
        gradients are sparse (SGD, Adagrad), on the same state and the current group values, so
        state dicts stay one and in torch's format."""
        d = self.__dict__.get("_torch_delegate")
        if d is None:  # (made once per rebuild: torch's constructor validates)
            cls = self._torch_class()
            d = cls.__new__(cls)
            groups = [g if ps is None else dict(g, params=list(ps)) for g, ps in self._by_torch]
            torch.optim.Optimizer.__init__(d, groups, dict(self.defaults, differentiable=True))
            self.__dict__["_torch_delegate"] = d
        # the very dicts of whole groups (differentiable: their tensors' autograd), fresh copies of
        # the current values for parameter subsets
        d.param_groups = [g if ps is None else dict(g, params=ps) for g, ps in self._by_torch]
        d.defaults["differentiable"] = any(g.get("differentiable", False) for g, _ in self._by_torch)
        d.state = self.state
        if grad_scale is not None or found_inf is not None:
            d.grad_scale, d.found_inf = grad_scale, found_inf
        # torch's step below its hook wrapper: this optimizer's step() already ran the hooks once
        step = type(d).step
        step = step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step
        step(d)


def _steps_where_torch_keeps_them(opt, sd):
    """The state dict with each "step" on the device torch's class keeps it on for that group (the
    CPU unless capturable or fused): the live step tensors stay where the launch advances them (on
    the device, so that a GradScaler skip needs no synchronisation); the dict torch saves and loads
    has torch's format. The entries changed are new dicts (the others are opt.state's own)."""
    by_device = {}
    for g_saved, g in zip(sd["param_groups"], opt.param_groups):
        on_device = opt._torch_step_on_device(g)
        for i, p in zip(g_saved["params"], g["params"]):
            st = sd["state"].get(i)
            t = st.get("step") if st else None
            where = p.device if on_device else torch.device("cpu")
            if torch.is_tensor(t) and t.device != where:
                by_device.setdefault(where, []).append((i, t))
    for where, items in by_device.items():  # (one copy per destination: one synchronisation, not one per parameter)
        moved = torch.stack([t for _, t in items]).to(where).unbind(0)
        for (i, _), m in zip(items, moved):
            sd["state"][i] = dict(sd["state"][i], step=m)
    return sd


_SETSTATE_KEYS = {}


def _torch_setstate_keys(cls):
    """The group keys (and values) torch's class `cls` fills in when it loads a group without them
    (its __setstate__'s setdefault calls: `differentiable` for Adafactor, `maximize` for SGD...)."""
    if cls is None:
        return {}
    if cls not in _SETSTATE_KEYS:
        keys = {}
        try:
            dummy = torch.zeros(1, requires_grad=True)
            t = cls([dummy])
            t.__setstate__({"state": {}, "param_groups": [{"params": [dummy]}]})
            keys = {k: v for k, v in t.param_groups[0].items() if k != "params"}
        except Exception:  # noqa: BLE001 (a class whose __setstate__ needs more: nothing to add)
            keys = {}
        _SETSTATE_KEYS[cls] = keys
    return _SETSTATE_KEYS[cls]


def _torch_has_option(cls, key):
    """Whether torch's class `cls` (None: no torch class) has the constructor option `key`."""
    return cls is None or key in inspect.signature(cls.__init__).parameters


def _run_step_impl(self, *args, **kwargs):
    return self._step_impl(*args, **kwargs)  # a subclass's own _step_impl (AdamWScheduleFree's)


_step_with_hooks = torch.optim.Optimizer.profile_hook_step(_run_step_impl)


def hooks_active(opt):
    """Whether step() must go through torch's wrapper: step hooks registered (globally or on opt) or
    the autograd profiler on. Otherwise the wrapper's profiler range and hook calls (several
    microseconds) are skipped: optimizers mark their step() as already wrapped (step.hooked)."""
    return bool(_torch_opt._global_optimizer_pre_hooks or _torch_opt._global_optimizer_post_hooks
                or opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or torch.autograd.profiler._is_profiler_enabled)
