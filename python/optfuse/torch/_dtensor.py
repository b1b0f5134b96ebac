"""DTensor parameters (torch's FSDP2, `torch.distributed.fsdp.fully_shard`): each rank steps the local
shards of its parameters, gradients and states in the same one launch.

The optimizer keeps the DTensors where torch.optim does (param_groups, the keys of `state`, states
created with `torch.empty_like(p)`: DTensors with the parameter's mesh, placements and global shape,
so state dicts and torch.distributed.checkpoint see torch's format); the engine's tables get the
local tensors (`_local_tensor`: pointer, numel, dtype). A rank whose shard is empty steps an empty
entry. A chain with reductions (global-norm clip, Lamb's and Lars's per-tensor norms, a non-finite
check) reduces over the mesh through the step schedule's Exchange step (set_mesh_exchange): each
rank's per-chunk partial sums are all-gathered, and every rank combines all of them in one fixed
order (tensor by tensor, rank by rank), so every rank gets the same model-wide values.

No DTensor can exist before torch.distributed.tensor is imported: until then the checks here cost
one dict lookup and import nothing.
"""
import sys


_DTENSOR = []  # the class, once torch.distributed.tensor is imported (a rebuild asks per tensor and state)


def _dtensor_class():
    if _DTENSOR:
        return _DTENSOR[0]
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    if cls is not None:
        _DTENSOR.append(cls)
    return cls


def is_dtensor(t):
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t):
    """The tensor the kernel steps: a DTensor's local shard (the very tensor it holds, no copy), else t."""
    cls = _DTENSOR[0] if _DTENSOR else _dtensor_class()  # (is_dtensor, inlined: a rebuild calls this per role)
    return t._local_tensor if cls is not None and isinstance(t, cls) else t


def check_grad(name, p, tg):
    """A DTensor parameter's gradient must be sharded as the parameter (FSDP2's reduce-scattered
    gradient): then its local tensor and the parameter's hold the same elements."""
    g = p.grad
    if not is_dtensor(g):
        raise _error(f"{name}: the parameter of shape {tuple(p.shape)} (group {tg}) is a DTensor but its gradient "
                     f"is a {type(g).__name__}; FSDP2 (fully_shard) gives DTensor gradients sharded like the parameter")
    if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements) or g.shape != p.shape:
        raise _error(f"{name}: the gradient of the DTensor parameter of shape {tuple(p.shape)} (group {tg}) has "
                     f"placements {tuple(g.placements)} (shape {tuple(g.shape)}), the parameter "
                     f"{tuple(p.placements)}: optfuse steps each rank's local shard, which needs the gradient "
                     "sharded as the parameter (reduce it first)")
    if g._local_tensor.shape != p._local_tensor.shape:
        raise _error(f"{name}: the local gradient shard of the DTensor parameter of shape {tuple(p.shape)} "
                     f"(group {tg}) has shape {tuple(g._local_tensor.shape)}, the parameter's local shard "
                     f"{tuple(p._local_tensor.shape)}")


def as_state(t, p):
    """A state tensor for DTensor parameter p from a plain tensor (a state dict saved without
    FSDP2): of p's global shape, this rank's shard of it (every rank holds the whole tensor: no
    communication); of p's local shape, taken as this rank's shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if t.shape == p.shape:
        return distribute_tensor(t.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    if t.shape == p._local_tensor.shape:
        return DTensor.from_local(t.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    raise _error(f"a state of shape {tuple(t.shape)} for the DTensor parameter of global shape {tuple(p.shape)} "
                 f"(local shard {tuple(p._local_tensor.shape)}): neither")


def _local_numels(p, name, dim):
    """Elements of DTensor p's local shard on each rank of mesh dimension `dim`, in mesh order. A
    Shard(d) placement cuts dim d as torch.chunk does (FSDP2's fully_shard: ceil(size / N) rows per
    rank, the last ranks fewer or none); Replicate: the whole tensor everywhere."""
    from torch.distributed.tensor import Replicate, Shard
    mesh, placement = p.device_mesh, p.placements[dim]
    world = mesh.size(dim)
    if isinstance(placement, Replicate):
        sizes = [p.numel()] * world
    elif isinstance(placement, Shard):
        d = placement.dim % p.dim()
        rows = p.shape[d]
        per = -(-rows // world) if rows else 0
        inner = p.numel() // rows if rows else 0
        sizes = [inner * max(0, min(rows, (r + 1) * per) - r * per) for r in range(world)]
    else:
        raise _error(f"{name}: the DTensor parameter of shape {tuple(p.shape)} has placement {placement}; a chain "
                     "with reductions steps Shard(d) or Replicate parameters")
    if sizes[mesh.get_local_rank(dim)] != p._local_tensor.numel():
        raise _error(f"{name}: the DTensor parameter of shape {tuple(p.shape)} ({placement}) holds "
                     f"{p._local_tensor.numel()} elements on this rank, not the {sizes[mesh.get_local_rank(dim)]} of "
                     "an even torch.chunk split; a chain with reductions needs each rank's shard size")
    return sizes


def set_mesh_exchange(name, engine):
    """Makes a reducing engine over DTensor parameters reduce over their device mesh.

    The engine's per-chunk partial sums cover this rank's local shards. At every Exchange step the
    ranks all-gather them, and each fills the *global* partials: per tensor (table order), the chunks
    of every rank's shard in mesh order (a Replicate tensor: rank 0's only). Combine then sums each
    tensor's span and the whole row in that order on every rank: the same values everywhere,
    deterministic run to run. Not bitwise the unsharded step's (its chunks are cut elsewhere in the
    tensor), which ZeRO's chunk-aligned shards are."""
    from torch.distributed.tensor import Replicate
    from ._partials import gather_exchange
    params = engine.params
    if not params:
        return
    plain = [p for p in params if not is_dtensor(p)]
    if plain:
        raise _error(f"{name}: the chain has reductions and steps DTensor parameters (FSDP2) together with plain "
                     f"tensors (shape {tuple(plain[0].shape)}): a model-wide norm needs every parameter sharded over "
                     "one device mesh; shard the whole model (fully_shard on the root module too)")
    mesh = params[0].device_mesh
    for p in params:
        if p.device_mesh != mesh:
            raise _error(f"{name}: the chain has reductions and its DTensor parameters live on different device "
                         f"meshes ({mesh} and {p.device_mesh}); reductions over one mesh only")
    # The mesh dimension the shards are cut along: a 1-D mesh's, or HSDP's second (its first
    # replicates, and every replica computes the same values, so the reduction runs within one).
    if mesh.ndim == 2 and all(isinstance(p.placements[0], Replicate) for p in params):
        dim = 1
    elif mesh.ndim == 1:
        dim = 0
    else:
        raise _error(f"{name}: the chain has reductions and the parameters' device mesh has {mesh.ndim} dimensions "
                     f"({mesh}) with placements {tuple(params[0].placements)}; reductions over a 1-D mesh (FSDP2) or "
                     "a 2-D one whose first dimension replicates (HSDP) only")
    if mesh.size(dim) == 1:
        return  # one rank in the reduction: its partials are all of them
    chunk = engine.core.chunk_elements
    world, me, group = mesh.size(dim), mesh.get_local_rank(dim), mesh.get_group(dim)
    # chunks[t][r]: rank r's local chunks of tensor t; local_first[r][t]: where they start in its table
    chunks = [[-(-n // chunk) for n in _local_numels(p, name, dim)] for p in params]
    local_first = [[0] * len(params) for _ in range(world)]
    for r in range(world):
        at = 0
        for t in range(len(params)):
            local_first[r][t] = at
            at += chunks[t][r]
    width = max(1, max(sum(c[r] for c in chunks) for r in range(world)))
    mine = sum(c[me] for c in chunks)
    firsts, counts, source = [], [], []  # source: global chunk -> column of the gathered [world x width]
    for t, p in enumerate(params):
        firsts.append(len(source))
        owners = [0] if isinstance(p.placements[dim], Replicate) else range(world)
        for r in owners:
            source.extend(r * width + local_first[r][t] + k for k in range(chunks[t][r]))
        counts.append(len(source) - firsts[-1])
    engine.core._set_exchange(len(source), firsts, counts, gather_exchange(source, width, mine, world, group))


def _error(msg):
    from .. import _core
    return _core.OptfuseError(msg)
