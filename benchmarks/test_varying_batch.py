"""Batches whose saved sizes change: a whole training step (forward + backward) of a
2-layer message-passing net whose C++ gathers save ``src.sizes()`` as an int list
(CA hashes it: a new batch size is a new capture) and a bool that alternates.

Configs, interleaved pass by pass in one run (the minimum of ``PASSES`` passes'
median step is the figure): ``eager``; stock CA and the plugin with the batch size
changing every step (``stock_varying``, ``plugin_varying``); stock CA with one batch
size (``stock_constant``: what CA costs at best here). Stock recaptures and
recompiles every varying step, so it runs fewer steps a pass; switching between
stock and plugin clears CA's cache (README, "What the plugin changes"), so stock's
first steps of a pass recapture, which the median leaves out. The plugin's warm-up
goes past its switch to plain autograd (``payoff.py``); its tries under CA (one in
``payoff.FIRST_RETRY`` backwards, then ever fewer) fall outside the passes and are
reported as their amortized cost."""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import payoff

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import cpp_ext  # noqa: E402  (the tests' extension: GatherFn)

#: A benchmark's quick mode (counts, not timings): the quick loop (docs/contributing.md) leaves it out.
pytestmark = pytest.mark.slow

FEATURES, NODES, EDGES_PER_NODE = 64, 2000, 8
CONFIGS = ("eager", "stock_constant", "stock_varying", "plugin_varying")
PASSES = 3


class _Net(torch.nn.Module):
    def __init__(self, ext) -> None:
        super().__init__()
        self.ext = ext
        self.layers = torch.nn.ModuleList(torch.nn.Linear(FEATURES, FEATURES) for _ in range(2))

    def forward(self, x, src, dst, halve: bool) -> torch.Tensor:
        h = x
        for layer, gather in zip(self.layers, (self.ext.gather_opaque, self.ext.gather_traceable)):
            messages = gather(layer(h), src, halve)
            h = torch.zeros_like(h).index_add(0, dst, messages).relu()
        return h.square().mean()


def _batch(step: int, varying: bool):
    gen = torch.Generator().manual_seed(step)
    nodes = NODES + (step * 37) % 401 - 200 if varying else NODES
    edges = EDGES_PER_NODE * nodes
    return (
        torch.randn(nodes, FEATURES, generator=gen),
        torch.randint(0, nodes, (edges,), generator=gen),
        torch.randint(0, nodes, (edges,), generator=gen),
        step % 2 == 0,
    )


def _context(config: str, backend: str):
    if config.startswith("plugin"):
        return ca_dynsaved.enable(backend=backend)
    if config.startswith("stock"):
        return torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend=backend))
    return torch._dynamo.compiled_autograd._disable()


def _step_s(net: _Net, config: str, step: int, backend: str) -> float:
    batch = _batch(step, config.endswith("varying"))
    net.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = net(*batch)
    with _context(config, backend):
        loss.backward()
    return time.perf_counter() - start


def test_varying_batch(benchmark, full_run, record):
    torch.manual_seed(0)
    net = _Net(cpp_ext.load())
    backend = "inductor" if full_run else "aot_eager"
    # Warm-up: past the plugin's switch (recompile_limit captures) and stock's first compiles.
    # The quick mode (the suite) checks the warm-up's counts: one pass runs the code the
    # timed passes run, and times nothing anyone reads.
    warm, steps, stock_steps, passes = (12, 20, 3, PASSES) if full_run else (10, 2, 1, 1)
    counts: dict[str, tuple[int, int, int]] = {}
    medians: dict[str, list[float]] = {c: [] for c in CONFIGS}
    capture_s: list[float] = []
    step = 0

    def run() -> None:
        nonlocal step
        for config in CONFIGS:
            ca_dynsaved.reset()
            torch._dynamo.utils.counters.clear()
            for i in range(warm if not config.startswith("stock") else stock_steps):
                seconds = _step_s(net, config, step, backend)
                if config == "plugin_varying" and i < 8:
                    capture_s.append(seconds)  # a capture and its eager run
                step += 1
            c = torch._dynamo.utils.counters
            counts[config] = (c["compiled_autograd"]["captures"], c["stats"]["unique_graphs"], sum(c["graph_break"].values()))
        for _ in range(passes):  # interleaved: drift hits every config alike
            for config in CONFIGS:
                gc.collect()
                n = {"stock_varying": stock_steps, "stock_constant": steps // 2}.get(config, steps)
                times = []
                for _ in range(n):
                    times.append(_step_s(net, config, step, backend))
                    step += 1
                medians[config].append(statistics.median(times))

    benchmark.pedantic(run, rounds=1, iterations=1)
    steady = {c: min(m) * 1e3 for c, m in medians.items()}
    # Counts, not timings: the plugin captures recompile_limit (8) times, compiles
    # nothing (each capture's one run is eager), breaks nothing, then runs plain
    # autograd.
    assert counts["plugin_varying"] == (8, 0, 0)
    assert torch._dynamo.utils.counters["ca_dynsaved"]["uncaptured_backwards"] > 0
    capture_ms = statistics.median(capture_s[1:]) * 1e3  # the first pays one-time costs
    result = {
        "model": "varying_batch",
        "backend": backend,
        "steady_ms": steady,
        "vs_eager": {c: steady[c] / steady["eager"] for c in CONFIGS},
        "counts_at_warmup": counts,
        "warmup_steps": {c: stock_steps if c.startswith("stock") else warm for c in CONFIGS},
        "passes": passes,
        "plugin_capture_step_ms": capture_ms,
        # a try every FIRST_RETRY backwards at first: its extra cost per step
        "plugin_first_tries_ms_per_step": (capture_ms - steady["plugin_varying"]) / payoff.FIRST_RETRY,
    }
    benchmark.extra_info.update(result)
    record(result)
