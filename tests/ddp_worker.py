"""One rank of the distributed tests (spawned by test_distributed.py)."""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

STEPS = 8


def _values(rank: int, step: int, same: bool) -> tuple[int, float]:
    k = step % 3 + (0 if same else rank)
    return k, 0.1 * (step + 1) + (0.0 if same else 0.05 * rank)


class _Model(torch.nn.Module):
    def __init__(self, ext) -> None:
        super().__init__()
        self.ext = ext
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, k: int, s: float) -> torch.Tensor:
        from test_python_ctx import ScaleFn

        h = self.ext.scale_traceable(self.a(x), k, 1, s, 0.05)
        h = ScaleFn.apply(h, k + 1, s)
        return self.b(h).square().mean()


def _full(t: torch.Tensor) -> list:
    # FSDP2 shards parameters and grads as DTensors.
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).tolist()


def run(rank: int, world: int, port: int, mode: str, same: bool, queue, wrap: str = "ddp") -> None:
    """mode: "eager", "stock" (stock CA), "plugin" (ca_dynsaved around backward), or "cpp_reducer" (the
    plugin with DDP's C++ reducer, which CA refuses); wrap: "ddp" or "fsdp2"."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        import ca_dynsaved
        import cpp_ext
        from torch._dynamo.utils import counters

        if mode != "cpp_reducer":  # else torch's default: DDP's C++ reducer
            torch._dynamo.config.optimize_ddp = "python_reducer"
        torch.manual_seed(0)
        model = _Model(cpp_ext.load())
        if wrap == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.001)
        grads = []
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
            loss = model(x, *_values(rank, step, same))
            if mode == "eager":
                loss.backward()
            elif mode == "stock":
                with torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend="aot_eager")):
                    loss.backward()
            else:
                with ca_dynsaved.enable(backend="aot_eager"):
                    loss.backward()
            grads.append([_full(p.grad) for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        queue.put({
            "rank": rank,
            "grads": grads,
            "params": [_full(p.detach()) for p in model.parameters()],
            "compiles": counters["stats"]["unique_graphs"],
            "captures": counters["compiled_autograd"]["captures"],
            "graph_breaks": sum(counters["graph_break"].values()),
        })
    except BaseException as e:  # report, do not hang the parent
        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
