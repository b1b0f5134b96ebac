"""ZeRO's shard layout (buckets cut into per-rank ranges, pieces) and stage 2's gradient
reduce-scatter, bucket by bucket, as backward produces the gradients.

Layout. The parameters of one dtype, in param_groups order, are grouped into *buckets* of
consecutive parameters of about `cap` bytes (a larger parameter is a bucket of its own; stage 1,
which reduces no gradients, has one bucket per dtype). Each bucket is one flat index space cut into
`world` ranges by `shard_ranges`, at a tensor's start or a multiple of the backend's chunk into it,
so every piece's chunks are its tensor's chunks and partial sums combine as unsharded. Rank r owns
range r of every bucket; its part of a parameter is a *piece* (a flat view). Every rank has a piece
of every parameter (most of them empty), so every rank's optimizer has the same engines in the same
order.

Stage 2 (GradientReducer). Each bucket has a [world, row] send buffer (row: its longest range) whose
row r holds rank r's pieces of the local gradients, and reduce-scatters into this rank's slice of
a flat averaged-gradient buffer per dtype (`shards`; the pieces' gradients are views of it). A
post-accumulate-grad hook on every parameter counts the bucket's gradients in; when a bucket is
complete and every bucket before it in the launch order (reverse flat order, the order backward
produces gradients) was launched, its gradients are copied into the send buffer (one multi-tensor
copy) and its reduce-scatter is started asynchronously, so the communication overlaps the rest of
backward. `finish()` (at the step) waits for them, launches what backward did not complete
(unused parameters, gradients set by hand), and launches again any bucket whose gradients changed
after it was sent (a second backward accumulating, or a hand edit: the tensor or its version
counter differs; GradScaler.unscale_, which leaves no trace, is handled by ZeRO.step), so the shard
reduces the gradients as they are at the step.
Which buckets are launched again and which parameters have a gradient is agreed by every rank in
one small all_reduce, and every collective is issued in the same order on every rank. (On one rank
there is nothing to reduce: ZeRO builds no reducer and steps the gradients where they are.)"""
import bisect
import weakref

import torch
import torch.distributed as dist

from .. import _core

OptfuseError = _core.OptfuseError

DEFAULT_BUCKET_MB = 25  # as DistributedDataParallel's bucket_cap_mb

# id(parameter) -> (weak reference to it, the handle of its post-accumulate-grad hook): a parameter is
# reduced during backward by the newest stage-2 ZeRO built over it (an older one, e.g. replaced after
# loading a checkpoint, is unhooked and reduces at its step only), so no stray collective is issued.
# (Keyed by id: tensors compare elementwise, so they cannot be dictionary keys.)
_HOOKS = {}


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


class Piece:
    __slots__ = ("param", "begin", "end", "view")

    def __init__(self, param, begin, end):
        self.param, self.begin, self.end = param, begin, end
        self.view = param.detach().view(-1)[begin:end]  # shares the parameter's memory


class Bucket:
    """Consecutive parameters of one dtype, cut into one range per rank."""
    __slots__ = ("dtype", "params", "ranges", "row", "offset", "pieces", "ready", "launched", "seen", "work",
                 "send", "slots", "whole", "cut", "expected")

    def __init__(self, dtype):
        self.dtype, self.params = dtype, []
        self.ranges, self.row, self.offset = None, 0, 0
        self.pieces = None    # [rank] -> its pieces of this bucket's parameters, in flat order
        self.ready = set()    # ids of parameters whose gradient backward has produced since the last step
        self.expected = 0     # how many of its parameters backward can produce a gradient for (requires_grad)
        self.launched = False
        self.seen = None      # [(gradient, its version)] as copied into the send buffer
        self.work = None      # the asynchronous reduce-scatter (None: done, or nothing to wait for)
        self.send = self.slots = None  # the send buffer and its views (GradientReducer._send_buffer)
        self.whole = self.cut = None     # the slots split: whole parameters (indices, views), cut pieces


def plan_buckets(params, world, chunk, cap_bytes):
    """(buckets in flat order, pieces[rank][parameter index]) for `params` (flat order); cap_bytes None:
    one bucket per dtype."""
    buckets, open_ = [], {}
    for p in params:
        b = open_.get(p.dtype)
        size = sum(q.numel() for q in b.params) if b is not None else 0
        if b is None or (cap_bytes is not None and size and (size + p.numel()) * p.element_size() > cap_bytes):
            b = open_[p.dtype] = Bucket(p.dtype)
            buckets.append(b)
        b.params.append(p)
    index = {id(p): i for i, p in enumerate(params)}
    pieces = [[None] * len(params) for _ in range(world)]
    offsets = {}
    for b in buckets:
        b.ranges = shard_ranges([p.numel() for p in b.params], world, chunk)
        b.row = max(hi - lo for lo, hi in b.ranges)
        b.offset = offsets.get(b.dtype, 0)  # where this bucket's row starts in the dtype's shard buffer
        offsets[b.dtype] = b.offset + b.row
        b.pieces = [[] for _ in range(world)]
        start = 0
        for p in b.params:
            end = start + p.numel()
            for r, (lo, hi) in enumerate(b.ranges):
                a, z = max(lo, start), min(hi, end)
                pc = Piece(p, a - start, z - start) if a < z else Piece(p, 0, 0)
                pieces[r][index[id(p)]] = pc
                b.pieces[r].append(pc)
            start = end
    return buckets, pieces


class GradientReducer:
    """Stage 2: the local gradients of every rank into this rank's averaged shard, bucket by bucket,
    started by backward (see the module's docstring)."""

    def __init__(self, params, buckets, rank, world, group, device):
        self.params, self.buckets = params, buckets
        self.rank, self.world, self.group, self.device = rank, world, group, device
        self.order = list(reversed(buckets))  # launch order: backward produces the last parameters first
        self.next = 0                           # position in `order` of the next bucket to launch
        self.bucket_of = {id(p): b for b in buckets for p in b.params}
        self.index = {id(p): i for i, p in enumerate(params)}
        self.reduce_scatter = None  # whether the backend has reduce_scatter_tensor: found out on first use
        self.no_sync = False
        self.overlap = True  # send buckets during backward (ZeRO turns it off after GradScaler.unscale_)
        self.used_backward_sends = False  # the last finish() kept buckets that backward sent
        self.present = None  # which parameters had a gradient on some rank at the last finish()
        rows = {}
        for b in buckets:
            rows[b.dtype] = b.offset + b.row
        self.shards = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in rows.items()}
        self.views = {}  # id(piece.view) -> its view of the shard buffer: the piece's gradient
        for b in buckets:
            at = b.offset
            for pc in b.pieces[rank]:
                self.views[id(pc.view)] = self.shards[b.dtype][at:at + pc.end - pc.begin]
                at += pc.end - pc.begin
        me = weakref.ref(self)  # the hooks must not keep a replaced reducer alive

        def produced(p):
            reducer = me()
            if reducer is not None:
                reducer._produced(p)

        for b in buckets:
            b.expected = sum(p.requires_grad for p in b.params)
        for key in [k for k, (ref, _) in _HOOKS.items() if ref() is None]:
            del _HOOKS[key]  # parameters that are gone
        for p in params:
            if p.requires_grad:
                old = _HOOKS.get(id(p))
                if old is not None and old[0]() is p:
                    old[1].remove()
                _HOOKS[id(p)] = (weakref.ref(p), p.register_post_accumulate_grad_hook(produced))

    # --- during backward
    def _produced(self, p):
        if self.no_sync or not self.overlap:
            return
        b = self.bucket_of.get(id(p))
        if b is None or b.launched:
            return  # launched already: a later backward changed its gradients; finish() sends it again
        b.ready.add(id(p))
        while self.next < len(self.order):
            nb = self.order[self.next]
            if nb.launched or len(nb.ready) < nb.expected:
                break
            with torch.no_grad():
                self._launch(nb, track=True)
            self.next += 1

    def _launch(self, b, track=False):
        """Copies every rank's pieces of the local gradients into b's send rows (zeros where a
        parameter has no gradient here) and starts the reduce-scatter into this rank's shard.
        track: remember the gradients sent (tensor, version), to find at the step what changed."""
        send, slots = self._send_buffer(b)
        grads = [p.grad for p in b.params]
        zero = []
        if any(g is None for g in grads):
            dst, src = [], []
            for k, pc, view, whole in slots:
                g = grads[k]
                if g is None:
                    zero.append(view)
                    continue
                dst.append(view)
                src.append(g if whole else self._cut(pc, g))
        else:  # the usual case, with no loop over the slots: whole parameters as they are, then the cut pieces
            index, views = b.whole
            dst = views + [view for _, _, view in b.cut] if b.cut else views
            src = grads if len(index) == len(grads) else [grads[k] for k in index]
            if b.cut:
                src = src + [self._cut(pc, grads[k]) for k, pc, _ in b.cut]
        if dst:
            try:
                torch._foreach_copy_(dst, src)
            except RuntimeError:
                for g, p in zip(grads, b.params):
                    if g is not None and g.is_sparse:
                        raise grad_error(p, g) from None
                raise
        if zero:
            torch._foreach_zero_(zero)
        b.seen = [None if g is None else (g, g._version) for g in grads] if track else None
        b.launched = True
        b.work = None
        if self.world > 1:
            b.work = self._reduce_scatter(self.shards[b.dtype][b.offset:b.offset + b.row], send)

    def _send_buffer(self, b):
        """b's [world, row] send buffer (on one rank, this rank's slice of the shard buffer itself), kept
        across steps with a view per piece (shaped as its parameter where the piece is all of it):
        a step makes no view per piece. Padding stays zero."""
        if b.send is None:
            if self.world == 1:
                b.send = self.shards[b.dtype][b.offset:b.offset + b.row].view(1, b.row)
            else:
                b.send = torch.zeros(self.world, b.row, dtype=b.dtype, device=self.device)
            local = {id(p): k for k, p in enumerate(b.params)}
            b.slots = []  # (index in b.params, piece, its view of the buffer, whether it is the whole parameter)
            for r, pieces in enumerate(b.pieces):
                at = 0
                for pc in pieces:
                    n = pc.end - pc.begin
                    if n:
                        view, whole = b.send[r, at:at + n], n == pc.param.numel()
                        b.slots.append((local[id(pc.param)], pc, view.view(pc.param.shape) if whole else view, whole))
                    at += n
            # Each parameter is either whole in one rank's row or cut into pieces of several rows.
            whole = sorted(((k, view) for k, _, view, w in b.slots if w), key=lambda kv: kv[0])
            b.whole = ([k for k, _ in whole], [view for _, view in whole])
            b.cut = [(k, pc, view) for k, pc, view, w in b.slots if not w]
        return b.send, b.slots

    @staticmethod
    def _cut(pc, g):
        if g.is_sparse or not g.is_contiguous():
            raise grad_error(pc.param, g)
        return g.view(-1)[pc.begin:pc.end]

    def _reduce_scatter(self, out, send):
        """Starts out = this rank's row of the sum of every rank's `send` ([world, n]); returns the work
        and what to do when it is done."""
        if self.reduce_scatter is None:
            # NCCL has reduce_scatter_tensor; gloo has it only in recent torch releases (2.15 has it).
            # Where the backend lacks it, all_reduce the whole buffer and keep this rank's row: the
            # same sums (gloo computes its reduce_scatter as the matching slice of an all_reduce of
            # the same buffer), at twice the traffic. Every rank takes the same branch (one backend).
            try:
                work = dist.reduce_scatter_tensor(out, send.view(-1), group=self.group, async_op=True)
                self.reduce_scatter = True
                return (work, None)
            except (RuntimeError, NotImplementedError, AttributeError, ValueError):
                self.reduce_scatter = False
        if self.reduce_scatter:
            return (dist.reduce_scatter_tensor(out, send.view(-1), group=self.group, async_op=True), None)
        return (dist.all_reduce(send, group=self.group, async_op=True), (out, send[self.rank]))

    @staticmethod
    def _wait(b):
        if b.work is not None:
            work, copy = b.work
            work.wait()
            if copy is not None:
                copy[0].copy_(copy[1])
            b.work = None

    # --- at the step
    def finish(self, trust_versions=False, resend=False):
        """Makes the shards the averaged gradients as they are now (see the module's docstring).
        trust_versions: gradients changed in place since they were sent only by a check that does not
        change values (GradScaler's inf check before an unscaled step): not sent again. resend: every
        bucket is sent again (its gradients changed without a trace: GradScaler.unscale_)."""
        for b in self.order:
            self._wait(b)
        grads = [p.grad for p in self.params]
        present = [g is not None for g in grads]
        stale = [b.launched and (resend or (not trust_versions and self._changed(b))) for b in self.buckets]
        if self.world > 1:
            flags = torch.tensor(present + stale, dtype=torch.int32, device=self.device)
            dist.all_reduce(flags, group=self.group)
            flags = [bool(f) for f in flags.tolist()]
            present, stale = flags[:len(present)], flags[len(present):]
        stale_of = {id(b): s for b, s in zip(self.buckets, stale)}
        self.used_backward_sends = any(b.launched and not stale_of[id(b)] for b in self.buckets)
        for b in self.order:  # in launch order on every rank
            if not b.launched or stale_of[id(b)]:
                self._launch(b)
                self._wait(b)
        if self.world > 1:
            for shard in self.shards.values():
                shard.div_(self.world)  # the sum, then the division: DDP's mean
        if present != self.present:  # a piece's .grad: its view of the shard, or None (not stepped)
            for b in self.buckets:
                for pc in b.pieces[self.rank]:
                    pc.view.grad = self.views[id(pc.view)] if present[self.index[id(pc.param)]] else None
            self.present = present
        for b in self.buckets:
            b.ready.clear()
            b.launched = False
            b.seen = None
        self.next = 0

    @staticmethod
    def _changed(b):
        for p, seen in zip(b.params, b.seen):
            g = p.grad
            if seen is None:
                if g is not None:
                    return True
            elif g is not seen[0] or g._version != seen[1]:
                return True
        return False


def grad_error(p, g):
    return OptfuseError(f"ZeRO stage 2: gradients must be dense, and contiguous where a shard cuts the parameter "
                        f"(parameter {tuple(p.shape)} {p.dtype}, gradient {tuple(g.shape)} strides {g.stride()}"
                        f"{', sparse' if g.is_sparse else ''})")
