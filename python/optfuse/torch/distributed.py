"""Sharded optimizer state over torch.distributed: ZeRO stage 1.

    model = DistributedDataParallel(model)              # every rank holds the averaged gradients
    opt = optfuse.torch.distributed.ZeRO(optfuse.torch.AdamW(model.parameters(), lr=3e-4))
    ...  loss.backward(); opt.step(); opt.zero_grad()

The parameters, in param_groups order, form one flat index space. Rank r owns one contiguous range
of it (`shard_ranges`), which cuts across tensor boundaries, at a tensor's start or a multiple of the
backend's chunk (`_core.chunk_elements`) into it. Each tensor's part in a rank's range is a *piece*:
a flat view of the parameter (and of its gradient at each step); every rank has a piece of every
parameter, most of them empty, so every rank's optimizer has the same engines in the same order.
Every rank steps only its pieces, with one optimizer of the wrapped class over the pieces (one fused
launch per pass, states only for the pieces: 1/N of the state memory), then the ranks all-gather
the updated parameters (per dtype, one collective each). The traffic is one all-gather of the
parameters per step, as in DeepSpeed's stage 1; the gradients come from DDP's all-reduce.

Reductions (clip_by_global_norm, skip_if_nonfinite, Lamb's and Lars's per-tensor norms) cross ranks
at the step schedule's Exchange step (optfuse/schedule.h): after a reduce pass every rank
all-gathers the per-chunk partial sums into the global chunk order, and each rank combines all of
them as the unsharded optimizer would. Because cuts fall on chunk boundaries, the chunks are the
unsharded optimizer's, so every rank's parameters and states are bitwise those of the unsharded
optimizer on the same averaged gradients, for every reduction scope. Stage 2 (gradient
reduce-scatter), FSDP2 and DCP checkpoints are not built.
"""
import bisect
from collections import defaultdict

import torch
import torch.distributed as dist

from .. import _core
from ._base import FusedOptimizer, OptfuseError
from ._fused import fuse

def shard_ranges(sizes, world, chunk):
    """[start, end) of the flat index space (tensors of `sizes` end to end) owned by each rank: about
    total / world elements each, every cut at a tensor's start or a multiple of `chunk` into a
    tensor (so a piece's chunks are its tensor's, and partial sums combine as unsharded). The last
    ranks may own less, or nothing."""
    cuts, total = [], 0
    for n in sizes:
        cuts.extend(range(total, total + n, chunk))
        total += n
    cuts.append(total)
    bounds = [0]
    for r in range(1, world):
        bounds.append(max(cuts[bisect.bisect_right(cuts, total * r // world) - 1], bounds[-1]))
    bounds.append(total)
    return list(zip(bounds[:-1], bounds[1:]))


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
        self._plan_shards()
        self._take_state_from(optimizer)

    # --- setup
    def _plan_shards(self):
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            if not p.is_contiguous():
                raise OptfuseError(f"ZeRO: parameters must be contiguous (shape {tuple(p.shape)}, strides {p.stride()})")
        devices = {p.device.type for p in params}
        if len(devices) > 1:
            raise OptfuseError(f"ZeRO: parameters on several device types ({sorted(devices)}); shard one model per device")
        self._chunk = _core.chunk_elements("cuda" if devices == {"cuda"} else "cpu")
        self._param_index = {id(p): i for i, p in enumerate(params)}
        self._ranges = shard_ranges([p.numel() for p in params], self.world, self._chunk)
        # Per rank, a piece of every parameter in flat order (empty where the rank owns none of it):
        # so every rank's optimizer has the same engines in the same order, and all of them take part
        # in every exchange.
        self._pieces = [[] for _ in range(self.world)]
        start = 0
        for p in params:
            end = start + p.numel()
            for r, (lo, hi) in enumerate(self._ranges):
                a, b = max(lo, start), min(hi, end)
                self._pieces[r].append(_Piece(p, a - start, b - start) if a < b else _Piece(p, 0, 0))
            start = end
        self._mine = self._pieces[self.rank]
        self._piece_of_view = {id(pc.view): pc for pc in self._mine}
        mine = {id(pc.param): pc for pc in self._mine}
        inner_groups = []
        for g in self.param_groups:
            options = {k: v for k, v in g.items() if k != "params"}
            inner_groups.append(dict(options, params=[mine[id(p)].view for p in g["params"]]))
        cls = type(self.optimizer)
        self._inner = cls.__new__(cls)
        # The class's own settings (a Fused optimizer's chain and names, ...); the base __init__ then
        # makes fresh groups, state and engines.
        self._inner.__dict__.update(self.optimizer.__dict__)
        FusedOptimizer.__init__(self._inner, inner_groups, dict(self.optimizer.defaults))
        # Stochastic rounding draws for a piece what the unsharded optimizer draws for those elements.
        self._inner._rng_streams = {id(pc.view): (self._param_index[id(pc.param)] + 1, pc.begin) for pc in self._mine}
        self._inner._on_engine_built = self._set_exchange

    def _set_exchange(self, engine):
        """After the inner optimizer built an engine over its pieces: if its chain has reductions, make
        its steps all-gather the per-chunk partials of every rank into the global chunk order. The
        global chunks are the unsharded engine's: every chunk of every parameter in this engine's
        table (every rank's engine lists the same parameters, in the same order)."""
        if not engine.core.plan.reduction_scopes:
            return
        chunk = self._chunk
        if engine.core.chunk_elements != chunk:
            raise OptfuseError(f"ZeRO: the {engine.backend} backend cuts {engine.core.chunk_elements}-element chunks, "
                               f"the shards were cut at {chunk}")
        pieces = [self._piece_of_view[id(v)] for v in engine.params]
        firsts, counts, global_chunks = [], [], 0
        first_of = {}
        for pc in pieces:
            n = -(-pc.param.numel() // chunk)
            first_of[id(pc.param)] = global_chunks
            firsts.append(global_chunks)
            counts.append(n)
            global_chunks += n
        # Each rank's chunks in this engine: one contiguous range of the global chunks (its pieces of
        # these parameters are consecutive in flat order, and every cut is a chunk boundary).
        spans = []
        for rank_pieces in self._pieces:
            in_engine = [pc for pc in rank_pieces if id(pc.param) in first_of and pc.end > pc.begin]
            n = sum(-(-(pc.end - pc.begin) // chunk) for pc in in_engine)
            spans.append((first_of[id(in_engine[0].param)] + in_engine[0].begin // chunk if in_engine else 0, n))
        width = max(n for _, n in spans)
        group = self.process_group

        def exchange(phase, rows, local, glob):
            rows_t = torch.tensor(rows, dtype=torch.long, device=local.device)
            send = torch.zeros(len(rows), width, dtype=local.dtype, device=local.device)
            mine = spans[self.rank][1]
            send[:, :mine] = local.index_select(0, rows_t)
            recv = [torch.empty_like(send) for _ in range(self.world)]
            dist.all_gather(recv, send, group=group)
            for (first, n), part in zip(spans, recv):
                if n:
                    glob[rows_t, first:first + n] = part[:, :n]

        engine.core._set_exchange(global_chunks, firsts, counts, exchange)

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
        # Group-level state the class writes into its groups when saving (timm's Lamb keeps its step
        # count in the group): every rank's pieces have the same counts, so the inner groups' value
        # is the unsharded one.
        self._inner.state_dict()
        for outer, inner in zip(self.param_groups, self._inner.param_groups):
            for k, v in inner.items():
                if k != "params" and (k == "step" or k not in outer):
                    outer[k] = v
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
