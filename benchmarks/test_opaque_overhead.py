"""What an opaque node costs, and how much of it is the plugin's own work: a chain
of custom nodes whose backward is nearly free (``CHAIN_ELEMENTS`` elements), each
with 4 lifted scalars (C++, not traceable) or 2 ctx numbers (Python, run opaque).

* per node: the slope of the step time between chains of ``SHORT`` and ``LONG``
  nodes, plugin against eager (and stock CA with constant values for reference);
  it holds everything an extra node costs: CA's C++ functional, its symbolic
  sizes (graph inputs Dynamo guards), the op's dispatch and the plugin's work;
* plugin-owned per node: what ``opaque.timing()`` measures inside the ops minus
  the user's backward call, the runtime wrapper's own work spread over the nodes,
  and the op's dispatch, timed on the op itself. ``cpp_alias`` returns its
  incoming gradient as is."""

from __future__ import annotations

import gc
import statistics
import time

import pytest
import torch

import ca_dynsaved
import models
from ca_dynsaved import opaque
from models import CHAIN_ELEMENTS, CHAIN_VARIANTS, chain_loss

CONFIGS = ("eager", "stock_constant", "plugin_varying")
SHORT, LONG = 10, 50


def _context(config: str):
    if config == "stock_constant":
        return torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend="inductor"))
    if config == "plugin_varying":
        return ca_dynsaved.enable(backend="inductor", python_policy="opaque")
    return None


def _step_s(ext, variant: str, config: str, x: torch.Tensor, step: int) -> float:
    x.grad = None
    start = time.perf_counter()
    loss = chain_loss(variant, ext, x, step, config != "stock_constant")
    context = _context(config)
    if context is None:
        loss.backward()
    else:
        with context:
            loss.backward()
    return time.perf_counter() - start


def _steady_us(ext, variant: str, config: str, nodes: int, warm: int, steps: int, passes: int) -> float:
    models.CHAIN_NODES = nodes
    x = torch.randn(CHAIN_ELEMENTS, requires_grad=True)
    for step in range(warm):
        _step_s(ext, variant, config, x, step)
    medians = []
    for n in range(passes):
        gc.collect()
        medians.append(statistics.median(_step_s(ext, variant, config, x, warm + n * steps + i) for i in range(steps)))
    return min(medians) * 1e6


def _dispatch_us() -> float:
    """One call of an op declared like the plugin's C++ op, its impl doing nothing."""
    lib = torch.library.Library("ca_dynsaved_bench", "FRAGMENT")
    if not hasattr(torch.ops.ca_dynsaved_bench, "noop"):
        lib.define(
            "noop(Tensor?[] grads, Tensor?[] tensors, Tensor ints, Tensor floats, SymInt[] symints, "
            "str key, int slot) -> Tensor?[]"
        )
        lib.impl("noop", lambda grads, *rest: [grads[0].new_empty(grads[0].shape)], "CompositeExplicitAutograd")
    op = torch.ops.ca_dynsaved_bench.noop.default
    args = ([torch.randn(CHAIN_ELEMENTS)], [], torch.zeros(4, dtype=torch.int64), torch.zeros(2), [16, 16], "k", 0)
    for _ in range(200):
        op(*args)
    start = time.perf_counter()
    for _ in range(5000):
        op(*args)
    return (time.perf_counter() - start) / 5000 * 1e6


@pytest.mark.parametrize("variant", CHAIN_VARIANTS)
def test_opaque_overhead(benchmark, bench_ext, full_run, record, variant):
    torch.manual_seed(0)
    warm, steps, passes = (20, 60, 3) if full_run else (3, 3, 1)
    result: dict = {"model": "chain", "variant": variant, "elements": CHAIN_ELEMENTS, "short": SHORT, "long": LONG}

    def run() -> None:
        # Quick mode (the suite): the plugin's counts on the short chain only; stock
        # compiles every node of a non-traceable chain as a graph of its own.
        for config in CONFIGS if full_run else ("plugin_varying",):
            for nodes in (SHORT, LONG) if full_run else (SHORT,):
                torch._dynamo.utils.counters.clear()
                result[f"{config}_{nodes}_us"] = _steady_us(bench_ext, variant, config, nodes, warm, steps, passes)
                if config == "plugin_varying":
                    counters = torch._dynamo.utils.counters
                    assert counters["stats"]["unique_graphs"] == 1
                    assert counters["ca_dynsaved"]["opaque_nodes"] == nodes
        if not full_run:
            return
        # the plugin's own work, timed inside the long chain
        models.CHAIN_NODES = LONG
        x = torch.randn(CHAIN_ELEMENTS, requires_grad=True)
        with opaque.timing() as totals:
            for step in range(steps):
                _step_s(bench_ext, variant, "plugin_varying", x, step)
        result["in_op_us"] = (totals["ops"] - totals["backward"]) / totals["calls"] * 1e6
        result["backward_call_us"] = totals["backward"] / totals["calls"] * 1e6
        result["wrapper_per_node_us"] = totals["wrapper"] / totals["calls"] * 1e6
        result["dispatch_us"] = _dispatch_us()

    benchmark.pedantic(run, rounds=1, iterations=1)
    if not full_run:
        return
    for config in CONFIGS:
        result[f"{config}_per_node_us"] = (result[f"{config}_{LONG}_us"] - result[f"{config}_{SHORT}_us"]) / (LONG - SHORT)
    result["per_node_vs_eager_us"] = result["plugin_varying_per_node_us"] - result["eager_per_node_us"]
    result["plugin_owned_us"] = result["in_op_us"] + result["wrapper_per_node_us"] + result["dispatch_us"]
    benchmark.extra_info.update(result)
    record(result)
