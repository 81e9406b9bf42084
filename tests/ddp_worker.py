"""One rank's DDP runs (dist_worker runs them, spawned by test_distributed.py)."""

from __future__ import annotations

import torch

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


def _train(rank: int, mode: str, same: bool) -> dict:
    """Train a fresh model ``STEPS`` steps; return its grads per step, its
    parameters (and their types) and the counts."""
    import ca_dynsaved
    import cpp_ext
    from torch._dynamo.utils import counters

    counters.clear()
    torch._dynamo.reset()
    torch._dynamo.utils.clear_compilation_metrics()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_Model(cpp_ext.load()))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    if mode in ("compiled_config", "compiled_config_stock"):
        # How users combine DDP with CA: the step under torch.compile, CA and the
        # plugin switched on by config (Dynamo's config path), the Python reducer.
        torch._dynamo.config.compiled_autograd = True
        setattr(torch._dynamo.config, ca_dynsaved.CONFIG_FLAG, mode == "compiled_config")

        @torch.compile(backend="aot_eager")
        def step_fn(x, k, s):
            model(x, k, s).backward()

    grads = []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
        if mode in ("compiled_config", "compiled_config_stock"):
            step_fn(x, *_values(rank, step, same))
        else:
            loss = model(x, *_values(rank, step, same))
            if mode == "eager":
                loss.backward()
            elif mode == "stock":
                with torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend="aot_eager")):
                    loss.backward()
            else:
                with ca_dynsaved.enable(backend="aot_eager"):
                    loss.backward()
        grads.append([p.grad.tolist() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    torch._dynamo.config.compiled_autograd = False
    setattr(torch._dynamo.config, ca_dynsaved.CONFIG_FLAG, False)
    from ca_dynsaved._compat.dynamo import compilation_metrics

    # Dynamo's compiles of CA graphs have compile ids "!<capture>/..."
    ca_compiles = sum(
        1 for m in compilation_metrics() if str(m.compile_id or "").startswith("!") and not m.fail_reason
    )
    return {
        "rank": rank,
        "ca_compiles": ca_compiles,
        "recompile_reasons": [
            (str(m.compile_id), (m.recompile_reason or "")[:300])
            for m in compilation_metrics()
            if m.recompile_reason
        ],
        "grads": grads,
        "params": [p.detach().tolist() for p in model.parameters()],
        "compiles": counters["stats"]["unique_graphs"],
        "captures": counters["compiled_autograd"]["captures"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def train(rank: int, mode: str, same: bool) -> dict:
    """Train once in ``mode``: "eager", "stock" (stock CA around backward), "plugin"
    (ca_dynsaved around backward), "compiled_config" / "compiled_config_stock" (see
    _train), or "cpp_reducer" (the plugin with DDP's C++ reducer, which CA refuses)."""
    # DDP picks its reducer when it is built: torch's default is the C++ one.
    torch._dynamo.config.optimize_ddp = "ddp_optimizer" if mode == "cpp_reducer" else "python_reducer"
    return _train(rank, mode, same)
