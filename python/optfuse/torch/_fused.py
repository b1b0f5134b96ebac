"""optfuse.torch.Fused: any chain (built-in or rules written in Python) as a torch optimizer, and
optfuse.torch.fuse: a running torch.optim optimizer turned into its fused equivalent."""
import sys
import weakref

import torch

from .. import _core
from ._base import FusedOptimizer, OptfuseError, _host_view, _with_unscale
from ._adafactor import Adafactor
from ._optimizers import ASGD, SGD, Adadelta, Adagrad, Adam, Adamax, AdamW, NAdam, RAdam, RMSprop, Rprop


class Fused(FusedOptimizer):
    """A torch optimizer for any optfuse chain.

        chain = optfuse.chain(my_rule, optfuse.make_builtin("scale_by_learning_rate", lr=1e-2))
        opt = optfuse.torch.Fused(chain, model.parameters())

    Each hyperparameter of the chain is a param_groups key, under its short name ("lr") or, where a
    short name is ambiguous, its qualified name ("trace#2.momentum"); lr schedulers and group dicts
    set them like any torch optimizer's. State per parameter uses the chain's state names.
    """

    _skips_only_on_found_inf = False  # a chain may skip steps itself (skip_if_nonfinite, user rules)

    def __init__(self, chain, params, **hypers):
        self._chain = list(_flatten(chain))
        probe = _core.Optimizer(self._chain, "reference", 1)  # names and defaults, without compiling
        short, qual = probe.hyper_short_names, probe.hyper_names
        names = [s if short.count(s) == 1 else q for s, q in zip(short, qual)]
        defaults = {n: probe.hyper(0, q) for n, q in zip(names, qual)}
        unknown = set(hypers) - set(defaults)
        if unknown:
            raise OptfuseError(f"Fused: unknown hyperparameter(s) {sorted(unknown)}; this chain has {names}")
        defaults.update({k: float(v) for k, v in hypers.items()})
        self._names = dict(zip(names, qual))
        self._sig_keys = tuple(names)
        state_short = [s for s, _, _ in probe.state_specs]
        self._state_key = {q: (s if state_short.count(s) == 1 else q) for s, q, _ in probe.state_specs}
        super().__init__(params, defaults)

    def _make_chain(self, key, features, groups):
        return self._chain

    def _hypers(self, g):
        return {qual: g[name] for name, qual in self._names.items()}

    def _states_for(self, p, st, engine, prec):
        # the engine lists short names; rename to this chain's unique keys for the state dict
        engine.state_names = [self._state_key.get(q, s) for s, q, _ in engine.core.state_specs]
        return super()._states_for(p, st, engine, prec)


def _flatten(chain):
    if isinstance(chain, str):
        yield from _core.parse_chain(chain)
    elif isinstance(chain, _core.Rule):
        yield chain
    else:
        for c in chain:
            yield from _flatten(c)


_FUSABLE = {
    torch.optim.SGD: SGD,
    torch.optim.Adam: Adam,
    torch.optim.AdamW: AdamW,
    torch.optim.Adagrad: Adagrad,
    torch.optim.RMSprop: RMSprop,
    torch.optim.RAdam: RAdam,
    torch.optim.NAdam: NAdam,
    torch.optim.Adamax: Adamax,
    torch.optim.Adadelta: Adadelta,
    torch.optim.Rprop: Rprop,
    torch.optim.ASGD: ASGD,
    torch.optim.Adafactor: Adafactor,
}


def _third_party_drop_ins():
    """Drop-ins for classes of other packages: {class: (drop-in, whether it applies to an instance)}.
    Only packages already imported are looked at (an optimizer of theirs means they are), so fuse()
    imports none of them. Where a drop-in does not cover an option the instance uses (timm Lamb's
    caution, lion-pytorch's decoupled_weight_decay or Triton kernel), the class is traced instead (and
    refused with the reason if it cannot be)."""
    out = {}
    schedulefree = sys.modules.get("schedulefree")
    if schedulefree is not None and hasattr(schedulefree, "AdamWScheduleFree"):
        from ._schedule_free import AdamWScheduleFree
        out[schedulefree.AdamWScheduleFree] = (AdamWScheduleFree, None)
    timm_optim = sys.modules.get("timm.optim")
    if timm_optim is not None:
        from ._layerwise import Lamb, Lars
        if hasattr(timm_optim, "Lamb"):
            out[timm_optim.Lamb] = (Lamb, lambda o: not any(g.get("caution") for g in o.param_groups))
        if hasattr(timm_optim, "Lars"):
            out[timm_optim.Lars] = (Lars, None)
    lion_pytorch = sys.modules.get("lion_pytorch")
    if lion_pytorch is not None and hasattr(lion_pytorch, "Lion"):
        from ._optimizers import Lion

        def plain(o):  # lion-pytorch's update_fn is its plain torch one (not Triton), weight decay coupled to lr
            return not getattr(o, "decoupled_wd", False) and getattr(o.update_fn, "__module__", "") == "lion_pytorch.lion_pytorch"
        out[lion_pytorch.Lion] = (Lion, plain)
    return out


def _drop_in(opt):
    cls = _FUSABLE.get(type(opt))
    if cls is not None:
        return cls
    cls, applies = _third_party_drop_ins().get(type(opt), (None, None))
    return cls if cls is not None and (applies is None or applies(opt)) else None


def fuse(opt):
    """The fused equivalent of a torch.optim SGD, Adam, AdamW, Adagrad, RMSprop, RAdam, NAdam, Adamax, Adadelta,
    Rprop, ASGD or Adafactor, of a schedulefree.AdamWScheduleFree, timm.optim.Lamb or Lars, or of a
    lion_pytorch.Lion, mid-training (any other optimizer: its step traced, see _traced.py):
    the same param_groups (the very dicts, so an lr scheduler attached to `opt` keeps working) and
    the same state tensors (taken over, not copied: keep stepping the returned optimizer only).

    On a function written like torch's functional single-tensor optimizers
    (torch.optim.adam._single_tensor_adam): a function with the same signature that updates all the
    lists in one fused launch per (device, dtype) (see _fuse_fn.py)."""
    if not isinstance(opt, torch.optim.Optimizer) and callable(opt):
        from ._fuse_fn import FusedFunction
        return FusedFunction(opt)
    cls = _drop_in(opt)
    for i, g in enumerate(opt.param_groups):
        if g.get("differentiable") and cls is None:
            raise OptfuseError(f"optfuse.torch.fuse: group {i} has differentiable=True: a traced step runs outside "
                               "autograd (the drop-ins of torch.optim's classes step such groups with torch's own)")
        for p in g["params"]:
            if torch.is_complex(p) and cls is None:
                raise OptfuseError(f"optfuse.torch.fuse: group {i} has a complex parameter {tuple(p.shape)}, "
                                   "which optfuse does not support")
            if p.grad is not None and p.grad.is_sparse and cls is None:
                raise OptfuseError(f"optfuse.torch.fuse: group {i} has a sparse gradient {tuple(p.shape)}, "
                                   "which optfuse does not support")
    if cls is None:  # no hand-written drop-in: trace its step (refused with the reason if it cannot be)
        from ._traced import fuse_by_tracing
        return fuse_by_tracing(opt)
    new = cls.__new__(cls)
    FusedOptimizer.__init__(new, opt.param_groups, dict(opt.defaults))
    new._fused_from = weakref.ref(opt)  # (its lr schedulers see its steps: FusedOptimizer.step)
    for p, st in opt.state.items():
        new.state[p] = dict(st)
    return new


def explain(opt, backend="cpu", source=False):
    """What optfuse runs for a fused optimizer (any optfuse.torch optimizer, a traced one included):
    `optfuse explain`'s text (rules, passes, IR, plan, optionally the generated source) once per
    distinct chain its param groups use."""
    if not isinstance(opt, FusedOptimizer):
        raise OptfuseError(f"optfuse.torch.explain: {type(opt).__name__} is not an optfuse optimizer; fuse() it first")
    seen, texts = set(), []
    for g in opt.param_groups:
        h = _host_view(g)
        chain = _with_unscale(opt._make_chain(opt._structure(h), opt._features(h), [h]))
        text = _core.chain_text(chain)
        if text not in seen:
            seen.add(text)
            texts.append(_core.explain(chain, backend, source))
    return "\n".join(texts)

