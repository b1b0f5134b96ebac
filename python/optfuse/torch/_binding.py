"""The binding between torch's tensors and the engines' tables: the one place that reads torch's
state (parameters, gradients, states, step counts, param groups) and decides, at every step, whether
the tables still describe it (nothing to do), only gradient pointers moved (re-point), or anything
else changed (rebuild from torch's objects, refusing there what the kernels cannot step).
A mixin of FusedOptimizer (_base.py); see docs/architecture.md, "The Python package"."""
import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _core
from . import _dtensor
from ._engine import Engine, _on_device
from ._group_values import _host_view, _is_dense, _plain, _scalar_dtype, _sig_key
from . import _q8
from ._precision import _chain_precision, _precision_of, _state_dtype
from ._checks import _check_aliasing, _check_grad, _step_count

OptfuseError = _core.OptfuseError
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass


class TableBinding:
    """Builds the engines' tables from torch's objects and checks them at every step."""

    def _init_binding(self):
        self._of_dirty = True
        self._engines = {}
        self._watch = None
        self._watch_dtensors = False
        self._zero_later = None  # during a rebuild: new states to zero (_states_for)
        self._private_states = WeakIdKeyDictionary()  # parameter -> {name: state torch does not save}
        self._steps = {}    # parameter -> step count, as the engines last reported it
        self._ustates = {}  # parameter -> {uniform state name: value} read back from the engines
        self._step_views = WeakIdKeyDictionary()  # parameter -> the state["step"] tensor the step advances
        self._ustate_views = WeakIdKeyDictionary()  # parameter -> {uniform state name: the view refreshed}
        # parameter -> {uniform state name: the tensor optfuse last put in its state (a view above, or
        # one CUDA engines leave behind)}: the engines' values are newer; one loaded or set by hand wins
        self._ustate_written = WeakIdKeyDictionary()
        self._ustate_bufs = []  # (tensor the views view, engine, names) per CPU engine with uniform states
        self._step_bufs = []  # per engine whose steps are counted: (the tensor the views view, engine)
        self._plain_launch = None  # the calls of a plain CPU step (_make_plain_launch)
        self._gathers = []   # (parameter with gaps, the dense copy the kernel steps)
        self._dense_of = {}  # id(parameter) -> its dense copy
        self._sigs = []
        self._keys = []
        self._features_by_key = {}
        self._copies = []
        self._tensor_hypers = False
        self._on_cuda = False
        self._by_torch = []  # (group, its parameters or None: all) that torch's own class steps
        self._differentiable_flags = []

    def _forget_tables(self):
        """After load_state_dict: nothing of the old tables is trusted; the next step rebuilds them
        from the loaded state (step counts included)."""
        for e in self._engines.values():
            e.params, e.groups, e.group_of, e.indices = [], [], [], []
        self._steps = {}
        self._ustates = {}
        self._step_views = WeakIdKeyDictionary()
        self._ustate_views = WeakIdKeyDictionary()
        self._ustate_written = WeakIdKeyDictionary()
        self._step_bufs = []
        self._ustate_bufs = []
        self._plain_launch = None
        self._of_dirty = True

    def _launch(self, grad_scale, found_inf, capturing):
        """Every engine's launch and the step tensors' advance, in one C call per device
        (_core._call_each): a KeyboardInterrupt lands before all of it or after all of it, so the
        step either happened and is recorded everywhere, or did not happen."""
        plain = self._plain_launch
        if plain is not None and grad_scale is None and found_inf is None and not capturing:
            _core._call_each(plain)  # (the common CPU step: its calls made once, at the rebuild)
            return None
        calls, keep, devices = [], [], set()
        for e in self._engines.values():
            call, gs, fi = e.launch(grad_scale, found_inf, capturing)
            if call is None:
                continue
            keep += [gs, fi]
            devices.add(e.device)
            calls.append((e, call, fi))
        advance = {id(e): buf for buf, e in self._step_bufs}
        gathers, scatters = self._gather_calls()
        if len(devices) > 1:  # one call per engine, each on its device
            for k, (e, call, fi) in enumerate(calls):
                with _on_device(e.device):
                    _core._call_each((gathers if k == 0 else []) + [call] + _advance_calls(advance.get(id(e)), fi)
                                     + (scatters if k == len(calls) - 1 else []))
        elif calls:
            ops = gathers + [c for _, c, _ in calls]
            for e, _, fi in calls:
                ops += _advance_calls(advance.get(id(e)), fi)
            with _on_device(calls[0][0].device):
                _core._call_each(ops + scatters)
        return keep

    def _gather_calls(self):
        """(before, after) a launch: the dense copies of parameters with gaps filled from them, and
        the parameters written back from their stepped copies."""
        return ([(dense.copy_, (p,)) for p, dense in self._gathers],
                [(p.copy_, (dense,)) for p, dense in self._gathers])

    def _fresh(self):
        """True when the tables are still right for this step (pushing changed hyperparameters)."""
        groups = self.param_groups
        if len(groups) != len(self._sigs):
            return False
        if self._by_torch or any(g.get("differentiable", False) for g in groups):
            if self._differentiable_flags != [bool(g.get("differentiable", False)) for g in groups]:
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
                r = self._watch.check(self.state)  # (also: a local tensor replaced, as FSDP2 does on a load)
        else:
            r = self._watch.check(self.state)
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
                    if st and p in self._steps and st.get("step") is not self._step_views.get(p):
                        st["step"] = torch.tensor(float(self._steps[p]), dtype=_scalar_dtype())
        if write_state:
            # Uniform states (NAdam's mu_product) into torch's format: a 0-dim tensor per parameter,
            # new (as step), of the dtype and device the state had (torch's capturable keeps it on
            # the parameter's device).
            for p, values in self._ustates.items():
                st = self.state.get(p)
                if not st:
                    continue
                live = self._ustate_views.get(p, {})
                for name, value in values.items():
                    old = st.get(name)
                    if old is not None and old is live.get(name):
                        continue  # (a view the step refreshes: already current)
                    like = old if torch.is_tensor(old) else None
                    st[name] = torch.tensor(value, dtype=like.dtype if like is not None else _scalar_dtype(),
                                            device=like.device if like is not None else None)
                    self._put_ustate(p, st, name, st[name])

    def _put_ustate(self, p, st, name, tensor):
        """Puts a uniform state's value in p's state as optfuse's own: until replaced, the engines'
        values are newer than it (_ustates_of)."""
        st[name] = tensor
        self._ustate_written.setdefault(p, {})[name] = tensor

    def _ustates_of(self, p, st, engine):
        """Parameter p's uniform-state values for the engine's table: read back from an engine, else
        from its state (a loaded state dict's 0-dim tensors), else the init values. Also puts each in
        the state (torch's keys), so state dicts have them from the first step."""
        if not engine.uniform_state_specs:
            return None
        known = self._ustates.get(p, {})
        written = self._ustate_written.get(p, {})
        out = []
        for name, init in engine.uniform_state_specs:
            if name in st and st[name] is not written.get(name):  # (loaded, or set by hand: torch's state wins)
                value = float(_plain(st[name]))
            elif name in known:
                value = float(known[name])
            elif name in st:
                value = float(_plain(st[name]))
            else:
                value = float(init)
                self._put_ustate(p, st, name, torch.tensor(value, dtype=_scalar_dtype()))
            out.append(value)
        return tuple(out)

    def _step_of(self, p):
        """Parameter p's step count: the engines' count while its state["step"] is the tensor the
        step advances, else what its state says (a loaded or replaced step), else the class's
        initial count."""
        st = self.state.get(p) or {}
        t = st.get("step")
        if p in self._steps and (t is None or not self._step_in_state or t is self._step_views.get(p)):
            return self._steps[p]
        self._steps[p] = _step_count(type(self).__name__, t) if t is not None else self._initial_step(st)
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
        _check_aliasing(type(self).__name__, groups)
        # Parameters with gaps or overlaps in their memory (x[..., 0], a transposed slice): the kernel
        # steps a dense copy, gathered before and scattered after each launch (_launch)
        self._gathers, self._dense_of = [], {}
        buckets = {}
        w = 0
        first = []  # per group: the watch index of its first parameter
        by_torch = {}  # group index -> its parameters with sparse gradients (stepped by torch's class)
        for tg, g in enumerate(groups):
            first.append(w)
            differentiable = bool(g.get("differentiable", False))  # (torch's class steps it: _base.py)
            for p in g["params"]:
                grad = grads[w]
                if grad is not None and not differentiable and grad.is_sparse:
                    # torch's own class steps it (SGD and Adagrad accept sparse gradients; the others
                    # raise torch's error), the rest of the group stays fused
                    if self._torch_class() is None:
                        raise OptfuseError(f"{type(self).__name__}: sparse gradients are not supported "
                                           f"(parameter of shape {tuple(p.shape)} in group {tg})")
                    by_torch.setdefault(tg, []).append(p)
                elif grad is not None and not differentiable:
                    if p.device.type == "meta":  # (torch's fused optimizers' words; to_empty() then works)
                        raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of "
                                           f"supported devices: ['cpu', 'cuda'] but {p.dtype} and meta (parameter "
                                           f"{w - first[tg]} of group {tg} has no memory: model.to_empty(device=...))")
                    lp = _dtensor.local(p)  # the tensor the kernel steps: p, or a DTensor's local shard
                    if lp is not p:
                        _dtensor.check_grad(type(self).__name__, p, tg)
                    _check_grad(type(self).__name__, lp, _dtensor.local(grad), tg, w - first[tg])
                    if lp.is_complex() != grad.is_complex():
                        raise OptfuseError(f"{type(self).__name__}: parameter {w - first[tg]} of group {tg} is "
                                           f"{p.dtype} but its gradient is {grad.dtype}")
                    if not _is_dense(lp):  # (gaps or overlaps: stepped through a dense copy, _launch)
                        dense = torch.empty(lp.shape, dtype=lp.dtype, device=lp.device)
                        self._gathers.append((lp.detach(), dense))  # (outside autograd, as the kernel)
                        self._dense_of[id(p)] = dense
                    storage = _chain_precision(type(self).__name__, self._precisions[tg], p, tg)
                    buckets.setdefault((self._keys[tg], p.device, storage), []).append((p, grad, tg, w, lp))
                w += 1
        engines, self._copies = {}, []
        for (key, device, storage), items in buckets.items():
            feats = self._features_by_key[key]
            chain = _unchecked(lambda: _with_unscale(
                self._make_chain(key, feats, [h for k, h in zip(self._keys, hosts) if k == key])))
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
                    dense = self._dense_of.get(id(p))
                    entries.append((p, self._grad_for(lp if dense is None else dense, grad), states, tg, step, w,
                                    stochastic, self._rng_stream(p, w), self._ustates_of(p, st, engine), dense))
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
        # What torch's own class steps: groups with differentiable=True (whole: None), and parameters
        # with sparse gradients (_base.py, _step_with_torch)
        self._differentiable_flags = [bool(g.get("differentiable", False)) for g in groups]
        self._by_torch = [(g, None) for g in groups if g.get("differentiable", False)]
        self._by_torch += [(groups[tg], ps) for tg, ps in sorted(by_torch.items())]
        self.__dict__.pop("_torch_delegate", None)
        self._bind_step_tensors()
        self._bind_uniform_states()
        self._watch_tables()
        self._plain_launch = self._make_plain_launch()
        sigs = [self._sig_get(g) for g in groups]
        self._tensor_hypers = any(torch.is_tensor(x) for s in sigs for v in s
                                  for x in (v if isinstance(v, (tuple, list)) else (v,)))
        self._sigs = [_sig_key(s) if self._tensor_hypers else s for s in sigs]
        self._on_cuda = any(device.type == "cuda" for _, device, _ in engines)
        self._foreign = False
        # DTensor parameters: the eager step (the custom op would be handed DTensors, not their shards)
        self._graph = None if dtensors else self._make_graph_layout(groups)
        self._of_dirty = False

    def _make_plain_launch(self):
        """The calls of a step without GradScaler or capture on CPU engines (their arguments never
        change between rebuilds), or None where a step must make them (a CUDA stream is read per step)."""
        if any(e.device.type != "cpu" for e in self._engines.values()):
            return None
        gathers, scatters = self._gather_calls()
        calls = [(e.core._step_raw, (0, 0, 0)) for e in self._engines.values() if e.params]
        return gathers + calls + [c for buf, _ in self._step_bufs for c in _advance_calls(buf, None)] + scatters

    def _bind_step_tensors(self):
        """Makes state["step"] of every parameter of a counted engine a 0-dim view of one tensor per
        engine that each step advances in the same C call as the launch (_launch): torch's state
        is current after every step, without a host synchronisation (on the parameters' device for
        CUDA, as torch's fused and capturable optimizers keep it). Engines whose chains may skip a
        step on their own keep writing the count on state_dict() and deepcopy."""
        self._step_bufs = []
        if not self._step_in_state:
            return
        dtype = _scalar_dtype()
        for e in self._engines.values():
            if not e.params or not e.countable or self.__dict__.get("_grad_sources") is not None:
                continue
            counts = torch.tensor([float(self._steps[p]) for p in e.params], dtype=dtype)
            if e.device.type == "cuda":  # (pinned: queued behind the stream's work, no wait)
                counts = counts.pin_memory().to(e.device, non_blocking=True)
            for i, p in enumerate(e.params):
                view = counts[i]
                self.state[p]["step"] = view
                self._step_views[p] = view
            self._step_bufs.append((counts, e))

    def _bind_uniform_states(self):
        """Per-parameter scalars a CPU engine keeps (NAdam's mu_product, ASGD's eta and mu) as 0-dim
        views of one tensor per engine, refreshed after every step (_refresh_uniform_states), so
        that code reading opt.state sees them current, as torch's. (CUDA engines keep them on the
        device: written on state_dict() and deepcopy, where a read of the device is expected.)"""
        self._ustate_bufs = []
        for e in self._engines.values():
            if e.device.type != "cpu" or not e.uniform_state_specs or not e.params:
                continue
            names = [name for name, _ in e.uniform_state_specs]
            values = dict(e.uniform_states())
            buf = torch.tensor([[float(values[p][n]) for n in names] for p in e.params], dtype=_scalar_dtype())
            for i, p in enumerate(e.params):
                st = self.state[p]
                views = self._ustate_views.setdefault(p, {})
                for j, name in enumerate(names):
                    old = st.get(name)
                    if torch.is_tensor(old) and old.dtype != buf.dtype:
                        continue  # (a state of another dtype: left as it is, written on state_dict())
                    self._put_ustate(p, st, name, buf[i, j])
                    views[name] = st[name]
            self._ustate_bufs.append((buf, e, names))

    def _refresh_uniform_states(self):
        """The uniform-state views (_bind_uniform_states) set from the engines' values after a step."""
        for buf, e, names in self._ustate_bufs:
            per_group = [[e.core.uniform_state(gi, n) for n in names] for gi in range(len(e.groups))]
            buf.copy_(torch.tensor([per_group[gi] for gi in e.group_of], dtype=buf.dtype))

    def _watch_tables(self):
        """Tells the watch which parameter and state tensors each table entry steps, so that every
        step checks them (TableWatch.check): only torch's own state entries, not the states
        optfuse keeps privately. (ZeRO's pieces are its own tensors: it watches their parameters.)"""
        if self.__dict__.get("_grad_sources") is not None:
            return
        slots, dicts, keys, same_object = [], [], [], []
        for e in self._engines.values():
            per = len(e.state_names)
            for k, p in enumerate(e.params):
                st = self.state.get(p)
                stepped, steps = [], []
                if st is not None:
                    ids = {id(t) for t in e.states[k * per:(k + 1) * per]}
                    stepped = [key for key, v in st.items() if torch.is_tensor(v) and id(v) in ids]
                    # the step tensor: no launch touches it, only its replacement matters
                    steps = ["step"] if torch.is_tensor(st.get("step")) and "step" not in stepped else []
                slots.append(e.indices[k])
                dicts.append(st)
                keys.append(stepped)
                same_object.append(steps)
        self._watch.watch_tables(self.state, slots, dicts, keys, same_object)

    def _watch_gradients(self, params, dtensors):
        """Makes the GradWatch that each step() asks whether gradients moved; returns each parameter's
        gradient (None where absent) as the kernel reads it.
        - A DTensor parameter (FSDP2) is watched through its gradient's local shard (`_local_tensor`).
        - A ZeRO stage-1 piece (`_grad_sources`: id(piece) -> (parameter, first element)) is watched
          through its parameter's gradient at the piece's offset: no view per piece and step."""
        self._watch_dtensors = bool(dtensors)
        sources = self.__dict__.get("_grad_sources")
        if sources is None:
            self._watch = _core._TableWatch(params, [], [_dtensor.is_dtensor(p) for p in params] if dtensors else [])
            return self._watch.snapshot()
        whole = [sources[id(p)][0] for p in params]
        self._watch = _core._TableWatch(whole, [sources[id(p)][1] * p.element_size() for p in params])
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

    # A parameter's state (a loaded state dict, or entries written by hand) must hold every state
    # the rule keeps once it holds any, as torch's optimizers require; a subclass whose original
    # creates states one by one (a traced optimizer) sets this False.
    _complete_states = True

    def _check_state_complete(self, p, st, engine):
        """Refuses a state that holds some of the rule's states (or a step count) but not all: torch
        raises KeyError at its step; stepping would restart the missing ones from their initial
        values and silently train differently."""
        rule_keys = [self._saved_key(p, name) for name, (from_param, fixed) in zip(engine.state_names, engine.state_storage)
                     if not from_param and not fixed and name != "kahan_comp"]
        rule_keys = [k for k in rule_keys if k is not None]
        present = [k for k in rule_keys if k in st]
        missing = [k for k in rule_keys if k not in st]
        if self._step_in_state and "step" not in st:
            missing.append("step")
        if present and missing:  # (a step alone: no rule state yet, they start now)
            tg, i = self._position_of(p)
            raise OptfuseError(f"{type(self).__name__}: the state of parameter {i} of group {tg} (shape "
                               f"{tuple(p.shape)}) has {present} but lacks {missing}; a state dict must hold every "
                               "state of a parameter that has stepped")

    def _position_of(self, p):
        """(group index, index within the group) of parameter p, for messages."""
        for tg, g in enumerate(self.param_groups):
            for i, q in enumerate(g["params"]):
                if q is p:
                    return tg, i
        return -1, -1

    def _states_for(self, p, st, engine, prec):
        if self._complete_states:
            self._check_state_complete(p, st, engine)
        if self._step_in_state and "step" not in st:
            st["step"] = torch.tensor(float(self._steps.get(p, 0)), dtype=_scalar_dtype())
        out = []
        for name, init, (from_param, fixed) in zip(engine.state_names, engine.state_inits, engine.state_storage):
            dtype = fixed or _state_dtype(prec, p, name)
            key, shape = self._saved_key(p, name), self._state_shape(p, name)
            home = st if key is not None else self._private_states.setdefault(p, {})
            key = name if key is None else key
            if dtype == torch.int8 and engine.matrix:
                raise OptfuseError(f"{type(self).__name__}: state_dtype=torch.int8 is not supported yet for rules with "
                                   "per-row or per-column values (Adafactor's factored moments); use torch.bfloat16 "
                                   "states")
            q8 = dtype == torch.int8 and shape is None  # a full-size state stored as q8 (_q8.py)

            def new():  # in the parameter's layout (or the state's own shape) and the role's dtype
                if shape is None:  # (a parameter with gaps: torch's preserve_format gives contiguous states)
                    return torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)
                return torch.empty(shape, dtype=dtype, device=p.device)

            t = home.get(key)
            fresh = t is None
            if not fresh and not torch.is_tensor(t):
                tg, i = self._position_of(p)
                raise OptfuseError(f"{type(self).__name__}: state '{key}' of parameter {i} of group {tg} is a "
                                   f"{type(t).__name__}; expected a tensor")
            if q8:
                if _dtensor.is_dtensor(p):
                    raise OptfuseError(f"{type(self).__name__}: state_dtype=torch.int8 is not supported for DTensor "
                                       "(FSDP2) parameters yet")
                def where():
                    tg, i = self._position_of(p)
                    return f"{type(self).__name__}: state '{key}' of parameter {i} of group {tg}"
                home[key] = t = _q8.state_for(p, t, init, from_param, where)
                out.append(t)
                continue
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
            like = self._dense_of.get(id(p), p)  # (the layout the kernel steps: p's, or its dense copy's)
            wrong_layout = (t.shape != p.shape or t.stride() != like.stride()
                            or _dtensor.local(t).stride() != _dtensor.local(like).stride()) if shape is None else (
                tuple(t.shape) != tuple(shape) or not t.is_contiguous())
            if not fresh and shape is None and t.shape != p.shape:
                tg, i = self._position_of(p)
                raise OptfuseError(f"{type(self).__name__}: state '{key}' of parameter {i} of group {tg} has shape "
                                   f"{tuple(t.shape)}; the parameter's is {tuple(p.shape)}")
            if not fresh and (t.dtype != dtype or t.device != p.device or wrong_layout):
                # A state of another dtype or layout (a torch state dict, a changed state_dtype):
                # converted once into the layout and dtype the kernel steps.
                if shape is not None and t.numel() != math.prod(shape):
                    tg, i = self._position_of(p)
                    raise OptfuseError(f"{type(self).__name__}: state '{key}' of parameter {i} of group {tg} (shape "
                                       f"{tuple(p.shape)}) has shape {tuple(t.shape)}; expected {tuple(shape)}")
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


def _with_unscale(chain):
    """Every torch-facing chain starts with unscale_by_grad_scale (a no-op without a GradScaler)."""
    if chain and chain[0].name == "unscale_by_grad_scale":
        return list(chain)
    return _core.make_builtin("unscale_by_grad_scale") + list(chain)


def _advance_calls(buf, found_inf):
    """The (callable, args) that advance an engine's step tensors by one step (none skipped by a
    GradScaler's found_inf: the kernel skips the same step on the device)."""
    if buf is None:
        return []
    if found_inf is None:
        return [(buf.add_, (1,))]
    return [(buf.sub_, (found_inf,)), (buf.add_, (1,))]


def _unchecked(build):
    """build() with the core's range checks of hyperparameter values off: the values in a chain
    built from param_groups are only its defaults (every group's values are pushed before the
    first step), and torch accepts any value there once its constructor has validated the
    arguments (SGD(lr=nan), betas set to 1 later...)."""
    was = _core._set_hyper_range_checks(False)
    try:
        return build()
    finally:
        _core._set_hyper_range_checks(was)
