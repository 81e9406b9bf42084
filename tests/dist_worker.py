"""What every rank of the distributed tests does around its training runs
(spawned by test_distributed.py through ddp_worker / fsdp2_worker)."""

from __future__ import annotations

import os
import traceback
from typing import Callable, Hashable, Iterable

import torch.distributed as dist


def serve(rank: int, world: int, port: int, queue, runs: Iterable[tuple[Hashable, Callable[[], dict]]]) -> None:
    """Join the gloo group on loopback, call each run in order and put
    ``{"rank": rank, key: result or {"error", "traceback"}}`` on ``queue``; a
    failure outside a run puts ``{"rank", "error", "traceback"}``. Never hangs
    the parent on an exception."""
    out: dict = {"rank": rank}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        for key, train in runs:
            try:
                out[key] = train()
            except Exception as e:  # report, do not hang the parent
                out[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                dist.barrier()  # every rank fails at the same point, before any collective
        queue.put(out)
    except BaseException as e:
        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
