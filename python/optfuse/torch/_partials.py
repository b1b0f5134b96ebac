"""The partial-sum exchange of a sharded step (the step schedule's Exchange step, optfuse/schedule.h)
over torch.distributed, shared by ZeRO (distributed.py) and FSDP2 (_dtensor.py)."""
import torch
import torch.distributed as dist


def gather_exchange(source, width, mine, world, group):
    """The exchange function for `_core.Optimizer._set_exchange`: every rank sends its local
    per-chunk partials (`mine` columns, padded to `width`) in one all_gather, and fills the global
    partials from the gathered [rows, world x width] by `source` (global chunk j <- gathered column
    source[j]; rank r's columns start at r x width). Every rank then combines the same numbers in
    the same order."""
    cache = {}

    def exchange(phase, rows, local, glob):
        device = local.device
        if device not in cache:
            cache[device] = torch.tensor(source, dtype=torch.long, device=device)
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        send = torch.zeros(len(rows), width, dtype=local.dtype, device=device)
        send[:, :mine] = local.index_select(0, rows_t)
        recv = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(recv, send, group=group)
        glob[rows_t] = torch.cat(recv, dim=1).index_select(1, cache[device])

    return exchange
