"""One rank's FSDP2 runs (dist_worker runs them, spawned by test_distributed.py):
``fully_shard`` on each Linear and on the root, a traceable C++, a Python and an
opaque C++ custom function whose saved values change every step; one fresh model
per case, each case's eager twin first."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

STEPS = 5


@dataclass(frozen=True)
class Case:
    """How one run trains: ``entry``, how backward runs ("eager"; "stock": stock CA
    around it; "enable" / "decorator": the plugin's context manager / decorator;
    "config" / "config_stock": the step under torch.compile on Dynamo's config
    path, with the plugin's flag or without), FSDP2's ``reshard`` after forward,
    ``accumulate`` micro-steps per optimizer step (gradient sync on the last
    only), ``mixed`` precision (bf16 parameters, fp32 reduction), torch 2.15's
    ``manual`` backward finalization, ``checkpoint``: the first two blocks under
    ``torch.utils.checkpoint`` ("reentrant" / "non-reentrant"; "" none)."""

    entry: str
    reshard: bool = True
    accumulate: int = 1
    mixed: bool = False
    manual: bool = False
    checkpoint: str = ""

    @property
    def eager(self) -> "Case":
        return replace(self, entry="eager")

    @property
    def compiled_step(self) -> bool:
        return self.entry in ("config", "config_stock")


class _Model(torch.nn.Module):
    def __init__(self, ext, checkpoint: str = "") -> None:
        super().__init__()
        self.ext = ext
        self.checkpoint = checkpoint
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, k: int, s: float) -> torch.Tensor:
        if self.checkpoint:
            h = self._checkpointed(self._second, self._checkpointed(self._first, x, k, s), k, s)
        else:
            # In one frame, as the counts of the config path were measured: the
            # compiled step breaks its graph at these calls, and a break inside a
            # called method adds graphs and breaks of its own.
            from test_python_ctx import ScaleFn

            h = self.ext.scale_traceable(self.a(x), k, 1, s, 0.05)
            h = ScaleFn.apply(self.b(h), k + 1, s)
        h = self.ext.scale_opaque(h, k + 2, 2, s, 0.1)
        return self.c(h).float().square().mean()

    def _first(self, x: torch.Tensor, k: int, s: float) -> torch.Tensor:
        return self.ext.scale_traceable(self.a(x), k, 1, s, 0.05)

    def _second(self, h: torch.Tensor, k: int, s: float) -> torch.Tensor:
        from test_python_ctx import ScaleFn

        return ScaleFn.apply(self.b(h), k + 1, s)

    def _checkpointed(self, fn, h: torch.Tensor, k: int, s: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
        from torch.utils.checkpoint import checkpoint

        return checkpoint(fn, h, k, s, use_reentrant=self.checkpoint == "reentrant")


def _full(t: torch.Tensor) -> list:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).float().tolist()


def _values(step: int) -> tuple[int, float]:
    return step % 3 + 1, 0.1 * (step + 1)


def train(rank: int, case: Case) -> dict:
    """Train a fresh model ``STEPS`` optimizer steps; return every loss, the
    gradients before each optimizer step, the final parameters, the optimizer's
    state (all as full tensors) and the counts."""
    import ca_dynsaved
    import cpp_ext
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    counters.clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Model(cpp_ext.load(), case.checkpoint)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.mixed else MixedPrecisionPolicy()
    for module in (model.a, model.b, model.c, model):
        fully_shard(module, reshard_after_forward=case.reshard, mp_policy=mp)
    if case.manual:
        model.set_manual_backward_finalization(True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def forward_backward(x: torch.Tensor, k: int, s: float) -> torch.Tensor:
        loss = model(x, k, s)
        loss.backward()
        return loss.detach()

    step_fn = forward_backward
    if case.entry == "decorator":
        step_fn = ca_dynsaved.enable(backend="aot_eager")(forward_backward)
    elif case.compiled_step:
        torch._dynamo.config.compiled_autograd = True
        setattr(torch._dynamo.config, ca_dynsaved.CONFIG_FLAG, case.entry == "config")
        step_fn = torch.compile(forward_backward, backend="aot_eager")

    losses, grads = [], []
    try:
        for step in range(STEPS):
            for micro in range(case.accumulate):
                model.set_requires_gradient_sync(micro == case.accumulate - 1)
                gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
                x = torch.randn(4, 8, generator=gen)
                k, s = _values(step * case.accumulate + micro)
                if case.entry == "enable":
                    loss = model(x, k, s)
                    with ca_dynsaved.enable(backend="aot_eager"):
                        loss.backward()
                elif case.entry == "stock":
                    loss = model(x, k, s)
                    with torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend="aot_eager")):
                        loss.backward()
                else:
                    loss = step_fn(x, k, s)
                losses.append(loss.item())
            if case.manual:
                model.finalize_backward()
            grads.append([_full(p.grad) for p in model.parameters()])
            opt.step()
            opt.zero_grad()
    finally:
        torch._dynamo.config.compiled_autograd = False
        setattr(torch._dynamo.config, ca_dynsaved.CONFIG_FLAG, False)
    state = [
        [_full(v) for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor) and v.dim() > 0]
        for p in model.parameters()
    ]
    return {
        "losses": losses,
        "grads": grads,
        "params": [_full(p.detach()) for p in model.parameters()],
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
        "optimizer_state": state,
        "captures": counters["compiled_autograd"]["captures"],
        "compiles": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }
