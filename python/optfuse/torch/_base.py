"""The torch.optim.Optimizer subclass every optfuse.torch optimizer derives from.

Per step, the common case costs one C++ pass over the parameters (is every .grad the tensor the
table was built from?), a comparison of each group's hyperparameters with the values last pushed,
and one call into the core per engine. Anything else (new parameters, gradients appearing or
disappearing, a structural option changing, load_state_dict) marks the optimizer dirty and the next
step rebuilds the tables.

Subclasses describe how torch's group options map onto optfuse chains (the first three are handed
_host_view(group): numbers only, see "Tensor hyperparameters" below):
  _structure(group) -> hashable key: groups with different keys get different chains (engines)
  _features(group)  -> set of optional rules the group needs (e.g. {"weight_decay"})
  _make_chain(key, features, groups) -> the chain (without unscale_by_grad_scale)
  _hypers(group)    -> {optfuse hyperparameter name: value} (a number, or a one-element tensor that
                       the engine binds so the kernel reads it at every step)
  _sig_keys         -> group keys whose change must be noticed (hyperparameters and structure)

Mixed precision (every subclass; constructor keywords and param_group keys, see _PRECISION):
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

CUDA graphs: a captured step reads every hyperparameter from device memory at each replay, so a
capture is refused while some hyperparameter is a Python number (its capture-time value would be
replayed for ever, whatever a scheduler sets later): give them as CUDA tensors.
torch.compile: traced, step() checks that the tables of the last eager step still fit (Dynamo guards
on what it reads) and calls the custom op optfuse::fused_step with every tensor in table order
(_compile.py): no graph break, and a tensor lr is a graph input, so a scheduler never recompiles.
The op acts on the tensors it is handed (functionalization may hand it copies); the next eager step
points the tables back at the optimizer's own tensors. Whatever the traced check cannot vouch for
(the first step, a rebuild, a closure, hooks) runs the eager step: one graph break.
"""
import math
import operator

import torch
import torch.optim.optimizer as _torch_opt
from torch.utils.weak import WeakIdKeyDictionary

from .. import _core
from . import _compile, _dtensor
from ._engine import Engine, dtype_code

OptfuseError = _core.OptfuseError
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass

# Mixed-precision options of every optfuse.torch optimizer (constructor keywords and param_group
# keys) and their defaults: the defaults step every role in the parameter's dtype, as torch does.
_PRECISION = {"master_weights": False, "state_dtype": None, "stochastic_rounding": False, "kahan": False}
_LOW = (torch.float16, torch.bfloat16)


def _scalar_dtype():
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _plain(v):
    return float(v) if torch.is_tensor(v) else v


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
        return ("tensor", id(v)) if v.is_cuda else float(v)
    if isinstance(v, (tuple, list)):
        return tuple(_sig_key(x) for x in v)
    return v


def _dynamo_opaque(fn):
    """fn runs eagerly under torch.compile (a graph break around it), never traced."""
    disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
    return disable(fn) if disable is not None else fn


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


class FusedOptimizer(torch.optim.Optimizer):
    """Base of the drop-in optimizers: torch's param_groups, state and state_dict format; one fused
    optfuse kernel per (chain, device) does the math."""

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf: no unscale pass
    _step_in_state = True              # torch's format keeps state["step"] per parameter
    _skips_only_on_found_inf = True    # the chain skips a step only when found_inf says so
    _sig_keys = ("lr",)
    _graph_step = True                 # under torch.compile, step() is the custom op (see _compile.py)

    def __init_subclass__(cls, **kw):
        # Every subclass takes the mixed-precision keywords without repeating them in its
        # signature: they are taken out here and become defaults of every param group.
        super().__init_subclass__(**kw)
        if "__init__" in cls.__dict__:
            cls.__init__ = _taking_precision_options(cls.__dict__["__init__"])

    def __init__(self, params, defaults):
        self._init_private()
        # Only options given become defaults (and param_group keys): without them, state dicts are
        # exactly torch's.
        defaults = dict(defaults)
        for k, v in self.__dict__.get("_precision_defaults", {}).items():
            defaults.setdefault(k, v)
        super().__init__(params, defaults)

    def _init_private(self):
        self._of_dirty = True
        self._engines = {}
        self._watch = None
        self._watch_dtensors = False
        self._zero_later = None  # during a rebuild: new states to zero (_states_for)
        self._private_states = WeakIdKeyDictionary()  # parameter -> {name: state torch does not save}
        self._steps = {}
        self._ustates = {}  # parameter -> {uniform state name: value} read back from the engines
        self._sigs = []
        self._keys = []
        self._features_by_key = {}
        self._copies = []
        self._tensor_hypers = False
        self._on_cuda = False
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

    def __setstate__(self, state):
        # torch pickles only defaults, state and param_groups; after unpickling the tables are rebuilt
        super().__setstate__(state)
        if "_engines" not in self.__dict__:
            self._init_private()
        else:
            self._of_dirty = True
        self._fill_precision_keys()

    def _fill_precision_keys(self):
        """Groups from a state dict without this optimizer's mixed-precision options (torch's, or
        older) get the constructor's values."""
        for g in self.param_groups:
            for k in _PRECISION:
                if k in self.defaults:
                    g.setdefault(k, self.defaults[k])

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
        """Refuses a parameter the kernels cannot step, when it is added."""
        if torch.is_complex(p):
            raise OptfuseError(f"{type(self).__name__}: complex parameters are not supported (shape {tuple(p.shape)})")
        if dtype_code(p) is None:
            raise OptfuseError(f"{type(self).__name__}: parameters must be float32, float16 or bfloat16, got "
                               f"{p.dtype} (shape {tuple(p.shape)})")

    # --- torch.optim.Optimizer API
    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            self._check_param(p)
        _check_precision_options(type(self).__name__, group)
        _host_view(group)  # CUDA-tensor hyperparameters read now, not when the first step is queued
        if group.get("differentiable", False):
            raise OptfuseError(f"{type(self).__name__}: differentiable=True is not supported (optfuse steps "
                               "parameters in place, outside autograd)")
        self._of_dirty = True

    def state_dict(self):
        self._sync_steps(write_state=True)
        return super().state_dict()

    def load_state_dict(self, state_dict):
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        self._fill_precision_keys()
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
        for e in self._engines.values():
            e.params, e.groups, e.group_of, e.indices = [], [], [], []
        self._steps = {}  # re-read from the loaded state
        self._ustates = {}
        self._of_dirty = True

    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """One fused step. grad_scale / found_inf (one-element float32 tensors) default to the
        attributes torch.amp.GradScaler sets on optimizers with _step_supports_amp_scaling."""
        if _compile.compiling():
            return self._step_graph(closure, grad_scale, found_inf)
        self._opt_called = True  # what an lr scheduler's wrapper of step() would record (see below)
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
        capturing = self._on_cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            self._check_capture()
        if self._of_dirty or not self._fresh():
            if capturing:
                raise OptfuseError(f"{type(self).__name__}: the parameters or the set of gradients changed while a "
                                   "CUDA graph is being captured; run step() once outside the capture with the "
                                   "same gradients (torch's warm-up iterations) so that the capture only launches")
            self._rebuild()
        if self._foreign:
            self._restore_home()
        for src, dst in self._copies:
            dst.copy_(src)
        for e in self._engines.values():
            e.step(grad_scale, found_inf, capturing)
        return loss

    def _check_capture(self, hypers=None):
        """Refuses a CUDA graph capture that would replay stale hyperparameters."""
        floats = []
        for i, h in enumerate(hypers if hypers is not None else [self._hypers(g) for g in self.param_groups]):
            for name, value in h.items():
                if not (torch.is_tensor(value) and value.is_cuda):
                    floats.append(f"{name} (group {i})")
        if floats:
            raise OptfuseError(f"{type(self).__name__}: cannot capture step() in a CUDA graph while hyperparameters are "
                               f"Python numbers: {', '.join(floats)}. A replay would use their values at capture time "
                               "whatever a scheduler sets later. Pass them as CUDA tensors (e.g. "
                               "lr=torch.tensor(1e-3, device='cuda'), capturable=True); the kernel reads them at every "
                               "replay and schedulers update them in place.")

    # --- torch.compile (see _compile.py)
    def _step_graph(self, closure, grad_scale, found_inf):
        """step() as Dynamo traces it: the custom op when the tables of the last eager step still
        fit, else the eager step (a graph break). Only reads: Dynamo guards on what it reads here, so
        a change of any of it (a rebuild, a gradient appearing or vanishing...) retraces."""
        layout = self._graph
        if (closure is not None or layout is None or self._of_dirty or not self._graph_step
                or _torch_opt._global_optimizer_pre_hooks or _torch_opt._global_optimizer_post_hooks
                or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                or (layout.cuda and not _compile.CUDAGRAPH_TAGGED) or _compile.OP is None):
            return _eager_step(self, closure, grad_scale=grad_scale, found_inf=found_inf)
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if not ((grad_scale is None or torch.is_tensor(grad_scale)) and (found_inf is None or torch.is_tensor(found_inf))):
            return _eager_step(self, closure, grad_scale=grad_scale, found_inf=found_inf)
        groups = self.param_groups
        if len(groups) != len(layout.hyper_names):
            return _eager_step(self, closure, grad_scale=grad_scale, found_inf=found_inf)
        grads = []
        for p in layout.params:
            g = p.grad
            if g is None or not (g.stride() == p.stride() or (g.is_contiguous() and p.is_contiguous())):
                return _eager_step(self, closure, grad_scale=grad_scale, found_inf=found_inf)
            grads.append(g)
        for p in layout.others:
            if p.grad is not None:
                return _eager_step(self, closure, grad_scale=grad_scale, found_inf=found_inf)
        tensors, values, kinds = [], [], []
        for i, g in enumerate(groups):
            frozen = layout.frozen[i]
            if frozen:  # tensor values as they were when the tables were built: they never change the structure
                g = {k: frozen.get(k, v) for k, v in g.items()}
            if (self._structure(g) != layout.keys[i] or not self._features(g) <= layout.features[i]
                    or _precision_key(g) != layout.precisions[i]):
                return _eager_step(self, closure, grad_scale=grad_scale, found_inf=found_inf)
        for i, g in enumerate(groups):
            h = self._hypers(g)
            names = layout.hyper_names[i]
            if len(h) != len(names):
                return _eager_step(self, closure, grad_scale=grad_scale, found_inf=found_inf)
            for name in names:
                v = h[name]
                if torch.is_tensor(v):
                    tensors.append(v)
                    kinds.append(1)
                else:
                    values.append(float(v))
                    kinds.append(0)
        with torch.no_grad():
            _compile.OP(layout.key, layout.params, grads, layout.states, tensors, values, kinds, grad_scale, found_inf)
        return None

    def _step_from_graph(self, key, params, grads, states, hypers, values, kinds, grad_scale, found_inf):
        """The op's implementation: one step on the tensors passed (table order), which may be copies
        of ours (functionalization), with the hyperparameters passed (tensors bound, numbers pushed)."""
        layout = self._graph
        if layout is None or layout.key != key or self._of_dirty:
            raise OptfuseError(f"{type(self).__name__}: a compiled step was traced for tables that have been rebuilt "
                               "since (a guard of torch.compile missed a change); please report this")
        it_t, it_v = iter(hypers), iter(values)
        per_group, k = [], 0
        for names in layout.hyper_names:
            h = {}
            for name in names:
                h[name] = next(it_t) if kinds[k] else next(it_v)
                k += 1
            per_group.append(h)
        if layout.host_frozen:
            self._check_frozen_structure(layout)
        capturing = self._on_cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            self._check_capture(per_group)
        for i, h in enumerate(per_group):
            for e in self._engines.values():
                e.push_hypers(i, h)
        for e, (a, b, c, d) in zip(self._engines.values(), layout.slices):
            if e.core._patch_pointers(params[a:b], grads[a:b], states[c:d]):
                self._foreign = True
        # The next eager step compares every group with what it last pushed, not with what this pushed.
        self._sigs = [_STALE] * len(self._sigs)
        for e in self._engines.values():
            e.step(grad_scale, found_inf, capturing)

    def _check_frozen_structure(self, layout):
        """A CPU tensor hyperparameter whose value decides the chain (weight_decay 0 or not...)
        changed it: the traced step cannot rebuild the tables, so it says so rather than step wrong."""
        for i, g in enumerate(self.param_groups):
            frozen = layout.frozen[i]
            if not frozen or all(not torch.is_tensor(g.get(k)) or g[k].is_cuda or float(g[k]) == v
                                 for k, v in frozen.items()):
                continue
            h = _host_view(g)
            if self._structure(h) != layout.keys[i] or not self._features(h) <= layout.features[i]:
                raise OptfuseError(f"{type(self).__name__}: a tensor hyperparameter of group {i} changed in a way that "
                                   "changes the compiled chain (e.g. weight_decay from 0 to non-zero) inside a "
                                   "torch.compile'd step, which cannot rebuild the tables; run one eager step() after "
                                   "such a change, or give the hyperparameter a non-zero value from the start")

    def _restore_home(self):
        """Points the tables back at the optimizer's own parameters and states (a compiled step may
        have pointed them at copies), and the gradients at the current .grad tensors."""
        for e in self._engines.values():
            if e.params:
                e.core._patch_pointers(e.params, None, e.states)
                e.core._take_grads(self._watch)
        self._foreign = False

    def _make_graph_layout(self, groups):
        if not self._graph_step or self._copies:
            return None
        params, states, slices = [], [], []
        for e in self._engines.values():
            a, c = len(params), len(states)
            params += e.params
            states += e.states
            slices.append((a, len(params), c, len(states)))
        stepping = {id(p) for p in params}
        self._graph_builds += 1
        return _GraphLayout(
            key=f"{self._graph_id}.{self._graph_builds}", params=params, states=states, slices=slices,
            others=[p for g in groups for p in g["params"] if id(p) not in stepping],
            hyper_names=[tuple(self._hypers(g)) for g in groups],
            frozen=[{k: float(_host_number(v)) for k, v in g.items() if torch.is_tensor(v) and v.numel() == 1}
                    for g in groups],
            keys=list(self._keys), features=[self._engine_features(i) for i in range(len(groups))],
            precisions=[_precision_key(g) for g in groups], cuda=self._on_cuda,
            host_frozen=any(torch.is_tensor(v) and not v.is_cuda for g in groups for v in g.values()))

    # --- internals
    def _fresh(self):
        """True when the tables are still right for this step (pushing changed hyperparameters)."""
        groups = self.param_groups
        if len(groups) != len(self._sigs):
            return False
        get = self._sig_get
        for i, g in enumerate(groups):
            sig = get(g)
            if self._tensor_hypers:
                sig = _sig_key(sig)
            if sig != self._sigs[i]:  # (a scheduler's float lr: every step, so no host view without tensors)
                h = _host_view(g) if self._tensor_hypers else g
                if (self._structure(h) != self._keys[i] or not self._features(h) <= self._engine_features(i)
                        or _precision_of(g) != self._precisions[i]):
                    return False
                hypers = self._hypers(g)
                for e in self._engines.values():
                    e.push_hypers(i, hypers)
                self._sigs[i] = sig
        if self._watch_dtensors:
            # DTensor parameters (FSDP2): their .grad read without __torch_function__ dispatch (DTensor's
            # is the disabled one, so the getter returns the same object; about 0.3 us per parameter)
            with _NO_TORCH_FUNCTION():
                r = self._watch.check()  # (also: a local tensor replaced, as FSDP2 does on a load)
        else:
            r = self._watch.check()
        if r == 0:
            return True
        if r == 1 and not self._copies:
            for e in self._engines.values():
                e.core._take_grads(self._watch)
            return True
        return False

    def _engine_features(self, tg):
        return self._features_by_key.get(self._keys[tg], frozenset())

    def _sync_steps(self, write_state=False):
        for e in self._engines.values():
            for p, count in e.steps():
                self._steps[p] = count
            for p, values in e.uniform_states():
                self._ustates[p] = values
        if write_state and self._step_in_state:
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state.get(p)
                    if st and p in self._steps:
                        st["step"] = torch.tensor(float(self._steps[p]), dtype=_scalar_dtype())
        if write_state:
            # Uniform states (NAdam's mu_product) into torch's format: a 0-dim tensor per parameter,
            # new (as step), of the dtype and device the state had (torch's capturable keeps it on
            # the parameter's device).
            for p, values in self._ustates.items():
                st = self.state.get(p)
                if not st:
                    continue
                for name, value in values.items():
                    old = st.get(name)
                    like = old if torch.is_tensor(old) else None
                    st[name] = torch.tensor(value, dtype=like.dtype if like is not None else _scalar_dtype(),
                                            device=like.device if like is not None else None)

    def _ustates_of(self, p, st, engine):
        """Parameter p's uniform-state values for the engine's table: read back from an engine, else
        from its state (a loaded state dict's 0-dim tensors), else the init values. Also puts each in
        the state (torch's keys), so state dicts have them from the first step."""
        if not engine.uniform_state_specs:
            return None
        known = self._ustates.get(p, {})
        out = []
        for name, init in engine.uniform_state_specs:
            if name in known:
                value = float(known[name])
            elif name in st:
                value = float(_plain(st[name]))
            else:
                value = float(init)
                st[name] = torch.tensor(value, dtype=_scalar_dtype())
            out.append(value)
        return tuple(out)

    def _step_of(self, p):
        if p not in self._steps:
            st = self.state.get(p) or {}
            self._steps[p] = int(_plain(st["step"])) if "step" in st else self._initial_step(st)
        return self._steps[p]

    def _rebuild(self):
        self._sync_steps()
        groups = self.param_groups
        hosts = [_host_view(g) for g in groups]
        self._keys = [self._structure(h) for h in hosts]
        self._precisions = [_precision_of(g) for g in groups]
        self._features_by_key = {}
        for k, h in zip(self._keys, hosts):
            self._features_by_key[k] = self._features_by_key.get(k, frozenset()) | self._features(h)
        params = [p for g in groups for p in g["params"]]
        dtensors = [p for p in params if _dtensor.is_dtensor(p)]
        grads = self._watch_gradients(params, dtensors)
        buckets = {}
        w = 0
        for tg, g in enumerate(groups):
            for p in g["params"]:
                grad = grads[w]
                if grad is not None:
                    if grad.is_sparse:
                        raise OptfuseError(f"{type(self).__name__}: sparse gradients are not supported "
                                           f"(parameter of shape {tuple(p.shape)} in group {tg})")
                    lp = _dtensor.local(p)  # the tensor the kernel steps: p, or a DTensor's local shard
                    if lp is not p:
                        _dtensor.check_grad(type(self).__name__, p, tg)
                    if not _is_dense(lp):
                        raise OptfuseError(f"{type(self).__name__}: parameter of shape {tuple(p.shape)} (group {tg}) "
                                           f"overlaps itself or has gaps (strides {p.stride()}); optfuse needs "
                                           "dense parameters")
                    storage = _chain_precision(type(self).__name__, self._precisions[tg], p, tg)
                    buckets.setdefault((self._keys[tg], p.device, storage), []).append((p, grad, tg, w, lp))
                w += 1
        engines, self._copies = {}, []
        for (key, device, storage), items in buckets.items():
            feats = self._features_by_key[key]
            chain = _with_unscale(self._make_chain(key, feats, [h for k, h in zip(self._keys, hosts) if k == key]))
            text = _core.chain_text(chain)
            old = self._engines.get((key, device, storage))
            engine = (old if old is not None and old.chain_text == text
                      else Engine(chain, device, self._skips_only_on_found_inf, *storage))
            engine.chain_text = text
            entries = []
            # New zero states are zeroed together (torch._foreach_zero_: a few launches, where a fill_
            # per state would be thousands and could fill CUDA's launch queue behind queued work)
            self._zero_later = []
            try:
                for p, grad, tg, w, lp in items:
                    # torch keeps no state entry for a parameter whose optimizer holds none (SGD
                    # without momentum): neither do we, so state dicts have the same keys.
                    st = self.state[p] if (engine.state_names or self._step_in_state) else self.state.get(p, {})
                    step = self._adjust_step(st, self._step_of(p), engine)
                    self._steps[p] = step
                    prec = self._precisions[tg]
                    states = self._states_for(p, st, engine, prec)
                    # Stochastic rounding: the parameter's stores unless a master copy holds its value.
                    stochastic = (prec.stochastic_rounding and storage[0] == "none", prec.stochastic_rounding)
                    entries.append((p, self._grad_for(lp, grad), states, tg, step, w, stochastic,
                                    self._rng_stream(p, w), self._ustates_of(p, st, engine)))
            finally:  # (also when a state fails: no state is left unzeroed in self.state)
                zero, self._zero_later = self._zero_later, None
                if zero:  # (a DTensor state: its local shard)
                    torch._foreach_zero_([_dtensor.local(t) for t in zero])
            engine.build(entries, lambda tg: self._hypers(groups[tg]))
            if engine.core.plan.reduction_scopes and any(lp is not p for p, _, _, _, lp in items):
                _dtensor.set_mesh_exchange(type(self).__name__, engine)  # FSDP2: reductions over the mesh
            built = self.__dict__.get("_on_engine_built")  # a sharded optimizer sets its exchange
            if built is not None:
                built(engine)
            engines[(key, device, storage)] = engine
        self._engines = engines
        sigs = [self._sig_get(g) for g in groups]
        self._tensor_hypers = any(torch.is_tensor(x) for s in sigs for v in s
                                  for x in (v if isinstance(v, (tuple, list)) else (v,)))
        self._sigs = [_sig_key(s) if self._tensor_hypers else s for s in sigs]
        self._on_cuda = any(device.type == "cuda" for _, device, _ in engines)
        self._foreign = False
        # DTensor parameters: the eager step (the custom op would be handed DTensors, not their shards)
        self._graph = None if dtensors else self._make_graph_layout(groups)
        self._of_dirty = False

    def _watch_gradients(self, params, dtensors):
        """Makes the GradWatch that each step() asks whether gradients moved; returns each parameter's
        gradient (None where absent) as the kernel reads it.
        - A DTensor parameter (FSDP2) is watched through its gradient's local shard (`_local_tensor`).
        - A ZeRO stage-1 piece (`_grad_sources`: id(piece) -> (parameter, first element)) is watched
          through its parameter's gradient at the piece's offset: no view per piece and step."""
        self._watch_dtensors = bool(dtensors)
        sources = self.__dict__.get("_grad_sources")
        if sources is None:
            self._watch = _core._GradWatch(params, [], [_dtensor.is_dtensor(p) for p in params] if dtensors else [])
            return self._watch.snapshot()
        whole = [sources[id(p)][0] for p in params]
        self._watch = _core._GradWatch(whole, [sources[id(p)][1] * p.element_size() for p in params])
        grads = []
        for p, g in zip(params, self._watch.snapshot()):
            if g is not None:
                if not g.is_contiguous():
                    raise OptfuseError(f"ZeRO: gradients must be contiguous (shape {tuple(g.shape)}, strides {g.stride()})")
                begin = sources[id(p)][1]
                g = g.view(-1)[begin:begin + p.numel()]
            grads.append(g)
        return grads

    def _rng_stream(self, p, w):
        """Stochastic rounding's stream of parameter p (its position w among all parameters): the key
        w + 1 from element 0; a sharded optimizer maps its pieces to their parameter's key and offset."""
        streams = self.__dict__.get("_rng_streams")
        if streams is not None and id(p) in streams:
            return streams[id(p)]
        return (w + 1, 0)

    def _saved_key(self, p, name):
        """Where the engine's state `name` of parameter p is kept: its key in self.state[p] (torch's
        name for it), or None for a state torch's format has no key for (kept in
        self._private_states, never saved)."""
        return name

    def _state_shape(self, p, name):
        """The shape of state `name` of p (contiguous), or None: the parameter's shape and layout."""
        return None

    def _states_for(self, p, st, engine, prec):
        if self._step_in_state and "step" not in st:
            st["step"] = torch.tensor(float(self._steps.get(p, 0)), dtype=_scalar_dtype())
        out = []
        for name, init, (from_param, fixed) in zip(engine.state_names, engine.state_inits, engine.state_storage):
            dtype = fixed or _state_dtype(prec, p, name)
            key, shape = self._saved_key(p, name), self._state_shape(p, name)
            home = st if key is not None else self._private_states.setdefault(p, {})
            key = name if key is None else key

            def new():  # in the parameter's layout (or the state's own shape) and the role's dtype
                if shape is None:
                    return torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)
                return torch.empty(shape, dtype=dtype, device=p.device)

            t = home.get(key)
            fresh = t is None
            if fresh:
                t = new()
                if from_param:
                    with torch.no_grad():  # a state, never part of the autograd graph
                        t.copy_(p)  # a master copy starts as the parameter
                elif init == 0 and self._zero_later is not None:
                    self._zero_later.append(t)  # zeroed with the others in one multi-tensor launch
                else:
                    t.fill_(init)
            else:
                if _dtensor.is_dtensor(p) and not _dtensor.is_dtensor(t):
                    t = _dtensor.as_state(t, p)  # a plain tensor from a state dict saved without FSDP2
            wrong_layout = (t.shape != p.shape or t.stride() != p.stride()
                            or _dtensor.local(t).stride() != _dtensor.local(p).stride()) if shape is None else (
                tuple(t.shape) != tuple(shape) or not t.is_contiguous())
            if not fresh and (t.dtype != dtype or t.device != p.device or wrong_layout):
                # A state of another dtype or layout (a torch state dict, a changed state_dtype):
                # converted once into the layout and dtype the kernel steps.
                if shape is not None and t.numel() != math.prod(shape):
                    raise OptfuseError(f"{type(self).__name__}: state '{key}' of the parameter of shape "
                                       f"{tuple(p.shape)} has shape {tuple(t.shape)}; expected {tuple(shape)}")
                converted = new()
                with torch.no_grad():
                    converted.copy_(t.reshape(converted.shape) if shape is not None else t)
                t = converted
            home[key] = t
            out.append(t)
        return out

    def _grad_for(self, p, grad):
        if grad.stride() == p.stride() or (grad.is_contiguous() and p.is_contiguous()):
            return grad
        # A gradient laid out unlike its parameter: step from a copy in the parameter's layout,
        # refreshed before every step while this gradient tensor stays.
        buf = torch.empty_like(p, memory_format=torch.preserve_format)
        self._copies.append((grad, buf))
        return buf


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


_STALE = object()  # a group signature no group has: the next _fresh() checks and pushes that group


def _eager_step_fn(self, closure=None, *, grad_scale=None, found_inf=None):
    return self.step(closure, grad_scale=grad_scale, found_inf=found_inf)


# The eager step called from a traced one (a graph break): outside Dynamo, step() takes the eager path.
_eager_step = _dynamo_opaque(_eager_step_fn)


class _GraphLayout:
    """What a traced step reads (and Dynamo guards on): the tables' tensors in table order, the
    parameters that had no gradient, per torch group its hyperparameter names, the tensor values the
    structure was decided with, the structure; and per engine its slice of the lists."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _precision_key(g):
    """A group's mixed-precision options as a plain tuple (what _precision_of normalises)."""
    mw = g.get("master_weights", False)
    return ("remainders" if mw == "remainders" else ("copy" if mw else "none"), g.get("state_dtype"),
            bool(g.get("stochastic_rounding", False)), bool(g.get("kahan", False)))


class _Precision(tuple):
    """A group's mixed-precision options, normalised: (master_weights, state_dtype, stochastic_rounding, kahan)."""
    master_weights = property(operator.itemgetter(0))
    state_dtype = property(operator.itemgetter(1))
    stochastic_rounding = property(operator.itemgetter(2))
    kahan = property(operator.itemgetter(3))


def _precision_of(g):
    mw = g.get("master_weights", False)
    master = "remainders" if mw == "remainders" else ("copy" if mw else "none")
    return _Precision((master, g.get("state_dtype"), bool(g.get("stochastic_rounding", False)),
                       bool(g.get("kahan", False))))


def _check_precision_options(cls_name, g):
    mw = g.get("master_weights", False)
    if not (mw is True or mw is False or mw == "remainders"):
        raise OptfuseError(f"{cls_name}: master_weights must be False, True or 'remainders', got {mw!r}")
    sd = g.get("state_dtype")
    if sd is not None and sd not in (torch.float32, torch.bfloat16, torch.float16):
        raise OptfuseError(f"{cls_name}: state_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
                           f"got {sd!r}")
    for k in ("stochastic_rounding", "kahan"):
        if not isinstance(g.get(k, False), bool):
            raise OptfuseError(f"{cls_name}: {k} must be True or False, got {g.get(k)!r}")
    if mw and g.get("kahan", False):
        raise OptfuseError(f"{cls_name}: kahan=True compensates the rounding of parameters stored without a master "
                           "copy; with master_weights nothing is rounded away: choose one")
    if g.get("kahan", False) and g.get("stochastic_rounding", False):
        raise OptfuseError(f"{cls_name}: kahan=True and stochastic_rounding=True are two answers to the same rounding "
                           "of the parameter: choose one")


def _chain_precision(cls_name, prec, p, tg):
    """(master weights, kahan dtype name or None) of the chain stepping parameter p (its engine key)."""
    if prec.master_weights != "none" or prec.kahan:
        what = "master_weights" if prec.master_weights != "none" else "kahan"
        if p.dtype not in _LOW:
            raise OptfuseError(f"{cls_name}: {what} is for float16/bfloat16 parameters, but group {tg} has a {p.dtype} "
                               f"parameter of shape {tuple(p.shape)}; put float32 parameters in a param group with "
                               f"{what}=False")
        if prec.master_weights == "remainders" and p.dtype != torch.bfloat16:
            raise OptfuseError(f"{cls_name}: master_weights='remainders' rebuilds a float32 master from a bfloat16 "
                               f"parameter; group {tg} has a {p.dtype} parameter of shape {tuple(p.shape)} "
                               "(use master_weights=True)")
    kahan = str(p.dtype).replace("torch.", "") if prec.kahan else None
    return (prec.master_weights, kahan)


def _state_dtype(prec, p, name):
    """The dtype of a rule state: state_dtype, else float32 beside a master copy, else the parameter's."""
    if name == "kahan_comp":
        return p.dtype
    if prec.state_dtype is not None:
        return prec.state_dtype
    return torch.float32 if prec.master_weights != "none" else p.dtype


def _taking_precision_options(init):
    import functools

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in _PRECISION}
        if given or "_precision_defaults" not in self.__dict__:
            self.__dict__["_precision_defaults"] = given
        init(self, *args, **kwargs)
    return wrapper


def _with_unscale(chain):
    """Every torch-facing chain starts with unscale_by_grad_scale (a no-op without a GradScaler)."""
    if chain and chain[0].name == "unscale_by_grad_scale":
        return list(chain)
    return _core.make_builtin("unscale_by_grad_scale") + list(chain)
