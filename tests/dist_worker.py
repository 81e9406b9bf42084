"""What every rank of the distributed tests does (spawned by test_distributed.py):
join the gloo group, then train each job in order, DDP's (ddp_worker) and FSDP2's
(fsdp2_worker) in one process, so one launch per world size serves both."""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any, Hashable, Sequence

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

#: One job: (result key, worker module, arguments of its ``train(rank, *args)``).
Job = tuple[Hashable, str, tuple[Any, ...]]


def run(rank: int, world: int, port: int, queue, jobs: Sequence[Job]) -> None:
    """Put ``{"rank", "started": key}`` as each job starts (the parent's timeout
    counts from the last word of a rank, so it grows with what a launch runs), then
    ``{"rank": rank, key: result or {"error", "traceback"}}`` once all are done; a
    failure outside a job puts ``{"rank", "error", "traceback"}``. Never hangs the
    parent on an exception."""
    out: dict = {"rank": rank}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        for key, module, args in jobs:
            queue.put({"rank": rank, "started": key})
            try:
                out[key] = importlib.import_module(module).train(rank, *args)
            except Exception as e:  # report, do not hang the parent
                out[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                dist.barrier()  # every rank fails at the same point, before any collective
        queue.put(out)
    except BaseException as e:
        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
