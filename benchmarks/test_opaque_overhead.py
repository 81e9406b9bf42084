"""What an opaque node costs, as a user pays it: whole training steps (forward, then
backward under the entry point) of a chain of ``CHAIN_NODES`` nearly free custom
nodes on ``CHAIN_ELEMENTS`` elements, their saved numbers new at every step, on
inductor. The figure is ``(plugin_varying - eager) / CHAIN_NODES``: everything an
opaque node adds to a step, CA's own per-node work included.

Configurations, timed in interleaved passes (the smallest of their medians):

* ``eager``: no compiled autograd;
* ``stock_constant``: stock CA on the chain's traceable twin with values that never
  change, so it traces and fuses every node: what compiled autograd costs at best;
* ``plugin_varying``: the plugin, every node opaque (C++: not traceable; Python:
  ``python_policy="opaque"``), the chain one op once compiled (``fuse.py``).

Variants: ``cpp`` (4 lifted numbers a node), ``cpp_alias`` (its backward returns
its incoming gradient as is: a copy each run), ``python`` (2 ctx numbers).

Explaining the figure, never the figure: the plugin's own work inside the ops
(``binding.timing``), the user's backward call, the runtime wrapper's share, and
one call of an op declared like the plugin's with an impl that does nothing."""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time
from typing import Any

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import binding
from models import CHAIN_ELEMENTS, CHAIN_NODES, CHAIN_VARIANTS, chain_loss

#: A benchmark's quick mode (counts, not timings): the quick loop (docs/contributing.md) leaves it out.
pytestmark = pytest.mark.slow

CONFIGS = ("eager", "stock_constant", "plugin_varying")
PASSES = 5


def _context(config: str) -> contextlib.AbstractContextManager[Any]:
    if config == "stock_constant":
        return torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend="inductor"))
    if config == "plugin_varying":
        return ca_dynsaved.enable(backend="inductor", python_policy="opaque")
    return contextlib.nullcontext()


def _step_s(ext: Any, variant: str, config: str, x: torch.Tensor, step: int) -> float:
    """One training step's seconds: forward, then backward under ``config``."""
    x.grad = None
    start = time.perf_counter()
    loss = chain_loss(variant, ext, x, step, config == "plugin_varying", traceable=config == "stock_constant")
    with _context(config):
        loss.backward()
    return time.perf_counter() - start


def steady_us(ext: Any, variant: str, warm: int, steps: int, passes: int) -> dict[str, float]:
    """Each config's steady step in µs: the smallest median of ``passes`` passes of
    ``steps`` steps, each compiled config's passes interleaved with eager's (this
    machine is noisy). Stock's first, then the plugin's: CA's cache holds one mode's
    graphs at a time, so going back and forth would capture again at every switch."""
    medians: dict[str, list[float]] = {config: [] for config in CONFIGS}
    step = 0
    for compiled in CONFIGS[1:]:
        xs = {config: torch.randn(CHAIN_ELEMENTS, requires_grad=True) for config in ("eager", compiled)}
        for config in xs:
            for _ in range(warm):
                _step_s(ext, variant, config, xs[config], step)
                step += 1
        for _ in range(passes):
            for config in xs:
                gc.collect()
                times = []
                for _ in range(steps):
                    times.append(_step_s(ext, variant, config, xs[config], step))
                    step += 1
                medians[config].append(statistics.median(times))
    return {config: min(m) * 1e6 for config, m in medians.items()}


@functools.cache
def _dispatch_us() -> float:
    """One call of an op declared like the plugin's C++ op, its impl doing nothing
    (once per session)."""
    lib = torch.library.Library("ca_dynsaved_bench", "FRAGMENT")
    if not hasattr(torch.ops.ca_dynsaved_bench, "noop"):
        lib.define("noop(Tensor?[] grads, Tensor?[] tensors, SymInt[] symints, str key, int slot) -> Tensor?[]")
        lib.impl("noop", lambda grads, *rest: [grads[0].new_empty(grads[0].shape)], "CompositeExplicitAutograd")
    op = torch.ops.ca_dynsaved_bench.noop.default
    args = ([torch.randn(CHAIN_ELEMENTS)], [], [16, 16], "k", 0)
    for _ in range(200):
        op(*args)
    start = time.perf_counter()
    for _ in range(5000):
        op(*args)
    return (time.perf_counter() - start) / 5000 * 1e6


@pytest.mark.parametrize("variant", CHAIN_VARIANTS)
def test_opaque_overhead(benchmark, bench_ext, full_run, record, variant):
    torch.manual_seed(0)
    warm, steps, passes = (30, 100, PASSES) if full_run else (3, 3, 1)
    result: dict = {"model": "chain", "variant": variant, "nodes": CHAIN_NODES, "elements": CHAIN_ELEMENTS}

    def run() -> None:
        counters = torch._dynamo.utils.counters
        counters.clear()
        result.update({f"{c}_us": us for c, us in steady_us(bench_ext, variant, warm, steps, passes).items()})
        # What each config compiled, in all its steps: the plugin one CA graph of
        # opaque nodes; stock one graph for the chain it traced, values constant.
        ours = counters["ca_dynsaved"]
        assert ours["opaque_nodes"] == CHAIN_NODES
        # one op for the chain (fuse.py), but where each node passes its gradient through
        assert ours["fused_opaque_nodes"] == (0 if variant == "cpp_alias" else CHAIN_NODES - 1)
        result["fused_nodes"] = ours["fused_opaque_nodes"]
        assert counters["compiled_autograd"]["captures"] == 2  # one per compiled config
        assert counters["stats"]["unique_graphs"] == 2
        assert dict(counters["graph_break"]) == {}
        if not full_run:
            return
        x = torch.randn(CHAIN_ELEMENTS, requires_grad=True)
        with binding.timing() as totals:
            for step in range(steps):
                _step_s(bench_ext, variant, "plugin_varying", x, step)
        calls = totals["calls"]
        result["in_op_us"] = (totals["ops"] - totals["backward"]) / calls * 1e6
        result["backward_call_us"] = totals["backward"] / calls * 1e6
        result["wrapper_per_node_us"] = totals["wrapper"] / calls * 1e6
        result["dispatch_us"] = _dispatch_us()

    benchmark.pedantic(run, rounds=1, iterations=1)
    if not full_run:
        return
    result["per_node_vs_eager_us"] = (result["plugin_varying_us"] - result["eager_us"]) / CHAIN_NODES
    result["stock_constant_per_node_vs_eager_us"] = (result["stock_constant_us"] - result["eager_us"]) / CHAIN_NODES
    result["plugin_vs_stock_constant"] = result["plugin_varying_us"] / result["stock_constant_us"]
    benchmark.extra_info.update(result)
    record(result)
