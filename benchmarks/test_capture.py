"""Capture cost: a compiled-autograd capture of the same backward, stock against the
plugin, where the plugin traces the custom functions itself (cpp_sym: automatic;
cpp_direct: opted in, verify on) or probes them (python). Each capture starts from
an empty CA cache and compiles nothing (the compiler returns the graph as is), so
what is timed is the capture and one eager run of a small graph."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import payoff
from ca_dynsaved._compat.capture import clear_ca_cache
from models import COLS, TRACE_CPP, Elementwise, values

#: A benchmark's quick mode (counts, not timings): the quick loop (docs/contributing.md) leaves it out.
pytestmark = pytest.mark.slow

CAPTURE_VARIANTS = ("cpp_sym", "cpp_direct", "python")


def _identity(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    return gm


def _capture_s(model: Elementwise, x: torch.Tensor, variant: str, plugin: bool, step: int) -> float:
    for p in model.parameters():
        p.grad = None
    loss = model(x, *values(variant, step, True))
    clear_ca_cache()
    # A capture at every backward is the point here: keep the plugin from taking
    # this structure off compiled autograd after recompile_limit of them (payoff.py).
    payoff.clear()
    if plugin:
        ctx = ca_dynsaved.enable(_identity, trace_cpp=TRACE_CPP)
    else:
        ctx = torch._dynamo.compiled_autograd._enable(_identity)
    start = time.perf_counter()
    with ctx:
        loss.backward()
    return time.perf_counter() - start


@pytest.mark.parametrize("variant", CAPTURE_VARIANTS)
def test_capture(benchmark, bench_ext, full_run, record, variant):
    torch.manual_seed(0)
    model = Elementwise(variant, bench_ext)
    x = torch.randn(4, COLS)
    repeats = 20 if full_run else 2
    times: dict[str, list[float]] = {"stock": [], "plugin": []}

    def run() -> None:
        for step in range(repeats):  # alternate, so that drift hits both alike
            for config in times:
                gc.collect()
                times[config].append(_capture_s(model, x, variant, config == "plugin", step))

    benchmark.pedantic(run, rounds=1, iterations=1)
    counters = torch._dynamo.utils.counters
    assert counters["compiled_autograd"]["captures"] == 2 * repeats
    assert counters["stats"]["unique_graphs"] == 0  # nothing compiled: captures only
    # The plugin traced every custom function (no opaque op in its graphs).
    assert counters["ca_dynsaved"]["opaque_nodes"] == 0
    result = {
        "model": "capture",
        "variant": variant,
        "repeats": repeats,
        # the first capture of a process pays one-time costs (probes, plans): min
        "stock_ms": min(times["stock"]) * 1e3,
        "plugin_ms": min(times["plugin"]) * 1e3,
        "plugin_first_ms": times["plugin"][0] * 1e3,
    }
    benchmark.extra_info.update(result)
    record(result)
