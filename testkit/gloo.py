"""``spawn``: a function run on several CPU processes joined by gloo, for the
tests of distributed training."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(fn, world: int, tmp_path, *args):
    """``fn(rank, world, *args)`` on ``world`` processes in one gloo group (a
    file store in ``tmp_path``: no port to race for, no server process that
    must outlive the others); returns what rank 0's call returned. ``fn`` is a
    module-level function (the processes import it by name)."""
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(fn, world, str(tmp_path / "store"), str(out), args), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def _worker(rank, fn, world, store, out, args):
    torch.set_num_threads(1)  # tiny models: thread hand-offs cost more than they save
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            torch.save(result, out)
        dist.barrier()  # gloo aborts a process that tears down while a peer still works
    finally:
        dist.destroy_process_group()
    # gloo's worker threads may still be freeing a finished collective's
    # tensors, which takes the GIL: during interpreter shutdown that ends the
    # process in std::terminate (SIGABRT, about one exit in twenty after
    # FSDP2's coalesced all-gathers). Rank 0's result is written; leave
    # without the shutdown. An exception still reaches mp.spawn above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
