"""fuse() for optimizers without a hand-written drop-in: their step traced into a rule (_trace.py),
run by the same engine as every optfuse.torch optimizer, and checked against the original first."""
import torch

from ._base import FusedOptimizer, OptfuseError
from ._trace import TraceError, _probe, hyper_values, structure, traced_rule

VERIFY_STEPS = 6       # steps of the original and the traced optimizer side by side on probes
VERIFY_SIDE = 17       # probes of each parameter dimensionality in the group, every side at most this (odd)
VERIFY_TOL = 1e-6      # max |ours - original| / max |original| over the parameter and every state


class Traced(FusedOptimizer):
    """A fused optimizer whose rule was traced from another optimizer's step. Same param_groups,
    state keys and state_dict format as the original (the step, where it keeps one, as it does)."""

    _graph_step = False  # _hypers reads the traced rule's layout: the eager step under torch.compile

    def _structure(self, g):
        return structure(g)

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
        return {k: v for k, v in out.items() if k in hyper_values(g)}

    def _trace(self, group, key):
        entry = traced_rule(self._original, group)
        self._rules[key] = entry
        return entry

    def _layout(self):
        return next(iter(self._rules.values()))[1]

    def _initial_step(self, state):
        # an optimizer that keeps no step count: a parameter whose state exists has stepped
        layout = self._layout()
        return 1 if layout.states and all(k in state for k in layout.states) else 0

    def _adjust_step(self, state, step, engine):
        layout = self._layout()
        if layout.step_key is None and not all(k in state for k in layout.states):
            return 0  # no state yet: the first-step trace (the optimizer creates it) applies
        return step

    def _sync_steps(self, write_state=False):
        super()._sync_steps(write_state)
        layout = self._layout() if self._rules else None
        if write_state and layout is not None and layout.step_key is not None and not layout.step_is_tensor:
            for st in self.state.values():  # the original keeps a Python number
                if torch.is_tensor(st.get(layout.step_key)):
                    st[layout.step_key] = int(st[layout.step_key])


def _new_traced(original, param_groups, defaults, rules=None):
    t = Traced.__new__(Traced)
    keys = set()
    for g in param_groups:
        keys |= {k.rsplit("_", 1)[0] if k not in g else k for k in hyper_values(g)}
    t._sig_keys = tuple(sorted(keys))
    t._original = original
    t._rules = {} if rules is None else rules
    for g in param_groups:  # trace every structure now: errors surface in fuse(), not at the first step
        key = structure(g)
        if key not in t._rules:
            t._rules[key] = traced_rule(original, g)
    layout = next(iter(t._rules.values()))[1]
    t._step_in_state = layout.step_key is not None  # written as the original does (_sync_steps)
    FusedOptimizer.__init__(t, param_groups, defaults)
    return t


def _max_rel(a, b):
    den = b.abs().max().item()
    return (a - b).abs().max().item() / (den if den > 0 else 1.0)


def _verify(original, traced_rules):
    """The traced optimizer against the original on a probe parameter per group, VERIFY_STEPS steps with
    new gradients, lr (where numeric) halved half way: the parameter and every state must agree."""
    gen = torch.Generator().manual_seed(0)
    for gi, g in enumerate(original.param_groups):
        for shape in sorted({tuple(min(d, VERIFY_SIDE) for d in p.shape) for p in g["params"]}):
            _verify_one(original, traced_rules, gi, g, shape, gen)


def _verify_one(original, traced_rules, gi, g, shape, gen):
    """One group, one probe shape: the original and the traced optimizer side by side."""
    ref, _ = _probe(original, g, None)
    rp = torch.randn(shape, generator=gen)
    ref.param_groups[0]["params"] = [rp]
    q = rp.clone()
    ours = _new_traced(original, [dict({k: v for k, v in g.items() if k != "params"}, params=[q])],
                       dict(original.defaults), traced_rules)
    for s in range(VERIFY_STEPS):
        grad = torch.randn(shape, generator=gen) * (0.1 if s % 2 else 1.0)
        rp.grad, q.grad = grad.clone(), grad.clone()
        if s == VERIFY_STEPS // 2:
            for og in (ref.param_groups[0], ours.param_groups[0]):
                if isinstance(og.get("lr"), float):
                    og["lr"] = og["lr"] * 0.5
        ref.step()
        ours.step()
        d = _max_rel(q, rp)
        if not d <= VERIFY_TOL:
            raise TraceError(f"the traced step of group {gi} (a parameter of shape {shape}) differs from the "
                             f"original at step {s + 1}: "
                             f"max relative difference {d:.3g} of the parameter (allowed {VERIFY_TOL})")
    ours._sync_steps(write_state=True)
    for k, v in ref.state[rp].items():
        w = ours.state[q].get(k)
        if torch.is_tensor(v) and v.shape == rp.shape and not _max_rel(w, v) <= VERIFY_TOL:
            raise TraceError(f"the traced state '{k}' of group {gi} differs from the original after "
                             f"{VERIFY_STEPS} steps (max relative difference {_max_rel(w, v):.3g})")


def fuse_by_tracing(opt):
    name = f"{type(opt).__module__}.{type(opt).__qualname__}"
    try:
        rules = {}
        for g in opt.param_groups:
            key = structure(g)
            if key not in rules:
                rules[key] = traced_rule(opt, g)
        _verify(opt, rules)
    except TraceError as e:
        raise OptfuseError(f"optfuse.torch.fuse: {name} cannot be fused: {e}") from None
    except Exception as e:  # noqa: BLE001  (the optimizer's own code failed on the probe)
        raise OptfuseError(f"optfuse.torch.fuse: {name} cannot be fused: tracing its step raised "
                           f"{type(e).__name__}: {e}") from e
    new = _new_traced(opt, opt.param_groups, dict(opt.defaults), rules)
    for p, st in opt.state.items():
        new.state[p] = dict(st)
    return new
