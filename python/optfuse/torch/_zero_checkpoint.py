"""ZeRO's checkpoints (distributed.py): the consolidated (unsharded) torch-format state dict on every
rank, and sharded torch.distributed.checkpoint (DCP) dicts, whose strategy-specific half is a mixin
of each sharding strategy (_zero_strategies.py):

  FlatPiecesCheckpoint       each per-element state is a ShardedTensor of the parameter's flattened
                             size whose shards are the ranks' pieces (DCP reshards on load)
  WholeParametersCheckpoint  each owned state whole, in the dict of its owner only"""
import io

import torch
import torch.distributed as dist

from .. import _core

OptfuseError = _core.OptfuseError


def _to_bytes(obj):
    """A Python object as a uint8 tensor (DCP saves one copy of a tensor every rank holds alike, and
    its metadata gives the size to load into, where a Python object would be split into its leaves)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(t):
    # weights_only=False: the param groups hold Python values (tuples, dtypes, tensors) from the
    # checkpoint being loaded, which DCP itself unpickles the same way.
    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=False)


# --- consolidated
def consolidated_state_dict(zero):
    """The unsharded state dict in the wrapped optimizer's (torch's) format, on every rank. The pieces
    travel as CPU tensors through all_gather_object (simple, not fast: for checkpoints)."""
    zero._strategy.write_steps()  # step counts into the pieces' state
    inner = zero._inner
    # Group-level state the class writes into its groups when saving (timm's Lamb keeps its step
    # count in the group): every rank's pieces have the same counts, so the inner groups' value is
    # the unsharded one.
    inner.state_dict()
    for outer, g in zip(zero.param_groups, inner.param_groups):
        for k, v in g.items():
            if k != "params" and (k == "step" or k not in outer):
                outer[k] = v
    local = {}
    for pc in zero._mine:
        st = zero._strategy.state_of(pc)
        if st:
            local[(zero._param_index[id(pc.param)], pc.begin, pc.end)] = {
                k: (v.detach().cpu(), str(v.device)) if torch.is_tensor(v) else (v, None) for k, v in st.items()}
    gathered = [None] * zero.world
    dist.all_gather_object(gathered, local, group=zero.process_group)
    params = zero._params()
    for part in gathered:
        for (i, a, b), st in sorted(part.items()):
            p = params[i]
            full = zero.optimizer.state[p]
            for k, (v, device) in st.items():
                if device is not None and v.dim() == 1 and v.numel() == b - a:  # per element: this piece
                    if k not in full:
                        full[k] = torch.zeros(p.shape, dtype=v.dtype, device=p.device)
                    full[k].view(-1)[a:b] = v
                elif k not in full:  # per parameter (step, ASGD's eta and mu): every piece has it
                    full[k] = v.to(device) if device is not None else v
    try:
        return zero.optimizer.state_dict()
    finally:
        zero.optimizer.state.clear()  # the full state lives only in the returned dict


def load_consolidated(zero, state_dict):
    """Loads an unsharded state dict (any world size saved it, or an unsharded optimizer)."""
    zero.optimizer.load_state_dict(state_dict)  # torch's load makes new group dicts: take their values
    for mine, loaded in zip(zero.param_groups, zero.optimizer.param_groups):
        mine.update({k: v for k, v in loaded.items() if k != "params"})
    zero.optimizer.param_groups = zero.param_groups  # one set of group dicts again (schedulers hold them)
    zero._inner.state.clear()
    zero._strategy.take_state(zero.optimizer)


# --- sharded (torch.distributed.checkpoint)
def _checkpoint_header(zero, params):
    """The entries of a sharded checkpoint every rank writes alike: the groups' options (without
    "params") and each parameter's size (checked at load)."""
    return {"param_groups": _to_bytes([{k: v for k, v in g.items() if k != "params"}
                                       for g in zero._inner.param_groups]),
            "param_numels": torch.tensor([p.numel() for p in params], dtype=torch.int64)}


def _state_index(key, params):
    """The parameter index i of a checkpoint's "state.<i>.<key>" entry, checked against `params`."""
    i = int(key.split(".")[1])
    if i >= len(params):
        raise OptfuseError(f"ZeRO.sharded_state_dict: the checkpoint has state for parameter {i}, this optimizer "
                           f"has {len(params)} parameters")
    return i


def load_sharded(zero, state_dict):
    """ZeRO.load_sharded_state_dict: the checks and group values common to both strategies, then the
    strategy's own states."""
    numels = [p.numel() for p in zero._params()]
    if state_dict["param_numels"].tolist() != numels:
        raise OptfuseError(f"ZeRO.load_sharded_state_dict: the checkpoint's parameters have "
                           f"{state_dict['param_numels'].tolist()} elements, this optimizer's {numels}")
    groups = _from_bytes(state_dict["param_groups"])
    if len(groups) != len(zero.param_groups):
        raise OptfuseError(f"ZeRO.load_sharded_state_dict: {len(groups)} param groups saved, this optimizer has "
                           f"{len(zero.param_groups)}")
    for outer, inner, saved in zip(zero.param_groups, zero._inner.param_groups, groups):
        for g in (outer, inner):
            g.update({k: v for k, v in saved.items() if k != "params"})
    zero._inner.state.clear()
    zero._strategy.load_sharded(state_dict)
    zero._strategy.forget_tables()  # the engines' tables and step counts are re-read from the state


class FlatPiecesCheckpoint:
    """Sharded checkpoints of flat pieces: ``"state.<i>.<key>"`` of a per-element state is a
    ShardedTensor of the parameter's flattened size whose shards are every rank's pieces."""

    def _sharded(self, i, local, dtype):
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
        z = self.zero
        p = z._params()[i]
        metas = [ShardMetadata(shard_offsets=[pieces[i].begin], shard_sizes=[pieces[i].end - pieces[i].begin],
                               placement=f"rank:{r}/{z._device}")
                 for r, pieces in enumerate(z._pieces) if pieces[i].end > pieces[i].begin]
        pc = z._mine[i]
        shards = [Shard(local, metas[[m.placement.rank() for m in metas].index(z.rank)])] \
            if pc.end > pc.begin else []
        meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([p.numel()]),
                                     tensor_properties=TensorProperties(dtype=dtype))
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, process_group=z.process_group)

    @staticmethod
    def _per_element(pc, v):
        """A state tensor of the piece's elements (sliced by the shards), not a per-parameter value."""
        return torch.is_tensor(v) and v.dim() == 1 and v.numel() == pc.end - pc.begin

    def sharded_state_dict(self, like):
        z = self.zero
        params = z._params()
        out = {}
        if like is None:
            self.write_steps()  # step counts into the pieces' state
            self.inner.state_dict()  # group-level state (timm's group step) into the inner groups
            for i, pc in enumerate(z._mine):
                if pc.param.numel() == 0:
                    continue
                for k, v in (self.inner.state.get(pc.view) or {}).items():
                    out[f"state.{i}.{k}"] = self._sharded(i, v.view(-1), v.dtype) if self._per_element(pc, v) else v
            return dict(out, **_checkpoint_header(z, params))
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        for key, md in like.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                out[key] = None  # a Python value: DCP puts the saved object here
            elif key.startswith("state.") and list(md.size) == [params[_state_index(key, params)].numel()]:
                i = int(key.split(".")[1])
                pc = z._mine[i]
                out[key] = self._sharded(i, torch.empty(pc.end - pc.begin, dtype=md.properties.dtype,
                                                        device=z._device), md.properties.dtype)
            else:  # per-parameter values, the pickled param_groups
                out[key] = torch.empty(md.size, dtype=md.properties.dtype)
        return out

    def load_sharded(self, state_dict):
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        z = self.zero
        for key, v in state_dict.items():
            if not key.startswith("state."):
                continue
            _, i, k = key.split(".", 2)
            st = self.inner.state[z._mine[int(i)].view]
            if isinstance(v, ShardedTensor):
                local = v.local_shards()
                st[k] = local[0].tensor.view(-1) if local else torch.empty(
                    0, dtype=v.metadata().tensor_properties.dtype, device=z._device)
            else:
                st[k] = v.clone() if torch.is_tensor(v) else v


class WholeParametersCheckpoint:
    """Sharded checkpoints of whole parameters: ``"state.<i>.<key>"`` is the owner's state itself, in
    the parameter's shape, in the dict of its owner only (DCP writes a key that one rank holds from
    that rank); loading, each rank asks for the states of the parameters it owns now."""

    def sharded_state_dict(self, like):
        z = self.zero
        params = z._params()
        owned = {i for i, pc in enumerate(z._mine) if pc.end > pc.begin}
        out = {}
        if like is None:
            self.write_steps()  # step counts into the state
            for i in sorted(owned):
                for k, v in (self.inner.state.get(params[i]) or {}).items():
                    out[f"state.{i}.{k}"] = v
            return dict(out, **_checkpoint_header(z, params))
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        for key, md in like.state_dict_metadata.items():
            if key.startswith("state.") and _state_index(key, params) not in owned:
                continue  # another rank's matrix now
            if not isinstance(md, TensorStorageMetadata):
                out[key] = None  # a Python value: DCP puts the saved object here
            else:  # a state tensor (on the parameters' device; a 0-dim step count on the CPU, as torch keeps it)
                device = z._device if key.startswith("state.") and len(md.size) > 0 else "cpu"
                out[key] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
        return out

    def load_sharded(self, state_dict):
        z = self.zero
        params = z._params()
        for key, v in state_dict.items():
            if key.startswith("state."):
                _, i, k = key.split(".", 2)
                if z._mine[int(i)].end > z._mine[int(i)].begin:
                    self.inner.state[params[int(i)]][k] = v.clone() if torch.is_tensor(v) else v
