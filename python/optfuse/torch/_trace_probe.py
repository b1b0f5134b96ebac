"""The layout probe of a trace (see _trace.py): what an optimizer keeps, found by stepping a copy of it.

_probe makes a shallow copy of the optimizer whose only parameter is a small probe tensor, in a copy of
one param group; _Layout steps it twice without recording to learn the per-parameter state slots, the
step count (per parameter or in the group: group_counters) and the values the step writes into the
group. hyper_values and structure split a param group into the rule's hyperparameters and the options
a trace depends on otherwise; _traced.py keys its traced rules on them.
"""
import re

import torch

from ._trace_values import TraceError

PROBE_ELEMENTS = 8   # a probe parameter's size when the group has none to copy the dimensions of


def _numeric(v):
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or (torch.is_tensor(v) and v.numel() == 1)


def hyper_values(group, counters=()):
    """The param group's numeric options as rule hyperparameters: {"lr": 1e-3, "betas#0": 0.9, ...}.
    `counters` are group entries the step increments (a step count kept in the group): the rule's
    step input, not hyperparameters."""
    out = {}
    for k, v in group.items():
        if k == "params" or k in counters:
            continue
        if _numeric(v):
            out[k] = float(v)
        elif isinstance(v, (tuple, list)) and v and all(_numeric(x) for x in v):
            for i, x in enumerate(v):
                out[f"{k}_{i}"] = float(x)
    return out


def structure(group, counters=()):
    """What a trace depends on besides hyperparameters: the group's other options (flags, None, strings),
    and the dimensionalities of its parameters: a step may be other math for vectors than for matrices
    (timm's AdamP, SGDP, Mars), so a rule traced on a group of vectors only (the biases of a
    weight-decay split) must never step a group of matrices with the same options."""
    h = hyper_values(group, counters)
    dims = tuple(sorted({p.dim() for p in group.get("params", ()) if torch.is_tensor(p)}))
    return tuple((k, repr(v)) for k, v in sorted(group.items())
                 if k != "params" and k not in counters and k not in h and f"{k}_0" not in h) + (("params.dim()", dims),)


def _group_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Layout:
    """What the optimizer keeps per parameter, found by stepping a probe twice without recording; and
    what its step writes into the param group (a step count kept there: pytorch-optimizer's
    group['step'], schedulefree's group['k'])."""

    def __init__(self, opt, group):
        probe, p = _probe(opt, group, None)
        g = probe.param_groups[0]
        seen = [{k: _private(v) for k, v in g.items()}]
        for _ in range(2):
            p.grad = torch.randn_like(p)
            probe.step()
            seen.append({k: _private(v) for k, v in g.items()})
        self.counters, self.group_states = _group_writes(type(opt).__name__, seen)
        st = probe.state.get(p, {})
        # the same two steps on other values: a scalar state that differs is computed from the tensor's
        # values (NovoGrad's average of the gradient's squared norm), one that does not is uniform
        probe2, p2 = _probe(opt, group, None)
        for _ in range(2):
            p2.grad = torch.randn_like(p2)
            probe2.step()
        st2 = probe2.state.get(p2, {})
        self.states, self.step_key, self.step_is_tensor = [], None, False
        # scalar states per parameter (LaProp's exp_avg_lr_1, NAdamLegacy's m_schedule, QHAdam's
        # beta1_weight): their value after two steps, as the template of their type, shape and dtype.
        # Traced as the IR's uniform states where the step computes them from hyperparameters, the step
        # and their own value only; one computed from the tensor's values (a norm) is refused (_trace_once)
        self.scalar_states, self.tensor_scalars = {}, {}
        for k, v in st.items():
            if v is None:  # a slot the optimizer does not use with these options (SGDW's buffer without momentum)
                continue
            if torch.is_tensor(v) and v.shape == p.shape:
                self.states.append(k)
            elif k == "step" and (torch.is_tensor(v) or _numeric(v)):
                self.step_key, self.step_is_tensor = k, torch.is_tensor(v)
            elif (isinstance(v, float) or torch.is_tensor(v) and v.numel() == 1 and v.dim() <= 1
                  and v.dtype in (torch.float32, torch.float64)):
                if torch.is_tensor(v) and not _same(v, st2.get(k)):
                    # a value per tensor: a slot of the parameter's shape holding it in every element, read
                    # as a per-tensor value (kind "tensor"); the original's format in the state dict
                    self.tensor_scalars[k] = _private(v)
                    self.states.append(k)
                else:
                    self.scalar_states[k] = _private(v)
            else:
                raise TraceError(f"{type(opt).__name__} keeps a per-parameter state '{k}' "
                                 f"({type(v).__name__}{tuple(v.shape) if torch.is_tensor(v) else ''}) that is neither "
                                 "a tensor of the parameter's shape nor the step count: not traceable yet")
        # the rule's name of each state: the generated kernel declares states as C++ variables of their
        # names, so a name that is not an identifier, is a C++ keyword or one of the kernel's own
        # variables (AdamG's state 'v') gets another (Traced maps it back to the original's key)
        self.slots, taken = {}, set()
        for k in self.states:
            name = k if _safe_identifier(k) else "state_" + re.sub(r"\W", "_", k)
            while name in taken or name in self.states and name != k:
                name += "_"
            taken.add(name)
            self.slots[k] = name
        for k in self.scalar_states:
            if not _safe_identifier(k):
                raise TraceError(f"{type(opt).__name__} keeps a per-parameter scalar state named {k!r}, which optfuse's "
                                 "generated kernels cannot declare (not an identifier, or a name the kernel uses itself)")
        if self.counters and self.step_key is not None:
            raise TraceError(f"{type(opt).__name__} keeps a step count both per parameter (state '{self.step_key}') "
                             f"and in the param group ({', '.join(self.counters)}): not traceable yet")


# C++ keywords and the names the generated kernels declare themselves (their arguments and locals)
_RESERVED = frozenset("""
alignas alignof and and_eq asm auto bitand bitor bool break case catch char char16_t char32_t class compl const
constexpr const_cast continue decltype default delete do double dynamic_cast else enum explicit export extern
false float for friend goto if inline int long mutable namespace new noexcept not not_eq nullptr operator or
or_eq private protected public register reinterpret_cast return short signed sizeof static static_assert
static_cast struct switch template this thread_local throw true try typedef typeid typename union unsigned
using virtual void volatile wchar_t while xor xor_eq restrict
v u acc st red out sums shape derived reductions param grad i j k n x y p g e s idx row col rows cols numel
""".split())


def _safe_identifier(name):
    return (re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name) is not None and name not in _RESERVED
            and re.fullmatch(r"(t|upd_|of_|OF_).*", name) is None)


def _group_writes(cls, seen):
    """The param group's entries as a probe stepped twice (seen: before, after 1, after 2 steps):
    counters (Python numbers the step adds exactly 1 to, from 0 or absent on a fresh group) and the
    keys of other values the step writes into the group (a running sum or maximum of
    hyperparameters kept across steps: a per-group scalar state, which the IR has not)."""
    counters, written = [], []
    for k in sorted(set(seen[1]) | set(seen[2])):
        if k == "params":
            continue
        vals = [d.get(k) for d in seen]
        if (k not in seen[0] or _same(vals[0], vals[1])) and _same(vals[1], vals[2]):
            continue  # not written, or only created on the first step with a value it keeps (MADGRAD's 'step')
        if (all(_group_number(v) for v in vals[1:]) and vals[2] == vals[1] + 1
                and (vals[1] == 1 if k not in seen[0] else _group_number(vals[0]) and vals[1] == vals[0] + 1)):
            counters.append(k)
        else:
            written.append(k)
    return tuple(counters), tuple(written)


def _same(a, b):
    if type(a) is not type(b):
        return False
    if torch.is_tensor(a):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool((a == b).all())
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _group_state_message(cls, keys):
    more = f", as are {', '.join(keys[1:])}" if keys[1:] else ""
    return (f"{cls}'s step writes group['{keys[0]}'] (a value it computes and keeps in the param group{more}): a "
            "per-group scalar state, which the IR has not")


def group_counters(opt):
    """The group entries every group's step increments (see _Layout), for hyper_values/structure."""
    keys = set()
    for g in opt.param_groups:
        keys |= set(_Layout(opt, g).counters)
    return frozenset(keys)


def _private(v):
    return v.detach().clone() if torch.is_tensor(v) else v


def probe_shape(group, like=None):
    """A small shape with the dimensions of `like` (default: the group's first parameter), each at most
    4: optimizer code may branch on p.dim() (timm's SGDP projects matrices differently from vectors)."""
    like = like if like is not None else (group["params"][0] if group.get("params") else torch.empty(PROBE_ELEMENTS))
    return tuple(min(d, 4) for d in like.shape) or ()


def _probe(opt, group, hyper_subst, shape=None):
    """A shallow copy of `opt` whose only parameter is a small probe tensor, in a copy of `group`."""
    p = torch.randn(shape if shape is not None else probe_shape(group))
    # tensors are copied: the probe's step must not change the optimizer's own (timm's group["step"])
    g = {k: _private(hyper_subst(k, v) if hyper_subst else v) for k, v in group.items() if k != "params"}
    g["params"] = [p]
    probe = object.__new__(type(opt))
    # not opt's own step: an lr scheduler stores a wrapper there that steps opt, whatever it is called on
    probe.__dict__.update({k: _private(v) for k, v in opt.__dict__.items() if k != "step"})
    probe.param_groups = [g]
    probe.state = __import__("collections").defaultdict(dict)
    return probe, p
