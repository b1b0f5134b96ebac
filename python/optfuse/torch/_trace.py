"""Tracing a torch optimizer's per-parameter update into an optfuse rule (used by fuse() for classes
without a hand-written drop-in).

How: the optimizer's own step() runs on a probe (one small parameter, a copy of each param group)
under a TorchFunctionMode recorder. Every tensor the step touches is mapped to an optfuse expression
(the parameter, its gradient, its state slots, constants); every torch op maps its inputs'
expressions to the op's expression (in-place ops rebind their target). Hyperparameters become
`SymFloat`s: Python floats that carry an expression, so the scalar arithmetic optimizers do in Python
(1 - beta1 ** step) stays symbolic. The step count is an input too (state["step"] tensor or number).

Two traces per rule: the first step (the optimizer creates its state) and a later step (state read
from the slots); the rule takes the first where step == 1. A Python branch on a symbolic scalar
(if step < warmup, if weight_decay != 0) is traced both ways and becomes a select. What the IR cannot
express (Python control flow on element data, .item() of element data, ops the recorder does not
know, indexing, scalar states other than the step) raises TraceError naming the construct.
fuse() then checks the traced optimizer against the original on probe parameters before using it.

Reductions (Recorder.reduction): sums, means, p-norms and the largest |x| of a whole parameter-shaped
tensor are the IR's per-tensor reductions; along the last or first dimension of a matrix, its row and
column reductions (kinds "row" and "col"); cosine_similarity is sums in its scope; the rest are refused
by name. Sizes (numel(), size(i), shape) are the real tensor's (Op::Shape: _ProbeDim, SymFloat). So that a
sum over the group's parameters in Python is never taken for a per-tensor one, the probe group holds two
other parameters whose values (and sizes) are "foreign": one reaching the probe's update is refused.
A step that is other math for vectors than for matrices is both traces, selected on Op::Shape is_matrix.

Modules: _trace_values.py (SymFloat, the paths of Python branches, probe sizes, TraceError),
_trace_recorder.py (the recorder of torch ops), _trace_reductions.py (its reductions and size
queries), _trace_probe.py (the layout probe: _Layout, _probe, hyper_values); this one runs the probe
under the recorder down every path (explore_paths) and builds the rule (traced_rule). The names other
modules use are imported from here (__all__).
"""
import math

import torch

from .. import _core
from ._trace_probe import (PROBE_ELEMENTS, _Layout, _group_state_message, _probe, group_counters, hyper_values,
                           probe_shape, structure)
from ._trace_recorder import _Recorder
from ._trace_values import _MATH, SymFloat, TraceError, _frame_of, _Paths, _patched_math, _same_expr, _symbolic_math

__all__ = ["TraceError", "SymFloat", "_Paths", "_Recorder", "_MATH", "_symbolic_math", "_probe", "group_counters",
           "hyper_values", "structure", "explore_paths", "traced_rule"]


# --- from an optimizer to a rule

LATER_STEP = 3       # the step count a "later step" trace starts from
MAX_PATHS = 64       # symbolic Python branches: at most this many paths per trace


def _trace_once(opt, group, layout, b, first, forced, shape=None):
    """One run of opt.step() on a probe under the recorder; returns (param expr, {state: expr}, paths).
    The probe group holds two other parameters, one before and one after the probe: their values are
    "foreign", and any that reaches the probe's update (a sum or norm over the group's parameters in
    Python, a branch on one) is refused, never taken as the probe's own."""
    paths = _Paths(forced, memo=True)
    hypers = hyper_values(group, layout.counters)

    def subst(k, v):
        if k in layout.counters:
            # the group's step count before this step: step - 1 (0 on the first step, as a fresh group has)
            return SymFloat(0.0 if first else float(LATER_STEP), b.step() - 1.0, paths)
        if k in hypers:
            return SymFloat(float(v), b.hyper(k), paths)
        if isinstance(v, (tuple, list)) and f"{k}_0" in hypers:
            return type(v)(SymFloat(float(x), b.hyper(f"{k}_{i}"), paths) for i, x in enumerate(v))
        return v

    probe, p = _probe(opt, group, subst, shape)
    for k in layout.counters:  # a fresh group has none yet: the optimizer's own code would start it at 0
        if k not in probe.param_groups[0]:
            probe.param_groups[0][k] = subst(k, 0)
    rec = _Recorder(b, paths, reductions=True)
    others = [torch.randn_like(p), torch.randn_like(p)]
    probe.param_groups[0]["params"] = [others[0], p, others[1]]
    for q, kind in ((p, "element"), (others[0], "foreign"), (others[1], "foreign")):
        # the others have the probe's expressions (the same math on them is the same nodes) but their own kind
        rec.bind(q, b.param(), kind)
        q.grad = torch.randn_like(q)
        rec.bind(q.grad, b.update(), kind)
        if not first:
            st = probe.state[q]
            for k in layout.states:
                if k in layout.tensor_scalars:  # a value per tensor, kept in every element of its slot
                    t = layout.tensor_scalars[k].clone()
                    rec.bind(t, b.state(layout.slots[k]), "tensor" if kind == "element" else kind)
                else:
                    t = torch.rand_like(q) + 0.5
                    rec.bind(t, b.state(layout.slots[k]), kind)
                st[k] = t
            for k, tmpl in layout.scalar_states.items():
                # the IR's uniform state k (one value per group: the group's parameters step together);
                # another parameter's is foreign, as its values are
                foreign = None if kind == "element" else f"state '{k}' of another parameter"
                if torch.is_tensor(tmpl):
                    t = tmpl.clone()
                    rec.bind(t, b.uniform_state(k), "uniform" if foreign is None else "foreign")
                    st[k] = t
                else:
                    st[k] = SymFloat(float(tmpl), b.uniform_state(k), paths, foreign)
            if layout.step_key is not None:
                before = b.step() - 1.0
                if layout.step_is_tensor:
                    t = torch.tensor(float(LATER_STEP))
                    rec.bind(t, before, "uniform")
                    st[layout.step_key] = t
                else:
                    st[layout.step_key] = SymFloat(float(LATER_STEP), before, paths)
    inputs = dict(probe.param_groups[0])
    patched = _patched_math()
    saved = {n: getattr(math, n) for n in patched}
    try:
        for n, f in patched.items():
            setattr(math, n, f)
        with rec:
            probe.step()
    finally:
        for n, f in saved.items():
            setattr(math, n, f)
    for k, v in probe.param_groups[0].items():
        # a value computed from hyperparameters or the step and kept in the group (for the next step to
        # read, or for logging): a per-group scalar state; the fused optimizer would never write it
        if k not in layout.counters and (k not in inputs or v is not inputs[k]) and (
                isinstance(v, SymFloat) or isinstance(v, (tuple, list)) and any(isinstance(x, SymFloat) for x in v)):
            raise TraceError(_group_state_message(type(opt).__name__, [k]))
    st = probe.state.get(p, {})

    def expr_of(t, what):
        if isinstance(t, SymFloat):
            return t.expr
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            return b.constant(float(t))  # (a state set to a number on this path: pytorch-optimizer Lamb's norms)
        hit = rec.expr.get(rec.key(t))
        if hit is None:
            raise TraceError(f"{what} after the step is a tensor the trace did not produce")
        if hit[1] == "foreign":
            raise TraceError(f"{what} after the step depends on other parameters' values (first met at "
                             f"{rec.mixed_at or '?'}): a sum or norm over the group's parameters (global-norm "
                             "clipping) is not traceable yet; a traced step must update each parameter from "
                             "its own values")
        return hit[0]

    # a slot this path sets to None (timm SGDW's momentum buffer on a momentum == 0 path, where the probe
    # stepped with momentum) is not written on it: the state keeps its value, which the path never reads
    states = {k: expr_of(st[k], f"state '{k}'") for k in layout.states if st.get(k) is not None}
    for k in layout.scalar_states:
        v = st.get(k)
        if v is None:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, (bool, SymFloat)):
            states[("uniform", k)] = b.constant(float(v))
            continue
        if torch.is_tensor(v):
            hit = rec.expr.get(rec.key(v))
            if hit is None and v.numel() == 1 and v.dim() == 0:
                hit = (b.constant(float(v)), "uniform")
            if hit is not None and hit[1] not in ("uniform", "foreign"):
                raise TraceError(f"{type(opt).__name__} keeps a per-parameter scalar state '{k}' computed from the "
                                 "tensor's values (a norm, a mean or math on one): the IR keeps per-group uniform "
                                 "states (of hyperparameters and the step) only, not a scalar per tensor; not "
                                 "traceable yet")
        states[("uniform", k)] = expr_of(v, f"the scalar state '{k}'")
    return expr_of(p, "the parameter"), states, paths.seen


def _explore(opt, group, layout, b, first, shape=None):
    """Every path through the symbolic branches, merged with selects into one set of expressions."""
    return explore_paths(lambda forced: _trace_once(opt, group, layout, b, first, forced, shape))


def explore_paths(trace_once, infeasible=(), skipped=None):
    """Runs trace_once(forced) -> (param expr, {state: expr}, paths seen) down every path through the
    symbolic branches (the outcomes in `forced` first) and merges the results with selects. A path
    other than the real one that raises one of `infeasible` is taken as unreachable (no select); its
    condition is appended to `skipped` (the caller must then check, when values change, that the
    real path stays the one traced)."""
    count = [0]

    def run(forced):
        count[0] += 1
        if count[0] > MAX_PATHS:
            raise TraceError(f"more than {MAX_PATHS} paths through Python branches on hyperparameters or the step")
        try:
            param, states, seen = trace_once(forced)
        except KeyError as e:
            if not forced or isinstance(e, infeasible if isinstance(infeasible, tuple) else (infeasible,)):
                raise
            raise TraceError(f"the step reads {e} at {_frame_of(e)}, which exists only under other outcomes of its "
                             "Python branches on hyperparameters (a state created at the first step when an option "
                             "was set: reading it after the option changes would fail in the original too); "
                             "not traceable yet: fusable when each such branch is decided once, at the first step "
                             "(a guard that re-traces)") from None
        return merge(forced, param, states, seen)

    def merge(forced, param, states, seen):
        # seen[i] for i >= len(forced) were decided by real values; trace the other outcome of each
        for i in range(len(seen) - 1, len(forced) - 1, -1):
            cond, outcome = seen[i]
            try:
                other = run([o for _, o in seen[:i]] + [not outcome])
            except infeasible:
                if skipped is not None:
                    skipped.append(cond)
                continue
            op, ost = other
            if getattr(seen[i], "foreign", False):
                # a branch on another parameter's values: fine where it changes only that parameter's update
                if not (_same_expr(op, param) and set(ost) == set(states)
                        and all(_same_expr(ost[k], states[k]) for k in states)):
                    raise TraceError(f"a Python branch on other parameters' values at {seen[i].where} changes "
                                     "this parameter's update: not traceable (each parameter's update must "
                                     "depend on its own values only)")
                continue
            t_param, f_param = (param, op) if outcome else (op, param)
            param = _core.select(cond, t_param, f_param)
            merged = {}
            for k in set(states) | set(ost):
                a, c = states.get(k), ost.get(k)
                if a is None or c is None:
                    merged[k] = a if c is None else c
                else:
                    merged[k] = _core.select(cond, a, c) if outcome else _core.select(cond, c, a)
            states = merged
        return param, states

    return run([])


def _before(b, k, slots):
    """A state's value before the step: k a per-element state's name, or ("uniform", name)."""
    return b.uniform_state(k[1]) if isinstance(k, tuple) else b.state(slots[k])


def traced_rule(opt, group):
    """An optfuse Rule equivalent to one step of `opt` on a parameter of `group` (TraceError if not)."""
    # The rule's update function runs when the rule is compiled, later: it traces the group as it is
    # now, not the live dict (an lr scheduler attached after fuse() adds initial_lr to it)
    group = dict(group)
    layout = _Layout(opt, group)
    if layout.group_states:
        raise TraceError(_group_state_message(type(opt).__name__, layout.group_states))
    rule = _core.Rule(f"traced_{type(opt).__name__}")
    for k, v in hyper_values(group, layout.counters).items():
        rule.hyper(k, v)
    for k in layout.states:
        rule.state(layout.slots[k], 0.0)
    for k in layout.scalar_states:
        rule.uniform_state(k, 0.0)

    traced_dim = len(probe_shape(group))
    others = {}  # another dimensionality in the group -> a probe shape of it
    for q in group.get("params", ()):
        if q.dim() != traced_dim and q.dim() not in others:
            others[q.dim()] = probe_shape(group, like=q)
    # Vectors and matrices are both traced, whichever the group holds: a rule is then right for either
    # (a select on is_matrix where the math differs), also where it steps tensors of a dimensionality its
    # group did not have when traced (ZeRO's flat pieces of matrices: a rule with such a select is a
    # matrix plan, which ZeRO refuses, rather than vector math on matrices)
    classes = {traced_dim >= 2} | {nd >= 2 for nd in others}
    if True not in classes:
        others[2] = (4, 3)
    if False not in classes:
        others[1] = (PROBE_ELEMENTS,)

    def update(b):
        traces = {traced_dim: (_explore(opt, group, layout, b, True), _explore(opt, group, layout, b, False))}
        for nd, shape in sorted(others.items()):
            try:
                traces[nd] = (_explore(opt, group, layout, b, True, shape), _explore(opt, group, layout, b, False, shape))
            except TraceError:
                raise
            except Exception as e:  # noqa: BLE001
                traces[nd] = e

        def same(t, u):
            if isinstance(t, Exception) or isinstance(u, Exception):
                return False
            return all(_same_expr(x[0], y[0]) and set(x[1]) == set(y[1]) and all(_same_expr(x[1][k], y[1][k]) for k in x[1])
                       for x, y in zip(t, u))

        # one rule per group: the same math for every dimensionality, or one math for vectors (and scalars)
        # and one for matrices and more (timm's Mars: AdamW on vectors, MARS on matrices; AdamP projects
        # matrices only), selected by whether the tensor has a matrix view (Op::Shape is_matrix)
        classes = {}
        for nd, t in traces.items():
            classes.setdefault(nd >= 2, []).append((nd, t))
        for members in classes.values():
            for nd, t in members[1:]:
                if not same(t, members[0][1]):
                    raise TraceError(
                        f"{type(opt).__name__}'s step is other math for a parameter of {nd} dimension(s) than for "
                        f"one of {members[0][0]} in the same param group (it branches on the parameter's shape): "
                        "the IR selects on whether a tensor is a matrix (2 or more dimensions) or not; not "
                        "traceable yet")
        for members in classes.values():
            if isinstance(members[0][1], Exception):
                e = members[0][1]
                raise TraceError(f"{type(opt).__name__}'s step on a parameter of {members[0][0]} dimension(s) raised "
                                 f"{type(e).__name__}: {e}")
        if len(classes) == 2 and not same(classes[False][0][1], classes[True][0][1]):
            vec, mat = classes[False][0][1], classes[True][0][1]
            if not hasattr(b, "shape"):
                raise TraceError(f"{type(opt).__name__}'s step is other math for vectors than for matrices in one "
                                 "param group, and this build of optfuse._core has no RuleBuilder.shape")
            is_mat = b.shape("is_matrix")

            def pick(m, v):
                return _core.select(is_mat, m, v)
            (p_first, s_first), (p_later, s_later) = [
                (pick(mt[0], vt[0]), {k: pick(mt[1].get(k, _before(b, k, layout.slots)), vt[1].get(k, _before(b, k, layout.slots)))
                                      for k in set(mt[1]) | set(vt[1])})
                for mt, vt in zip(mat, vec)]
        else:
            (p_first, s_first), (p_later, s_later) = traces[traced_dim]
        is_first = b.step() == 1.0
        for k in layout.states:
            later = s_later.get(k, b.state(layout.slots[k]))
            b.set_state(layout.slots[k], _core.select(is_first, s_first[k], later) if k in s_first else later)
        for name in layout.scalar_states:
            k = ("uniform", name)
            later = s_later.get(k, b.uniform_state(name))
            b.set_uniform_state(name, _core.select(is_first, s_first[k], later) if k in s_first else later)
        b.set_param_base(_core.select(is_first, p_first, p_later))
        return b.constant(0.0)

    rule.update(update)
    return rule, layout
