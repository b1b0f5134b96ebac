"""Sharded optimizer state over torch.distributed: ZeRO stage 1.

    model = DistributedDataParallel(model)              # every rank holds the averaged gradients
    opt = optfuse.torch.distributed.ZeRO(optfuse.torch.AdamW(model.parameters(), lr=3e-4))
    ...  loss.backward(); opt.step(); opt.zero_grad()

The parameters, in param_groups order, form one flat index space of `total` elements. Rank r owns
one contiguous range of it (`shard_ranges`), which cuts across tensor boundaries; each tensor's part
in a rank's range is a *piece*: a flat view of the parameter (and of its gradient at each step).
Every rank steps only its pieces, with one optimizer of the wrapped class over the pieces (so one
fused launch per pass, and states only for the pieces: 1/N of the state memory), then the ranks
all-gather the updated parameters (per dtype, one collective each). The traffic is one all-gather
of the parameters per step, as in DeepSpeed's stage 1; the gradients come from DDP's all-reduce.

Element-wise optimizers give bitwise the same parameters and states as the unsharded optimizer on
the same averaged gradients: every element sees the same float32 math. Chains with reductions
(clip_by_global_norm, skip_if_nonfinite, Lamb's and Lars's per-tensor norms) are refused: their
partial sums would have to cross ranks between two passes, which needs the step schedule's hook
point (not built yet). Stage 2 (gradient reduce-scatter), FSDP2 and DCP checkpoints are not built.
"""
from collections import defaultdict

import torch
import torch.distributed as dist

from .. import _core
from ._base import FusedOptimizer, OptfuseError
from ._fused import fuse

# Pieces start on multiples of 64 elements of the flat space, so a piece of an aligned parameter
# stays 16-byte aligned for every dtype (the CUDA kernels' vector loads need it).
ALIGN = 64


def shard_ranges(total, world):
    """[start, end) of the flat index space owned by each rank: equal sizes, multiples of ALIGN
    (the last ranks may own less, or nothing)."""
    per = -(-total // world)
    per = -(-per // ALIGN) * ALIGN
    return [(min(r * per, total), min((r + 1) * per, total)) for r in range(world)]


class _Piece:
    __slots__ = ("param", "begin", "end", "view")

    def __init__(self, param, begin, end):
        self.param, self.begin, self.end = param, begin, end
        self.view = param.detach().view(-1)[begin:end]  # shares the parameter's memory


class ZeRO(torch.optim.Optimizer):
    """ZeRO stage 1 around an optfuse.torch optimizer (a torch.optim one is fused with fuse()):
    the torch.optim.Optimizer API (param_groups are the wrapped optimizer's, so schedulers work),
    GradScaler, state dicts consolidated in the wrapped optimizer's format on every rank."""

    _step_supports_amp_scaling = True

    def __init__(self, optimizer, process_group=None, stage=1):
        if stage != 1:
            raise OptfuseError(f"ZeRO: stage={stage} is not built yet (only stage=1: gradients all-reduced by DDP)")
        from ._muon import Muon, MuonWithAuxAdam
        if isinstance(optimizer, (Muon, MuonWithAuxAdam)):
            # Shards are flat element ranges that cut matrices; Newton-Schulz needs each matrix whole.
            raise OptfuseError(f"ZeRO: {type(optimizer).__name__} orthogonalises whole matrices, which ZeRO's flat "
                               "shards cut apart; a shard owning whole matrices is not built yet (issue 12)")
        if not dist.is_available() or not dist.is_initialized():
            raise OptfuseError("ZeRO: torch.distributed is not initialised (call dist.init_process_group first)")
        if not isinstance(optimizer, FusedOptimizer):
            optimizer = fuse(optimizer)
        self.optimizer = optimizer
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        super().__init__(optimizer.param_groups, optimizer.defaults)  # the same group dicts
        self._check_no_reductions()
        self._plan_shards()
        self._take_state_from(optimizer)

    # --- setup
    def _check_no_reductions(self):
        opt = self.optimizer
        for i, g in enumerate(self.param_groups):
            chain = opt._make_chain(opt._structure(g), opt._features(g), [g])
            scopes = _core.make_plan(chain).reduction_scopes
            if scopes:
                raise OptfuseError(
                    f"ZeRO: {type(opt).__name__} (group {i}) computes {'/'.join(sorted(set(scopes)))} reductions "
                    f"({_core.chain_text(chain)}); across shards their partial sums must be combined between "
                    "passes, which is not built yet. Element-wise optimizers (SGD, Adam, AdamW, ...) work.")

    def _plan_shards(self):
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            if not p.is_contiguous():
                raise OptfuseError(f"ZeRO: parameters must be contiguous (shape {tuple(p.shape)}, strides {p.stride()})")
        self._param_index = {id(p): i for i, p in enumerate(params)}
        total = sum(p.numel() for p in params)
        self._ranges = shard_ranges(total, self.world)
        self._pieces = [[] for _ in range(self.world)]  # per rank, in flat order
        start = 0
        for p in params:
            end = start + p.numel()
            for r, (lo, hi) in enumerate(self._ranges):
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    self._pieces[r].append(_Piece(p, a - start, b - start))
            start = end
        mine = {id(pc.param): pc for pc in self._pieces[self.rank]}
        inner_groups = []
        for g in self.param_groups:
            options = {k: v for k, v in g.items() if k != "params"}
            inner_groups.append(dict(options, params=[mine[id(p)].view for p in g["params"] if id(p) in mine]))
        self._mine = self._pieces[self.rank]
        cls = type(self.optimizer)
        self._inner = cls.__new__(cls)
        FusedOptimizer.__init__(self._inner, inner_groups, dict(self.optimizer.defaults))
        self._inner._graph_step = False  # its parameters are views re-pointed each step: the eager step
        # Stochastic rounding draws for a piece what the unsharded optimizer draws for those elements.
        self._inner._rng_streams = {id(pc.view): (self._param_index[id(pc.param)] + 1, pc.begin) for pc in self._mine}

    def _take_state_from(self, optimizer):
        """Slices the full per-parameter state of `optimizer` into this rank's pieces, then drops it."""
        if optimizer._engines:  # it has stepped: its step counts may be newer than its state's
            optimizer._sync_steps(write_state=True)
        for pc in self._mine:
            full = optimizer.state.get(pc.param)
            if not full:
                continue
            st = self._inner.state[pc.view]
            for k, v in full.items():
                if torch.is_tensor(v) and v.shape == pc.param.shape:
                    st[k] = v.detach().reshape(-1)[pc.begin:pc.end].clone()
                else:
                    st[k] = v.clone() if torch.is_tensor(v) else v
        optimizer.state.clear()
        optimizer._engines, optimizer._steps, optimizer._of_dirty = {}, {}, True  # retired: it holds no state now
        self._inner._of_dirty = True

    # --- torch.optim.Optimizer API
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self._inner.param_groups):  # schedulers write the outer ones
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v
        for pc in self._mine:
            g = pc.param.grad
            if g is not None and not g.is_contiguous():
                raise OptfuseError(f"ZeRO: gradients must be contiguous (shape {tuple(g.shape)})")
            pc.view.grad = None if g is None else g.view(-1)[pc.begin:pc.end]
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        self._inner.step(grad_scale=grad_scale, found_inf=found_inf)
        self._all_gather_params()
        return loss

    def _all_gather_params(self):
        """Every rank's pieces to every rank: one all_gather per dtype of equal-length (padded) buffers."""
        by_dtype = defaultdict(lambda: [[] for _ in range(self.world)])
        for r, pieces in enumerate(self._pieces):
            for pc in pieces:
                by_dtype[pc.param.dtype][r].append(pc)
        for dtype, per_rank in by_dtype.items():
            sizes = [sum(pc.end - pc.begin for pc in pieces) for pieces in per_rank]
            n = max(sizes)
            if n == 0:
                continue
            device = per_rank[self.rank][0].view.device if per_rank[self.rank] else next(
                pc.view.device for pieces in per_rank for pc in pieces)
            send = torch.zeros(n, dtype=dtype, device=device)
            if sizes[self.rank]:
                torch.cat([pc.view for pc in per_rank[self.rank]], out=send[:sizes[self.rank]])
            recv = [torch.empty(n, dtype=dtype, device=device) for _ in range(self.world)]
            dist.all_gather(recv, send, group=self.process_group)
            for r, pieces in enumerate(per_rank):
                if r == self.rank:
                    continue
                at = 0
                for pc in pieces:
                    k = pc.end - pc.begin
                    pc.view.copy_(recv[r][at:at + k])
                    at += k

    def state_dict(self):
        """The unsharded state dict in the wrapped optimizer's (torch's) format, on every rank. The
        pieces travel as CPU tensors through all_gather_object (simple, not fast: for checkpoints)."""
        self._inner._sync_steps(write_state=True)  # step counts into the pieces' state
        local = {}
        for pc in self._mine:
            st = self._inner.state.get(pc.view)
            if st:
                local[(self._param_index[id(pc.param)], pc.begin, pc.end)] = {
                    k: (v.detach().cpu(), str(v.device)) if torch.is_tensor(v) else (v, None) for k, v in st.items()}
        gathered = [None] * self.world
        dist.all_gather_object(gathered, local, group=self.process_group)
        params = self._params()
        for part in gathered:
            for (i, a, b), st in sorted(part.items()):
                p = params[i]
                full = self.optimizer.state[p]
                for k, (v, device) in st.items():
                    if device is not None and v.dim() == 1 and v.numel() == b - a:  # per element: this piece
                        if k not in full:
                            full[k] = torch.zeros(p.shape, dtype=v.dtype, device=p.device)
                        full[k].view(-1)[a:b] = v
                    elif k not in full:  # per parameter (step, ASGD's eta and mu): every piece has it
                        full[k] = v.to(device) if device is not None else v
        try:
            return self.optimizer.state_dict()
        finally:
            self.optimizer.state.clear()  # the full state lives only in the returned dict

    def load_state_dict(self, state_dict):
        """Loads an unsharded state dict (any world size saved it, or an unsharded optimizer)."""
        self.optimizer.load_state_dict(state_dict)  # torch's load makes new group dicts: take their values
        for mine, loaded in zip(self.param_groups, self.optimizer.param_groups):
            mine.update({k: v for k, v in loaded.items() if k != "params"})
        self.optimizer.param_groups = self.param_groups  # one set of group dicts again (schedulers hold them)
        self._inner.state.clear()
        self._take_state_from(self.optimizer)

    # --- helpers
    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def local_state_numel(self):
        """Elements of per-element optimizer state this rank holds (not step counts or other scalars):
        about 1/N of the unsharded optimizer's."""
        return sum(v.numel() for st in self._inner.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim() > 0)
