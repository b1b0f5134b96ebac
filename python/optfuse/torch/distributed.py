"""Sharded optimizer state over torch.distributed: ZeRO stages 1 and 2, sharded DCP checkpoints.

    # stage 1: DDP averages the gradients, every rank holds them all
    model = DistributedDataParallel(model)
    opt = optfuse.torch.distributed.ZeRO(optfuse.torch.AdamW(model.parameters(), lr=3e-4))
    ...  loss.backward(); opt.step(); opt.zero_grad()

    # stage 2: no DDP; ZeRO reduce-scatters the local gradients, each rank keeps its shard's average
    opt = optfuse.torch.distributed.ZeRO(optfuse.torch.AdamW(model.parameters(), lr=3e-4), stage=2)
    ...  loss.backward(); opt.step(); opt.zero_grad()

The parameters of each dtype, in param_groups order, are grouped into buckets of consecutive
parameters (stage 2: about bucket_cap_mb each; stage 1: one per dtype), and each bucket is cut into
one range per rank (`shard_ranges`) at a tensor's start or a multiple of the backend's chunk
(`_core.chunk_elements`) into it (_zero_buckets.py). Each tensor's part in a rank's range is a
*piece*: a flat view of the parameter; every rank has a piece of every parameter, most of them
empty, so every rank's optimizer has the same engines in the same order. Every rank steps only its
pieces, with one optimizer of the wrapped class over the pieces (one fused launch per pass, states
only for the pieces: 1/N of the state memory), reading each piece's gradient at its offset in the
parameter's .grad (stage 1), then the ranks all-gather the updated parameters (per dtype, one
collective into a kept [world, n] buffer). The traffic is one all-gather of the parameters per step,
as in DeepSpeed's stage 1; the gradients come from DDP's all-reduce.

Stage 2 takes no DDP: each rank backpropagates its own batch, and ZeRO reduce-scatters the local
gradients bucket by bucket as backward produces them (post-accumulate-grad hooks; asynchronous, so
the communication overlaps the rest of backward), each over a [world, row] buffer whose row r is
rank r's pieces of the bucket, `reduce_scatter_tensor` where the backend has it (NCCL; gloo in
recent torch) and otherwise an all_reduce of the buffer keeping this rank's row. step() (or
reduce_gradients() / clip_grad_norm_(), earlier) waits for them, sends what backward did not
complete and sends again any bucket whose gradients changed since (see _zero_buckets.py;
`no_sync()` skips sending during accumulation micro-steps). The owner's rows are divided by the
world size in the gradients' dtype (the sum, then the division: DDP's mean, though DDP itself
scales by 1/N before its all-reduce, in its own bucket layout, so the roundings can differ from
DDP's at 3+ ranks). The averaged shard lives in a persistent flat buffer per dtype (`grad_shards()`,
1/N of the gradients, padded per bucket) whose views are the pieces' gradients; after the step,
every parameter's full `.grad` is set to None (the local gradients are spent). Parameters without
a gradient on any rank are not stepped (as unsharded); a rank without a gradient for a parameter
others have contributes zeros (one small all_reduce of the flags per step). Under a GradScaler,
found_inf is max-reduced across ranks inside step() so every rank skips together; since each rank's
scaler checked only its local gradients, call `zero.reduce_gradients()` between backward and
`scaler.step(zero)` when local infs may occur on some ranks only: it writes a NaN into this rank's
local gradients when any rank's averaged shard is non-finite, so every scaler backs off alike.
GradScaler.unscale_ changes the local gradients in place without a trace, so after a step that
shows it (found_inf without grad_scale) the buckets are sent again and reduction waits for the
step from then on (`overlap=False` from the start avoids the first step's second send). Per-rank
traffic: (N-1)/N of the gradient bytes (reduce-scatter) plus (N-1)/N of the parameter bytes
(all-gather), plus padding per bucket.

Reductions (clip_by_global_norm, skip_if_nonfinite, Lamb's and Lars's per-tensor norms) cross ranks
at the step schedule's Exchange step (optfuse/schedule.h): after a reduce pass every rank
all-gathers the per-chunk partial sums into the global chunk order, and each rank combines all of
them as the unsharded optimizer would. Because cuts fall on chunk boundaries, the chunks are the
unsharded optimizer's, so every rank's parameters and states are bitwise those of the unsharded
optimizer on the same averaged gradients, for every reduction scope, in both stages.

Checkpoints: state_dict() / load_state_dict() are the consolidated (unsharded) torch-format dict on
every rank (all_gather_object of CPU copies; loads into a ZeRO of any world size).
sharded_state_dict() / load_sharded_state_dict() go through torch.distributed.checkpoint without
gathering: each per-element state of parameter i is a ShardedTensor of the parameter's flattened
size whose shards are the ranks' pieces (1-D, at their flat offsets), so DCP reshards on load:
saved by N ranks, loaded by M. FSDP2 (DTensor parameters) needs no wrapper: the optimizers step
local shards themselves, reductions over the mesh included (_dtensor.py); ZeRO refuses DTensor parameters.

Muon, MuonWithAuxAdam and Adafactor: Newton-Schulz and Adafactor's row and column means need whole
matrices, so their shards are cut at tensor starts only; each rank steps the parameters it owns,
whole, with the wrapped class (stage 2: each owned matrix's gradient is its averaged shard); their
sharded (DCP) checkpoints hold each owned state whole, written by its owner. Another rule chain with
row or column values (a matrix plan) is refused.

Code: the two ways of sharding are strategy objects (_zero_strategies.py: FlatPieces,
WholeParameters), the checkpoints are in _zero_checkpoint.py, the layout and stage 2's reduction in
_zero_buckets.py. A parameter whose storage is replaced after ZeRO was built (`p.data = ...`) is cut
again at the next step when it keeps its shape, dtype and device, refused otherwise.
"""
import contextlib
import sys
import warnings

import torch
import torch.distributed as dist

from .. import _core
from ._base import OptfuseError, _step_with_hooks, hooks_active
from ._zero_buckets import DEFAULT_BUCKET_MB, GradientReducer, plan_buckets, shard_ranges  # noqa: F401 (shard_ranges: API)
from ._zero_checkpoint import consolidated_state_dict, load_consolidated, load_sharded
from ._zero_strategies import FlatPieces, WholeParameters, strategy_for  # noqa: F401


class ZeRO(torch.optim.Optimizer):
    """ZeRO stage 1 (gradients from DDP) or stage 2 (ZeRO reduce-scatters the local gradients) around
    an optfuse.torch optimizer (a torch.optim one is fused with fuse()): the torch.optim.Optimizer
    API (param_groups are the wrapped optimizer's, so schedulers work), GradScaler, state dicts
    consolidated in the wrapped optimizer's format on every rank, sharded DCP checkpoints.
    How a rank's share is stepped is its strategy (`_strategy`, _zero_strategies.py): FlatPieces or
    WholeParameters."""

    def __init__(self, optimizer, process_group=None, stage=1, bucket_cap_mb=DEFAULT_BUCKET_MB, overlap=True):
        if stage not in (1, 2):
            raise OptfuseError(f"ZeRO: stage={stage!r} is not built (stage=1: gradients all-reduced by DDP; stage=2: "
                               "ZeRO reduce-scatters the local gradients itself)")
        if not dist.is_available() or not dist.is_initialized():
            raise OptfuseError("ZeRO: torch.distributed is not initialised (call dist.init_process_group first)")
        if any(g.get("state_dtype") is torch.int8 for g in getattr(optimizer, "param_groups", [])):
            # (the kernels' blocks would fit ZeRO's pieces, which start at chunk multiples, but the
            # checkpoint code gathers states as parameter-shaped tensors)
            raise OptfuseError("ZeRO: state_dtype=torch.int8 (q8 states) is not supported under ZeRO yet; use "
                               "torch.bfloat16 states, or step unsharded")
        self.stage = stage
        self._strategy = strategy_for(self, optimizer)
        optimizer = self._strategy.prepare(optimizer)
        self.optimizer = optimizer
        self.process_group = process_group
        if not bucket_cap_mb > 0:
            raise OptfuseError(f"ZeRO: bucket_cap_mb={bucket_cap_mb!r} must be positive")
        self.bucket_cap_mb = bucket_cap_mb
        self.overlap = bool(overlap)  # stage 2: reduce-scatter buckets during backward
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        super().__init__(optimizer.param_groups, optimizer.defaults)  # the same group dicts
        self._check_same_parameters_on_every_rank()
        self._plan_shards()
        self._strategy.take_state(optimizer)

    @property
    def _step_supports_amp_scaling(self):
        """True only when torch.amp.GradScaler.step asks (it then hands step() grad_scale and
        found_inf, which the kernel or the strategy applies) and the strategy takes them (not stage 1
        of whole parameters: GradScaler unscales those itself, as for torch.optim.Muon). Anyone else
        asking (Lightning refuses gradient clipping under bf16-mixed for optimizers that unscale
        internally) is told False, as FusedOptimizer tells them."""
        if not self._strategy.takes_grad_scale:
            return False
        caller = sys._getframe(1)
        return caller.f_code.co_name == "step" and isinstance(caller.f_locals.get("self"), torch.amp.GradScaler)

    # --- setup
    def _check_same_parameters_on_every_rank(self):
        """Every rank must shard the same parameters (groups, order, shapes, dtypes): otherwise the
        shards, and every collective after them, would disagree (a hang or corrupted parameters). One
        all_gather_object of a description; a mismatch fails on every rank, naming the first difference."""
        mine = [(i, tuple(p.shape), str(p.dtype)) for i, g in enumerate(self.param_groups) for p in g["params"]]
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.process_group)
        for r, theirs in enumerate(every):
            if theirs == mine:
                continue
            at = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            what = (f"parameter {at}: (group, shape, dtype) {mine[at] if at < len(mine) else 'none'} here, "
                    f"{theirs[at] if at < len(theirs) else 'none'} on rank {r}")
            raise OptfuseError(f"ZeRO: the ranks do not hold the same parameters ({len(mine)} here, {len(theirs)} on "
                               f"rank {r}; first difference at {what}); every rank must wrap the same model's "
                               "parameters in the same groups and order")

    def _plan_shards(self):
        params = self._params()
        from ._dtensor import is_dtensor
        for p in params:
            if is_dtensor(p):
                raise OptfuseError(f"ZeRO: the parameter of shape {tuple(p.shape)} is a DTensor (FSDP2 fully_shard), "
                                   "already sharded: use the optimizer itself, without ZeRO (each rank steps its shards)")
            if not p.is_contiguous():
                raise OptfuseError(f"ZeRO: parameters must be contiguous (shape {tuple(p.shape)}, strides {p.stride()})")
        devices = {p.device.type for p in params}
        if len(devices) > 1:
            raise OptfuseError(f"ZeRO: parameters on several device types ({sorted(devices)}); shard one model per device")
        self._chunk = _core.chunk_elements("cuda" if devices == {"cuda"} else "cpu")
        self._param_index = {id(p): i for i, p in enumerate(params)}
        # Buckets cut into one range per rank, and per rank a piece of every parameter in flat order
        # (empty where the rank owns none of it): so every rank's optimizer has the same engines in
        # the same order, and all of them take part in every exchange. Stage 1 reduces no gradients:
        # one bucket per dtype.
        cap = self.bucket_cap_mb * 2 ** 20 if self.stage == 2 else None
        self._buckets, self._pieces = plan_buckets(params, self.world, self._strategy.cut(), cap)
        self._mine = self._pieces[self.rank]
        self._piece_of_view = {id(pc.view): pc for pc in self._mine}
        # What each parameter's storage was when the pieces were cut (step() checks it: _check_storage)
        self._storage = [p.data_ptr() for p in params]
        self._shapes = [(tuple(p.shape), p.dtype, p.device) for p in params]
        # Per dtype: every rank's pieces of that dtype in flat order, and the length of the longest
        # rank's part (the row length of the padded [world, n] all-gather buffer).
        self._layout = {}
        for r, pieces in enumerate(self._pieces):
            for pc in pieces:
                self._layout.setdefault(pc.param.dtype, [[] for _ in range(self.world)])[r].append(pc)
        self._rows = {dtype: max(sum(pc.end - pc.begin for pc in pieces) for pieces in per_rank)
                      for dtype, per_rank in self._layout.items()}
        self._device = params[0].device if params else torch.device("cpu")
        self._clip_coef = None  # clip_grad_norm_'s coefficient, applied by the next step
        self._gather = {}  # dtype -> the all-gather buffer and its views (_gather_buffer)
        self._all_gather_into = None  # whether the backend has all_gather_into_tensor: found out on first use
        self._reducer = None
        self._reduced = False    # stage 2: the shard holds this step's reduction already
        self._clip_norms = []    # stage 2: clip_grad_norm_'s max_norm since the last step
        if self.stage == 2 and self.world > 1:
            # This rank's averaged gradients, bucket by bucket as backward produces them (hooks). (One
            # rank has nothing to reduce: its gradients are read where they are, as in stage 1.)
            self._reducer = GradientReducer(params, self._buckets, self.rank, self.world, self.process_group,
                                            self._device)
            self._reducer.overlap = self.overlap
        self._inner = self._strategy.make_inner([{k: v for k, v in g.items() if k != "params"}
                                                 for g in self.param_groups])

    def _check_storage(self):
        """A parameter whose storage was replaced since the pieces were cut (`p.data = p.data.clone()`,
        as Module._apply, weight loading and pruning do; one data_ptr() per parameter and step): the
        pieces, views of the old storage (which they keep alive, so no new storage can have its
        address), are cut again on the new one, states unchanged, so the step writes the parameter
        torch sees, as torch.optim would. A replacement of another shape, dtype or device, or one
        that is not contiguous, is refused before anything changes (the shards were planned for the
        old one)."""
        params = self._params()
        moved = [i for i, (p, ptr) in enumerate(zip(params, self._storage)) if p.data_ptr() != ptr]
        if not moved:
            return
        for i in moved:
            p = params[i]
            shape, dtype, device = self._shapes[i]
            if (tuple(p.shape), p.dtype, p.device) != (shape, dtype, device) or not p.is_contiguous():
                tg, k = self._position(i)
                raise OptfuseError(
                    f"ZeRO: parameter {k} of group {tg} was replaced by a tensor of shape {tuple(p.shape)}, {p.dtype} "
                    f"on {p.device}, strides {p.stride()} (p.data = ...) after ZeRO cut it into shards as shape "
                    f"{shape}, {dtype} on {device}, contiguous; ZeRO re-cuts a parameter whose storage moved only "
                    "when it keeps its shape, dtype, device and contiguity: build a new ZeRO after such a change "
                    "(zero.state_dict() first, load_state_dict() into the new one)")
        mine = []
        for i in moved:
            view = params[i].detach().view(-1)
            for r, pieces in enumerate(self._pieces):
                pc = pieces[i]
                if r == self.rank:
                    mine.append((pc, view[pc.begin:pc.end]))
                else:
                    pc.view = view[pc.begin:pc.end]
            self._storage[i] = params[i].data_ptr()
        self._strategy.repoint([pc for pc, _ in mine], [v for _, v in mine])
        for pc, new in mine:
            del self._piece_of_view[id(pc.view)]
            self._piece_of_view[id(new)] = pc
            if self._reducer is not None:  # (its averaged gradient: the same view of the shard)
                self._reducer.views[id(new)] = self._reducer.views.pop(id(pc.view))
                new.grad = pc.view.grad
            pc.view = new
        self._gather = {}  # (its views were of the old storage)

    def _position(self, i):
        """(group index, index within the group) of parameter i (flat order), for messages."""
        for tg, g in enumerate(self.param_groups):
            if i < len(g["params"]):
                return tg, i
            i -= len(g["params"])
        return -1, -1

    # --- torch.optim.Optimizer API
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        if hooks_active(self):
            return _step_with_hooks(self, closure, grad_scale=grad_scale, found_inf=found_inf)
        return self._step_impl(closure, grad_scale=grad_scale, found_inf=found_inf)

    step.hooked = True  # as FusedOptimizer.step: torch's wrapper only where hooks or the profiler need it

    @torch.no_grad()
    def _step_impl(self, closure=None, *, grad_scale=None, found_inf=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_storage()
        for outer, inner in zip(self.param_groups, self._inner.param_groups):  # schedulers write the outer ones
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if self._reducer is not None:
            self._finish_reduction(grad_scale, found_inf)
        if self.stage == 2:
            self._reduced = False
            self._clip_norms = []
            if found_inf is not None and self.world > 1:
                # GradScaler checked this rank's local gradients only: skip on every rank if any saw
                # an inf or NaN (a step that some ranks skip would hang the all-gather).
                found_inf = found_inf.clone()
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.process_group)
        # stage 1 (and stage 2 on one rank): the inner optimizer reads each piece's gradient from its
        # parameter's .grad, at the piece's offset (_grad_sources): nothing to do per piece here
        if self._strategy.step(grad_scale, found_inf):  # (False: skipped on every rank, nothing to gather)
            self._all_gather_params()
        if self._reducer is not None:
            # The full local gradients are spent: free them (this rank's averaged shard stays in
            # grad_shards() until the next step; one rank has no reducer: its gradients are that shard).
            _core._clear_grads(self._params())
        return loss

    def _finish_reduction(self, grad_scale, found_inf):
        """Stage 2, at the step: the shard must reduce the gradients as they are now. GradScaler's
        unscale_ (a step given found_inf but no grad_scale) rescales the local gradients in place
        without a trace on the tensors (their version counters do not move), so after it the buckets
        backward sent are sent again, and from then on the reduction waits for the step (overlap
        off). If clip_grad_norm_ or reduce_gradients already used what backward sent, the shard is
        reduced again, the clip coefficient recomputed from it, and a warning says so once."""
        r = self._reducer
        unscaled = found_inf is not None and grad_scale is None
        redo = unscaled and r.overlap and (not self._reduced or r.used_backward_sends)
        if unscaled:
            r.overlap = False
        if self._reduced and not redo:
            return
        if self._reduced:
            warnings.warn("ZeRO stage 2: clip_grad_norm_ (or reduce_gradients) used gradients that backward had sent "
                          "before GradScaler.unscale_ changed them; this step reduces them again and recomputes the "
                          "clip (the norm clip_grad_norm_ returned was of the scaled gradients). From now on the "
                          "gradients are reduced at the step; ZeRO(..., overlap=False) avoids this with a GradScaler.",
                          stacklevel=3)
        # A GradScaler that did not unscale (it passes grad_scale) only checked the gradients in place:
        # what backward sent stays right.
        r.finish(trust_versions=found_inf is not None and grad_scale is not None, resend=redo)
        if self._reduced and self._clip_norms:
            with torch.no_grad():
                total = self._shard_norm()
                self._clip_coef = None
                for max_norm in self._clip_norms:
                    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
                    self._clip_coef = coef if self._clip_coef is None else self._clip_coef * coef

    def _shard_norm(self):
        """Stage 2: the 2-norm of the averaged gradients over every rank's shard (float64 sums, one
        all_reduce), as float32."""
        local = torch.zeros((), dtype=torch.float64, device=self._device)
        for t in self._reducer.shards.values():
            if t.numel():
                local += t.double().square().sum()
        if self.world > 1:
            dist.all_reduce(local, group=self.process_group)
        return local.sqrt().to(torch.float32)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ for the sharded gradients: returns the total 2-norm of every
        rank's gradients (each rank sums its shard in float64, then one all_reduce of that scalar) and
        folds the clip into the next step() instead of rescaling the gradients now: the kernel, which
        reads the gradients anyway, multiplies them by the coefficient (as 1 / grad_scale), so the
        clip costs no pass over memory. Call it after backward (and after GradScaler.unscale_(zero),
        if a scaler is used) and before step(); calling it twice before a step applies both clips.
        The norm's summation order differs from torch's, so the coefficient agrees to rounding."""
        if float(norm_type) != 2.0:
            raise OptfuseError(f"ZeRO.clip_grad_norm_: norm_type={norm_type!r}; only the 2-norm is built")
        with torch.no_grad():
            if self._reducer is not None:
                if not self._reduced:
                    self._reducer.finish()
                    self._reduced = True
                self._clip_norms.append(max_norm)
                total = self._shard_norm()
            else:
                local = torch.zeros((), dtype=torch.float64, device=self._device)
                for pc in self._mine:
                    if pc.param.grad is not None and pc.end > pc.begin:
                        local += pc.param.grad.reshape(-1)[pc.begin:pc.end].double().square().sum()
                if self.world > 1:
                    dist.all_reduce(local, group=self.process_group)
                total = local.sqrt().to(torch.float32)
            if error_if_nonfinite and not bool(torch.isfinite(total)):  # a host sync, as in torch
                raise RuntimeError("The total norm of order 2.0 for gradients is non-finite, so it cannot be clipped")
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            self._clip_coef = coef if self._clip_coef is None else self._clip_coef * coef
        return total

    def reduce_gradients(self):
        """Stage 2: reduce-scatters the local gradients now (step() does it when this was not called
        since the last step), and makes every rank's local gradients agree on finiteness: if any
        rank's averaged shard holds an inf or NaN, a NaN is written into this rank's local
        gradients. Call it between backward and ``scaler.step(zero)`` when a GradScaler's local
        inf check could differ between ranks (its scale would then differ too)."""
        if self.stage != 2:
            raise OptfuseError("ZeRO.reduce_gradients: only stage=2 reduces gradients (stage=1 takes DDP's)")
        with torch.no_grad():
            if self._reducer is not None:
                self._reducer.finish()
            bad = torch.zeros(1, dtype=torch.float32, device=self._device)
            for buf in self.grad_shards().values():
                if buf.numel():
                    bad = torch.maximum(bad, (~torch.isfinite(buf)).any().to(torch.float32).reshape(1))
            if self.world > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.process_group)
            if bad.item():
                g = next((p.grad for p in self._params() if p.grad is not None and p.grad.numel()), None)
                if g is not None:
                    g.view(-1)[0] = float("nan")
        self._reduced = True

    def grad_shards(self):
        """Stage 2: {dtype: this rank's averaged gradients} (flat, in the order of its shard, padded per
        bucket; valid from reduce_gradients() or step() until the next reduction). On one rank, whose
        gradients are stepped where they are, a flat copy of them made on request."""
        if self.stage != 2:
            raise OptfuseError("ZeRO.grad_shards: only stage=2 keeps averaged gradient shards")
        if self._reducer is not None:
            return dict(self._reducer.shards)
        out = {}
        for dtype, per_rank in self._layout.items():
            parts = [pc.param.grad.reshape(-1)[pc.begin:pc.end] if pc.param.grad is not None
                     else torch.zeros(pc.end - pc.begin, dtype=dtype, device=self._device) for pc in per_rank[self.rank]]
            out[dtype] = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=self._device)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Stage 2, as DistributedDataParallel.no_sync: backward passes inside only accumulate the local
        gradients (no bucket is sent); the next backward outside it (or the step) reduces the sum.
        Without it, each backward sends its buckets and the step sends again those whose gradients a
        later backward changed: correct, at the cost of the traffic."""
        if self.stage != 2:
            raise OptfuseError("ZeRO.no_sync: only stage=2 reduces gradients (stage=1 takes DDP's: use DDP's no_sync)")
        if self._reducer is None:  # one rank: nothing is sent anyway
            yield
            return
        old, self._reducer.no_sync = self._reducer.no_sync, True
        try:
            yield
        finally:
            self._reducer.no_sync = old

    @property
    def _reduce_scatter(self):
        """Stage 2: whether the backend has reduce_scatter_tensor (None until the first reduction; False:
        the all_reduce fallback)."""
        return self._reducer.reduce_scatter if self._reducer is not None else None

    @_reduce_scatter.setter
    def _reduce_scatter(self, value):
        if self._reducer is not None:
            self._reducer.reduce_scatter = value

    def _all_gather_params(self):
        """Every rank's pieces to every rank: one all_gather per dtype of equal-length (padded) rows of a
        [world, n] buffer kept across steps, and one multi-tensor copy in and one out (views made once)."""
        if self.world == 1:
            return
        for dtype in self._layout:
            if self._rows[dtype] == 0:
                continue
            gather, mine, theirs = self._gather_buffer(dtype)
            row = gather[self.rank]
            if mine[0]:
                torch._foreach_copy_(mine[0], mine[1])  # this rank's pieces into its row
            if self._all_gather_into is not False:
                try:
                    dist.all_gather_into_tensor(gather.view(-1), row, group=self.process_group)
                    self._all_gather_into = True
                except (RuntimeError, NotImplementedError, AttributeError, ValueError):
                    if self._all_gather_into:
                        raise
                    self._all_gather_into = False  # a backend without it (older gloo): the list form
            if self._all_gather_into is False:
                dist.all_gather(list(gather.unbind(0)), row.clone(), group=self.process_group)
            if theirs[0]:
                torch._foreach_copy_(theirs[0], theirs[1])  # the other ranks' pieces into the parameters

    def _gather_buffer(self, dtype):
        """(the [world, n] all-gather buffer, (this rank's row views, its pieces), (the pieces of other
        ranks, their row views)), made once per dtype."""
        cached = self._gather.get(dtype)
        if cached is None:
            gather = torch.zeros(self.world, self._rows[dtype], dtype=dtype, device=self._device)
            mine, theirs = ([], []), ([], [])
            for r, pieces in enumerate(self._layout[dtype]):
                at = 0
                for pc in pieces:
                    k = pc.end - pc.begin
                    if k:
                        if r == self.rank:
                            mine[0].append(gather[r, at:at + k])
                            mine[1].append(pc.view)
                        else:
                            theirs[0].append(pc.view)
                            theirs[1].append(gather[r, at:at + k])
                    at += k
            cached = self._gather[dtype] = (gather, mine, theirs)
        return cached

    # --- checkpoints (_zero_checkpoint.py)
    def state_dict(self):
        """The unsharded state dict in the wrapped optimizer's (torch's) format, on every rank. The
        pieces travel as CPU tensors through all_gather_object (simple, not fast: for checkpoints)."""
        return consolidated_state_dict(self)

    def load_state_dict(self, state_dict):
        """Loads an unsharded state dict (any world size saved it, or an unsharded optimizer)."""
        load_consolidated(self, state_dict)

    def sharded_state_dict(self, like=None):
        """This rank's optimizer state for ``torch.distributed.checkpoint`` (DCP), without gathering:
        a flat dict with

        * ``"state.<i>.<key>"`` for parameter i (param_groups order) and a per-element state
          (exp_avg, a master copy...): a ``ShardedTensor`` of the parameter's flattened size
          (``[numel]``, the state's dtype) whose shards are every rank's pieces (1-D, at the pieces'
          flat offsets); this rank's shard is its piece's state itself (no copy);
        * ``"state.<i>.<key>"`` for per-parameter values (step counts, ASGD's eta and mu): the value,
          the same on every rank (DCP writes one copy);
        * ``"param_groups"``: the groups' options without "params" (lr, betas, timm's group step...).

        ``dcp.save(zero.sharded_state_dict(), checkpoint_id=path)`` on N ranks. To load on M ranks
        (any M), pass the checkpoint's metadata as ``like``: the dict then has every entry of the
        checkpoint, with this ZeRO's own pieces as the shards to read into (DCP reads each piece
        from whichever saved shards overlap it)::

            sd = zero.sharded_state_dict(like=dcp.FileSystemReader(path).read_metadata())
            dcp.load(sd, checkpoint_id=path)
            zero.load_sharded_state_dict(sd)

        Muon, MuonWithAuxAdam and Adafactor (each rank owns whole parameters): ``"state.<i>.<key>"`` is the
        owner's state itself, in the parameter's shape, in the dict of its owner only (DCP writes a
        key that one rank holds from that rank); loading, each rank asks for the states of the
        parameters it owns now, so any world size reads any other's checkpoint.
        """
        return self._strategy.sharded_state_dict(like)

    def load_sharded_state_dict(self, state_dict):
        """Installs a dict that ``dcp.load`` filled (see sharded_state_dict(like=...)); saved by any
        world size, in this ZeRO's shards."""
        load_sharded(self, state_dict)

    # --- helpers
    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def local_state_numel(self):
        """Elements of per-element optimizer state this rank holds (not step counts or other scalars):
        about 1/N of the unsharded optimizer's."""
        return sum(v.numel() for st in self._inner.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim() > 0)
