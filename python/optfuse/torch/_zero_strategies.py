"""ZeRO's two sharding strategies (distributed.py): how a rank's share of the parameters becomes the
optimizer it steps, where their state lives, and how a step runs.

  FlatPieces       every element-wise optimizer: each bucket is cut at tensor starts or chunk
                   boundaries, a rank steps flat views of its parameters' parts (pieces) with one
                   optimizer of the wrapped class over them; states are sliced per piece.
  WholeParameters  Muon, MuonWithAuxAdam, Adafactor (Newton-Schulz, row and column means need whole
                   matrices): cut at tensor starts only, a rank steps the parameters it owns, whole,
                   with the wrapped class; states stay whole.

Their common interface (what ZeRO calls):
  prepare(optimizer)        -> the optimizer to wrap (FlatPieces fuses a torch.optim one)
  cut()                     -> where buckets may be cut (elements: a chunk, or past the model's end)
  make_inner(groups)        -> the optimizer over this rank's share (groups: options without params)
  take_state(optimizer)     slices the full state of `optimizer` into the inner one, then drops it
  step(grad_scale, found_inf) -> whether it stepped (after ZeRO's stage-2 reduction; ZeRO then
                            all-gathers the parameters)
  write_steps()             the inner optimizer's step counts into its state (for checkpoints)
  state_of(piece)           the inner state held for `piece` (None: none here)
  forget_tables()           the inner optimizer's next step rebuilds its tables from its state
  repoint(pieces, views)    this rank's pieces moved to new views (a parameter's storage was replaced)
  takes_grad_scale          whether step() takes GradScaler's grad_scale / found_inf
The checkpoint half of each (sharded DCP dicts) is in _zero_checkpoint.py."""
import torch

from .. import _core
from ._base import FusedOptimizer, OptfuseError
from ._binding import _unchecked, _with_unscale
from ._fused import fuse
from ._group_values import _host_view
from ._zero_checkpoint import FlatPiecesCheckpoint, WholeParametersCheckpoint

_SCALAR_KEYS = {}  # (class, structure key, features) -> the state keys that hold one number per parameter


def strategy_for(zero, optimizer):
    """The strategy that shards `optimizer` (the one isinstance test of the whole-matrix classes)."""
    from ._adafactor import Adafactor
    from ._muon import Muon, MuonWithAuxAdam
    if isinstance(optimizer, (Muon, MuonWithAuxAdam, Adafactor)):
        return WholeParameters(zero)
    return FlatPieces(zero)


def _retire(optimizer):
    """The wrapped optimizer after its state moved into ZeRO's inner one: no tables that could write
    stale counts into a state."""
    optimizer._forget_tables()
    optimizer._engines = {}


class FlatPieces(FlatPiecesCheckpoint):
    """Pieces cut across parameters (flat views), stepped by one optimizer of the wrapped class."""

    takes_grad_scale = True

    def __init__(self, zero):
        self.zero = zero
        self.inner = None

    def prepare(self, optimizer):
        return optimizer if isinstance(optimizer, FusedOptimizer) else fuse(optimizer)

    def cut(self):
        return self.zero._chunk

    def make_inner(self, groups):
        z = self.zero
        mine = {id(pc.param): pc for pc in z._mine}
        inner_groups = [dict(options, params=[mine[id(p)].view for p in g["params"]])
                        for options, g in zip(groups, z.param_groups)]
        cls = type(z.optimizer)
        inner = cls.__new__(cls)
        # The class's own settings (a Fused optimizer's chain and names, ...); the base __init__ then
        # makes fresh groups, state and engines.
        inner.__dict__.update(z.optimizer.__dict__)
        FusedOptimizer.__init__(inner, inner_groups, dict(z.optimizer.defaults))
        inner._graph_step = False  # its parameters are views re-pointed each step: the eager step
        # Stochastic rounding draws for a piece what the unsharded optimizer draws for those elements.
        inner._rng_streams = {id(pc.view): (z._param_index[id(pc.param)] + 1, pc.begin) for pc in z._mine}
        inner._on_engine_built = self._set_exchange
        if z._reducer is None:  # each piece's gradient read from its parameter's .grad, at its offset
            inner._grad_sources = {id(pc.view): (pc.param, pc.begin) for pc in z._mine}
        self.inner = inner
        return inner

    def _set_exchange(self, engine):
        """After the inner optimizer built an engine over its pieces: if its chain has reductions, make
        its steps all-gather the per-chunk partials of every rank into the global chunk order. The
        global chunks are the unsharded engine's: every chunk of every parameter in this engine's
        table (every rank's engine lists the same parameters, in the same order)."""
        z = self.zero
        if engine.core.plan.matrix:  # (its pieces are flat: it would step them as vectors, silently)
            raise OptfuseError(f"ZeRO: {type(z.optimizer).__name__}'s rule chain has row or column values (a matrix "
                               "plan), whose shards would cut matrices; ZeRO shards optfuse.torch.Adafactor, Muon and "
                               "MuonWithAuxAdam by whole parameters, other such chains are not built")
        if not engine.core.plan.reduction_scopes or z.world == 1:
            return  # (one rank: its partials are all of them, and the step stays capturable)
        from ._partials import gather_exchange
        chunk = z._chunk
        if engine.core.chunk_elements != chunk:
            raise OptfuseError(f"ZeRO: the {engine.backend} backend cuts {engine.core.chunk_elements}-element chunks, "
                               f"the shards were cut at {chunk}")
        pieces = [z._piece_of_view[id(v)] for v in engine.params]
        firsts, counts, global_chunks = [], [], 0
        first_of = {}
        for pc in pieces:
            n = -(-pc.param.numel() // chunk)
            first_of[id(pc.param)] = global_chunks
            firsts.append(global_chunks)
            counts.append(n)
            global_chunks += n
        # Where each global chunk comes from: rank r's local partials list its pieces of these
        # parameters in the same (table) order, and a piece's chunks are consecutive chunks of its
        # parameter (cuts fall on chunk boundaries). source[j]: column of the gathered [world x width].
        runs = []  # (rank, first local chunk, first global chunk, count)
        for r, rank_pieces in enumerate(z._pieces):
            at = 0
            for pc in rank_pieces:
                if id(pc.param) in first_of and pc.end > pc.begin:
                    n = -(-(pc.end - pc.begin) // chunk)
                    runs.append((r, at, first_of[id(pc.param)] + pc.begin // chunk, n))
                    at += n
        width = max([1] + [sum(n for rr, _, _, n in runs if rr == r) for r in range(z.world)])
        source = [0] * global_chunks
        for r, at, first, n in runs:
            source[first:first + n] = range(r * width + at, r * width + at + n)
        mine = sum(n for r, _, _, n in runs if r == z.rank)
        engine.core._set_exchange(global_chunks, firsts, counts,
                                  gather_exchange(source, width, mine, z.world, z.process_group))

    def take_state(self, optimizer):
        """Per-element states sliced at each piece; per-parameter values (step counts, ASGD's eta and
        mu, NAdam's mu_product) copied whole. Told apart by shape, except for a 0-dim parameter,
        whose states all have its shape: there by the chain's own list of per-parameter values."""
        optimizer._sync_steps(write_state=True)  # (it may have stepped: its counts may be newer than its state's)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        for pc in self.zero._mine:
            full = optimizer.state.get(pc.param)
            if not full:
                continue
            scalars = _scalar_keys(optimizer, group_of[id(pc.param)]) if pc.param.dim() == 0 else ()
            st = self.inner.state[pc.view]
            for k, v in full.items():
                if torch.is_tensor(v) and v.shape == pc.param.shape and k not in scalars:
                    st[k] = v.detach().reshape(-1)[pc.begin:pc.end].clone()
                else:
                    st[k] = v.clone() if torch.is_tensor(v) else v
        optimizer.state.clear()
        _retire(optimizer)
        self.forget_tables()

    def step(self, grad_scale, found_inf):
        z = self.zero
        if z._clip_coef is not None:  # clip_grad_norm_ since the last step: g * coef = g / (1 / coef)
            scale = torch.as_tensor(1.0 if grad_scale is None else grad_scale, dtype=torch.float32, device=z._device)
            grad_scale = (scale / z._clip_coef).reshape(())
            z._clip_coef = None
        self.inner.step(grad_scale=grad_scale, found_inf=found_inf)
        return True  # (a step the kernel skips on found_inf is skipped on every rank alike: gathered anyway)

    def write_steps(self):
        self.inner._sync_steps(write_state=True)

    def state_of(self, pc):
        return self.inner.state.get(pc.view)

    def forget_tables(self):
        self.inner._forget_tables()

    def repoint(self, pieces, views):
        inner = self.inner
        self.write_steps()  # the counts the engines keep, into the states that move
        old_of = {}
        for pc, new in zip(pieces, views):
            old = pc.view
            old_of[id(old)] = new
            st = inner.state.pop(old, None)
            if st is not None:
                inner.state[new] = st
            private = inner._private_states.pop(old, None)
            if private is not None:
                inner._private_states[new] = private
            for table in (inner._rng_streams, inner.__dict__.get("_grad_sources")):
                if table is not None and id(old) in table:
                    table[id(new)] = table.pop(id(old))
        for g in inner.param_groups:
            g["params"] = [old_of.get(id(q), q) for q in g["params"]]
        self.forget_tables()


class WholeParameters(WholeParametersCheckpoint):
    """Whole parameters per rank, stepped by the wrapped class itself (Muon, MuonWithAuxAdam,
    Adafactor). Stage 1 takes GradScaler's standard path (it unscales the gradients, then calls
    step()), as torch.optim.Muon does: every rank has the same (DDP-averaged) gradients, so the same
    verdict. Stage 2 takes grad_scale / found_inf: the local gradients differ, and the ranks must
    agree on skipping (found_inf is max-reduced by ZeRO before step())."""

    def __init__(self, zero):
        self.zero = zero
        self.inner = None
        self.takes_grad_scale = zero.stage == 2

    def prepare(self, optimizer):
        return optimizer

    def cut(self):
        # cuts at tensor starts only (a "chunk" longer than the model): every matrix is whole on the
        # rank that owns it
        return sum(p.numel() for g in self.zero.param_groups for p in g["params"]) + 1

    def _owned(self):
        return [pc for pc in self.zero._mine if pc.end > pc.begin]

    def make_inner(self, groups):
        z = self.zero
        owned = {id(pc.param) for pc in self._owned()}
        self.inner = type(z.optimizer)([dict(options, params=[p for p in g["params"] if id(p) in owned])
                                        for options, g in zip(groups, z.param_groups)])
        return self.inner

    def _parts(self, optimizer):
        """(its Muon or None, its FusedOptimizers): Muon (Muon, []), MuonWithAuxAdam (its Muon, [its
        AdamW]), Adafactor (None, [itself])."""
        from ._muon import Muon, MuonWithAuxAdam
        if isinstance(optimizer, Muon):
            return optimizer, []
        if isinstance(optimizer, MuonWithAuxAdam):
            return optimizer._muon, [optimizer._adam] if optimizer._adam is not None else []
        return None, [optimizer]

    def take_state(self, optimizer):
        muon, fused = self._parts(optimizer)
        for f in fused:
            f._sync_steps(write_state=True)
        for pc in self._owned():
            if optimizer.state.get(pc.param):
                self.inner.state[pc.param] = {k: v.clone() if torch.is_tensor(v) else v
                                              for k, v in optimizer.state[pc.param].items()}
        optimizer.state.clear()
        # retired: it holds no state now, and no tables that could write stale counts into a state
        if muon is not None:
            muon._init_private()
        for f in fused:
            _retire(f)
        self.forget_tables()

    def step(self, grad_scale, found_inf):
        """The owned parameters stepped by the wrapped class. Stage 2: each owned matrix's gradient is
        its averaged shard (the reducer's view, in the matrix's shape); an inf (found_inf, agreed by
        every rank) skips the step on every rank, else the gradients are unscaled first."""
        z = self.zero
        if not self.takes_grad_scale and (grad_scale is not None or found_inf is not None):
            raise OptfuseError(f"ZeRO of {type(z.optimizer).__name__}: grad_scale / found_inf are not taken (as "
                               "torch.optim.Muon: GradScaler unscales the gradients itself and skips step() on an inf)")
        owned = self._owned()
        if z._reducer is not None:
            for pc in owned:  # (the piece's .grad is None where no rank had a gradient)
                g = pc.view.grad
                pc.param.grad = None if g is None else g.view(pc.param.shape)
        if found_inf is not None and float(found_inf) != 0.0:
            z._clip_coef = None
            return False  # skipped on every rank (found_inf is the same everywhere): nothing to gather
        grads = [pc.param.grad for pc in owned if pc.param.grad is not None]
        if grad_scale is not None and grads:  # unscaled as GradScaler.unscale_ does: g * float(1 / double(scale))
            inv = torch.as_tensor(grad_scale, device=z._device).double().reciprocal().float()
            torch._foreach_mul_(grads, inv.to(grads[0].dtype))
        if z._clip_coef is not None:  # clip_grad_norm_ since the last step: the owned gradients scaled
            if grads:
                torch._foreach_mul_(grads, z._clip_coef.to(grads[0].dtype))
            z._clip_coef = None
        self.inner.step()
        return True

    def write_steps(self):
        for f in self._parts(self.inner)[1]:
            if f._engines:
                f._sync_steps(write_state=True)

    def state_of(self, pc):
        return self.inner.state.get(pc.param) if pc.end > pc.begin else None

    def forget_tables(self):
        muon, fused = self._parts(self.inner)
        if muon is not None:
            muon._of_dirty = True
        for f in fused:
            f._forget_tables()

    def repoint(self, pieces, views):
        # The inner optimizer steps the parameters themselves (its own watch sees their new storage);
        # the pieces are only what the all-gather reads and writes.
        pass


def _scalar_keys(optimizer, group):
    """The state keys of a FusedOptimizer's parameter in `group` that hold one number per parameter:
    "step" and the chain's uniform states (ASGD's eta and mu, NAdam's mu_product), from the chain the
    group would be stepped with (made once per class, structure and features)."""
    h = _host_view(group)
    key, feats = optimizer._structure(h), optimizer._features(h)
    cache = (type(optimizer), key, feats)
    if cache not in _SCALAR_KEYS:
        try:
            chain = _unchecked(lambda: _with_unscale(optimizer._make_chain(key, feats, [h])))
            core = _unchecked(lambda: _core.Optimizer(chain, "cpu"))
            names = {name for name, _, _ in core.uniform_state_specs}
        except Exception:  # noqa: BLE001 (a chain only its engines can make: torch's per-parameter keys)
            names = {"eta", "mu", "mu_product"}
        _SCALAR_KEYS[cache] = frozenset({"step"} | names)
    return _SCALAR_KEYS[cache]
