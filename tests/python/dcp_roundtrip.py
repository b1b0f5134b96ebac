"""The sharded-checkpoint round trip of the ZeRO DCP tests (test_zero2.py, test_zero_muon.py): a
"save" phase writes ZeRO's sharded state with torch.distributed.checkpoint and, from rank 0, the
model and the unsharded reference optimizer (torch.save); a "load" phase, on any world size,
restores the model weights, then both optimizers, into new objects."""
import torch
import torch.distributed as dist


def load_weights(ckpt, model, ref_model):
    """The saved model weights into both models; returns what rank 0 saved (for load_optimizers)."""
    saved = torch.load(ckpt + ".ref.pt")
    model.load_state_dict(saved["model"])
    ref_model.load_state_dict(saved["model"])
    return saved


def load_optimizers(ckpt, zero, ref, saved):
    """The reference's state dict and ZeRO's sharded state (in this world size's shards)."""
    import torch.distributed.checkpoint as dcp
    ref.load_state_dict(saved["ref"])
    sd = zero.sharded_state_dict(like=dcp.FileSystemReader(ckpt).read_metadata())
    dcp.load(sd, checkpoint_id=ckpt)
    zero.load_sharded_state_dict(sd)


def save(ckpt, zero, ref, model, rank):
    import torch.distributed.checkpoint as dcp
    dcp.save(zero.sharded_state_dict(), checkpoint_id=ckpt)
    if rank == 0:
        torch.save({"model": model.state_dict(), "ref": ref.state_dict()}, ckpt + ".ref.pt")
    dist.barrier()


def run(worker, saved_by, loaded_by, tmp_path):
    """worker(rank, world, init_file, out_dir, phase, ckpt_dir) on `saved_by` ranks ("save"), then on
    `loaded_by` ranks ("load"); yields (phase, rank, that rank's report)."""
    from ranks import spawn_ranks
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    saved = spawn_ranks(worker, saved_by, tmp_path / "save", "save", str(ckpt_dir))
    loaded = spawn_ranks(worker, loaded_by, tmp_path / "load", "load", str(ckpt_dir))
    for phase, results in (("save", saved), ("load", loaded)):
        for rank, res in enumerate(results):
            yield phase, rank, res
