"""Several processes for the distributed tests (test_zero*.py, test_fsdp2.py): each rank runs
fn(rank, world, rendezvous_file, out_dir, *args) in a process of its own (torch.multiprocessing,
spawn), meets the others through a file (no network), and writes out_dir/rank<r>.json; a run that
exceeds `timeout` seconds is terminated and fails the test (a hang never blocks CI)."""
import json
import time

import pytest


def spawn_ranks(fn, world, run_dir, *args, timeout=600, reporting=None):
    """Runs fn on `world` ranks; returns the JSON each rank in `reporting` (default: all) wrote."""
    import torch.multiprocessing as mp
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(fn, args=(world, str(run_dir / "rendezvous"), str(run_dir), *args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"{world} ranks did not finish within {timeout} s")
    return [json.load(open(run_dir / f"rank{r}.json")) for r in (range(world) if reporting is None else reporting)]


def report(out_dir, rank, out):
    """The end of a rank's function: its results as out_dir/rank<r>.json (what spawn_ranks returns),
    then its process group destroyed if it has one, then the process ends at once (os._exit).

    Why not a normal exit: in about one run in thirty, a gloo rank aborted ("terminate called without
    an active exception", SIGABRT) after its work and its JSON were done, during the interpreter's
    finalization (faulthandler showed the main thread with no Python frame). Most likely objects
    still holding torch's process groups (DeviceMesh, FSDP state) are torn down then and a native
    thread that needs the GIL is unwound by Python, as in torch's abandoned atexit fix
    (pytorch/pytorch#179291); no core dump was caught to name the thread. The results are written
    and flushed before, so skipping finalization loses nothing."""
    import os
    import sys
    import torch.distributed as dist
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)
        f.flush()
        os.fsync(f.fileno())
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
