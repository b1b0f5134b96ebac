"""fuse() for optimizers without a hand-written drop-in: their step traced into a rule (_trace.py),
run by the same engine as every optfuse.torch optimizer, and checked against the original first."""
import math
import weakref

import torch

from ._base import FusedOptimizer, OptfuseError
from ._trace_values import _frame_of
from ._trace import TraceError, _probe, group_counters, hyper_values, structure, traced_rule

VERIFY_STEPS = 6       # steps of the original and the traced optimizer side by side on probes
VERIFY_SIDE = 17       # probes of each parameter dimensionality in the group, every side at most this (odd)
VERIFY_TOL = 1e-6      # max |ours - original| / max |original| over the parameter and every state


class Traced(FusedOptimizer):
    """A fused optimizer whose rule was traced from another optimizer's step. Same param_groups,
    state keys and state_dict format as the original (the step, where it keeps one, as it does)."""

    _graph_step = False  # _hypers reads the traced rule's layout: the eager step under torch.compile

    def _structure(self, g):
        return structure(g, self._counters)

    def _make_chain(self, key, features, groups):
        rule, layout = self._rules.get(key) or self._trace(groups[0], key)
        return [rule]

    def _hypers(self, g):
        out = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, (tuple, list)):
                out.update({f"{k}_{i}": x for i, x in enumerate(v)})
            else:
                out[k] = v
        return {k: v for k, v in out.items() if k in hyper_values(g, self._counters)}

    def _trace(self, group, key):
        entry = traced_rule(self._original, group)
        self._rules[key] = entry
        return entry

    def _states_for(self, p, st, engine, prec):
        # the original's state keys for the rule's slots (a name the kernel cannot declare was renamed)
        back = {}
        for _, layout in self._rules.values():
            back.update({slot: k for k, slot in layout.slots.items()})
        engine.state_names = [back.get(s, s) for s in engine.core.state_names]
        for k in self._tensor_scalars():
            v = st.get(k)
            if torch.is_tensor(v) and v.shape != p.shape and v.numel() == 1:
                # the original's value per tensor (a mid-training fuse, a loaded state dict): in every element
                st[k] = torch.full_like(p, float(v), dtype=p.dtype if p.is_floating_point() else torch.float32)
        return super()._states_for(p, st, engine, prec)

    def _tensor_scalars(self):
        out = {}
        for _, layout in self._rules.values():
            out.update(layout.tensor_scalars)
        return out

    def _layout(self):
        return next(iter(self._rules.values()))[1]

    def _initial_step(self, state):
        # an optimizer that keeps no step count: a parameter whose state exists has stepped
        layout = self._layout()
        keys = layout.states + list(layout.scalar_states)
        return 1 if keys and all(k in state for k in keys) else 0

    def _adjust_step(self, state, step, engine):
        layout = self._layout()
        if layout.step_key is None and not all(k in state for k in layout.states + list(layout.scalar_states)):
            return 0  # no state yet: the first-step trace (the optimizer creates it) applies
        return step

    def _step_of(self, p):
        if p not in self._steps and self._counters:
            # the step count is kept in the param group (all its parameters step together): a parameter
            # with state has taken group[counter] steps, one without starts (its first-step trace)
            st = self.state.get(p) or {}
            layout = self._layout()
            g = self._group_of[p]
            has_state = all(k in st for k in layout.states + list(layout.scalar_states))  # (none: always)
            self._steps[p] = int(g.get(self._counters[0], 0)) if has_state else 0
        return super()._step_of(p)

    def _rebuild(self):
        if self._counters:
            self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        super()._rebuild()

    def _step_impl(self, closure=None, *, grad_scale=None, found_inf=None):
        loss = super()._step_impl(closure, grad_scale=grad_scale, found_inf=found_inf)
        if self._counters:
            if found_inf is None and getattr(self, "found_inf", None) is None:
                for g in self.param_groups:  # as the original does: every group, every step
                    for k in self._counters:
                        g[k] = g.get(k, 0) + 1
            else:  # the kernel may have skipped the step: the counts it kept say
                self._sync_steps()
                for g in self.param_groups:
                    counts = [self._steps[p] for p in g["params"] if p in self._steps]
                    for k in self._counters:
                        if counts:
                            g[k] = type(g.get(k, 0))(max(counts))
        return loss

    def state_dict(self):
        sd = super().state_dict()
        # scalar states per parameter (the rule's uniform states) in the original's format: a Python
        # number where it keeps one (LaProp's exp_avg_lr_1), else a tensor of its shape and dtype
        scalars = self._tensor_scalars()
        for _, layout in self._rules.values():
            scalars.update(layout.scalar_states)
        if scalars:
            for st in sd["state"].values():
                for k, tmpl in scalars.items():
                    v = st.get(k)
                    if not torch.is_tensor(v):
                        continue
                    if torch.is_tensor(tmpl):  # (a value per tensor: any element of its slot)
                        st[k] = v.detach().reshape(-1)[:1].to(dtype=tmpl.dtype).reshape(tmpl.shape).clone()
                    else:
                        st[k] = type(tmpl)(v.item())
        return sd

    def _sync_steps(self, write_state=False):
        super()._sync_steps(write_state)
        layout = self._layout() if self._rules else None
        if write_state and layout is not None and layout.step_key is not None and not layout.step_is_tensor:
            for st in self.state.values():  # the original keeps a Python number
                if torch.is_tensor(st.get(layout.step_key)):
                    st[layout.step_key] = int(st[layout.step_key])


def _new_traced(original, param_groups, defaults, rules=None, counters=frozenset()):
    t = Traced.__new__(Traced)
    t._counters = tuple(sorted(counters))
    keys = set()
    for g in param_groups:
        keys |= {k.rsplit("_", 1)[0] if k not in g else k for k in hyper_values(g, counters)}
    t._sig_keys = tuple(sorted(keys))
    t._original = original
    t._rules = {} if rules is None else rules
    for g in param_groups:  # trace every structure now: errors surface in fuse(), not at the first step
        key = structure(g, counters)
        if key not in t._rules:
            t._rules[key] = traced_rule(original, g)
    layout = next(iter(t._rules.values()))[1]
    t._step_in_state = layout.step_key is not None  # written as the original does (_sync_steps)
    FusedOptimizer.__init__(t, param_groups, defaults)
    t._fused_from = weakref.ref(original)  # (its lr schedulers see its steps: FusedOptimizer.step)
    return t


def _max_rel(a, b):
    den = b.abs().max().item()
    return (a - b).abs().max().item() / (den if den > 0 else 1.0)


def _verify(original, traced_rules, counters=frozenset()):
    """The traced optimizer against the original on a probe parameter per group, VERIFY_STEPS steps with
    new gradients, every float option changed half way (lr halved, the others x0.9): the parameter and
    every state must agree."""
    gen = torch.Generator().manual_seed(0)
    for gi, g in enumerate(original.param_groups):
        for shape in sorted({tuple(min(d, VERIFY_SIDE) for d in p.shape) for p in g["params"]}):
            _verify_one(original, traced_rules, gi, g, shape, gen, counters)


def _verify_one(original, traced_rules, gi, g, shape, gen, counters=frozenset()):
    """One group, one probe shape: the original and the traced optimizer side by side."""
    ref, _ = _probe(original, g, None)
    rp = torch.randn(shape, generator=gen)
    ref.param_groups[0]["params"] = [rp]
    q = rp.clone()
    options = {k: v for k, v in g.items() if k != "params"}
    for k in counters:  # the probes start with fresh state: from a fresh group's count too
        options[k] = ref.param_groups[0][k] = 0
    ours = _new_traced(original, [dict(options, params=[q])], dict(original.defaults), traced_rules, counters)
    for s in range(VERIFY_STEPS):
        grad = torch.randn(shape, generator=gen) * (0.1 if s % 2 else 1.0)
        rp.grad, q.grad = grad.clone(), grad.clone()
        if s == VERIFY_STEPS // 2:
            # every float option changes (lr halved, the others x0.9): one frozen into the trace (read
            # in a way the recorder did not see) makes the two differ from here on
            for og in (ref.param_groups[0], ours.param_groups[0]):
                for k, v in list(og.items()):
                    if k in counters or k == "params":
                        continue
                    if type(v) is float:
                        og[k] = v * (0.5 if k == "lr" else 0.9)
                    elif isinstance(v, (tuple, list)) and any(type(x) is float for x in v):
                        og[k] = type(v)(x * 0.9 if type(x) is float else x for x in v)
        ref.step()
        ours.step()
        d = _max_rel(q, rp)
        if not d <= VERIFY_TOL:
            raise TraceError(f"the traced step of group {gi} (a parameter of shape {shape}) differs from the "
                             f"original at step {s + 1}: "
                             f"max relative difference {d:.3g} of the parameter (allowed {VERIFY_TOL})")
    ours._sync_steps(write_state=True)
    for k in counters:
        if ours.param_groups[0].get(k) != ref.param_groups[0].get(k):
            raise TraceError(f"the step count group['{k}'] of group {gi} is {ours.param_groups[0].get(k)} after "
                             f"{VERIFY_STEPS} traced steps, {ref.param_groups[0].get(k)} after the original's")
    for k, v in ref.state[rp].items():
        w = ours.state[q].get(k)
        if k != "step" and (isinstance(v, float) or torch.is_tensor(v) and v.numel() == 1 and v.shape != rp.shape):
            # a scalar state per parameter (a uniform state of the rule)
            a, r = float(w.reshape(-1)[0]) if torch.is_tensor(w) else float(w) if w is not None else math.nan, float(v)
            if not abs(a - r) <= VERIFY_TOL * max(abs(r), 1e-30):
                raise TraceError(f"the traced scalar state '{k}' of group {gi} is {a!r} after {VERIFY_STEPS} steps, "
                                 f"{r!r} after the original's")
            continue
        if torch.is_tensor(v) and v.shape == rp.shape and not _max_rel(w, v) <= VERIFY_TOL:
            raise TraceError(f"the traced state '{k}' of group {gi} differs from the original after "
                             f"{VERIFY_STEPS} steps (max relative difference {_max_rel(w, v):.3g})")


def fuse_by_tracing(opt):
    name = f"{type(opt).__module__}.{type(opt).__qualname__}"
    try:
        rules = {}
        counters = group_counters(opt)
        for g in opt.param_groups:
            key = structure(g, counters)
            if key not in rules:
                rules[key] = traced_rule(opt, g)
        _verify(opt, rules, counters)
    except TraceError as e:
        raise OptfuseError(f"optfuse.torch.fuse: {name} cannot be fused: {e}") from None
    except Exception as e:  # noqa: BLE001  (the optimizer's own code failed on the probe)
        raise OptfuseError(f"optfuse.torch.fuse: {name} cannot be fused: tracing its step raised "
                           f"{type(e).__name__}: {e} at {_frame_of(e)} (its step on a probe parameter: one that "
                           "reads what its own code did not make for that parameter, such as state made outside "
                           "step() or kept in opt.state under a key that is no parameter, is not traceable)") from e
    new = _new_traced(opt, opt.param_groups, dict(opt.defaults), rules, counters)
    for p, st in opt.state.items():
        new.state[p] = dict(st)
    return new
