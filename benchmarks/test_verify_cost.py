"""What verify costs a user: whole training steps of the elementwise model with its
C++ ``toDouble()`` / ``toInt()`` reader opted in (``cpp_direct``, ``trace_cpp``),
values new at every step (so every node is checked at every step), against stock CA
with values that never change (``stock_constant``, the floor), in interleaved
passes (the smallest of their medians): ``plugin_varying`` (verify on, the default)
and ``plugin_trust_varying`` (``verify=False``). CA's cache holds one mode's graphs
at a time, so each pass's first step captures again; the median leaves it out."""

from __future__ import annotations

import gc
import statistics

import pytest
import torch

from harness import train
from models import COLS, ROWS, Elementwise, values

#: A benchmark's quick mode (counts, not timings): the quick loop (docs/contributing.md) leaves it out.
pytestmark = pytest.mark.slow

CONFIGS = ("stock_constant", "plugin_varying", "plugin_trust_varying")
PASSES = 4


def test_verify_cost(benchmark, bench_ext, full_run, record):
    torch.manual_seed(0)
    model = Elementwise("cpp_direct", bench_ext)
    x = torch.randn(ROWS, COLS)
    params = list(model.parameters())
    warm, steps, passes, backend = (8, 30, PASSES, "inductor") if full_run else (3, 2, 1, "aot_eager")
    medians: dict[str, list[float]] = {c: [] for c in CONFIGS}
    step = 0

    def run(config: str, n: int) -> list[float]:
        nonlocal step
        times = train(lambda s, v: model(x, *values("cpp_direct", s, v)), params, config, n, backend, step, "cpp_direct")
        step += n
        return times

    def measure() -> None:
        for config in CONFIGS:
            run(config, warm)
        for _ in range(passes):
            for config in CONFIGS:
                gc.collect()
                medians[config].append(statistics.median(run(config, steps)))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    ours = torch._dynamo.utils.counters["ca_dynsaved"]
    # each plugin_varying step checked its new values once, none refused (the 3 nodes
    # share one plan: the same function, layout and values)
    assert ours["verify_traces"] == warm + passes * steps
    assert ours["verify_fallbacks"] == 0
    floor = min(medians["stock_constant"])
    result = {
        "model": "verify_cost",
        "variant": "cpp_direct",
        "backend": backend,
        "passes": passes,
        **{f"{c}_us": min(m) * 1e6 for c, m in medians.items()},
        **{f"{c}_vs_stock_constant": min(m) / floor for c, m in medians.items()},
    }
    benchmark.extra_info.update(result)
    if full_run:
        record(result)
