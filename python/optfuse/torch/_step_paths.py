"""The step paths other than the plain eager step: torch.compile (the custom op
optfuse::fused_step, _compile.py) and CUDA-graph capture. A mixin of FusedOptimizer (_base.py).

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
import torch
import torch.optim.optimizer as _torch_opt

from .. import _core
from . import _compile
from ._group_values import _host_number, _host_view
from ._precision import _precision_key

OptfuseError = _core.OptfuseError


def _dynamo_opaque(fn):
    """fn runs eagerly under torch.compile (a graph break around it), never traced."""
    disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
    return disable(fn) if disable is not None else fn



class StepPaths:
    """torch.compile's traced step and CUDA-graph capture checks (see the module docstring)."""

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
        self._launch(grad_scale, found_inf, capturing)
        if self._ustate_bufs:  # (CPU: opt.state's eta, mu, mu_product current after this step too)
            self._refresh_uniform_states()

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
        if not self._graph_step or self._copies or self._gathers:
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

