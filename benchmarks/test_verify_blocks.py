"""What the proof costs at scale: whole steps of a 32-block residual model, each block a
Linear, a C++ ``toDouble()`` / ``toInt()`` reader (traced by default, each new tuple of
its numbers verified) and a Python function with a ctx float, the numbers per block and
new at every step (``plugin_varying``: 32 checks a step) or the same every step
(``plugin_constant``: every check a cache hit), aot_eager. The two plugin configs run
one captured graph, so they interleave finely: in each of 5 passes, from a fresh state
and warmed, windows of 5 steps alternate between them 10 times; eager and stock_constant
get a window of their own in each pass (rotated). Steady step: the smallest of the
passes' medians; the ratio plugin_varying / plugin_constant also pass by pass (its
spread). Recorded: that ratio, the proof's cost per new tuple inside whole steps
((varying - constant) / 32), and, to explain it, one check timed alone
(``ways.verify.check`` on new values, the same node)."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import pytest
import torch

import ca_dynsaved
from ca_dynsaved.ways import verify
from harness import _fresh
from models import PyAct

#: A benchmark's quick mode (counts, not timings): the quick loop (docs/contributing.md) leaves it out.
pytestmark = pytest.mark.slow

BLOCKS, WIDTH, BATCH = 32, 256, 128
CONFIGS = ("eager", "stock_constant", "plugin_constant", "plugin_varying")
PASSES = 5
#: how the plugin runs the model's two functions
TRACED = {("torch::autograd::CppNode<DirectSchedAct>", "traced-dynamic"), ("PyAct", "traced-dynamic")}
#: windows of each plugin config a pass, of 5 steps: 160 new tuples a varying window,
#: under verify.CHECKED_LIMIT (256), so the constant config's tuples stay checked
ALTERNATIONS = 10


class Blocks(torch.nn.Module):
    """``h = h + PyAct(cpp(Linear(h)))`` 32 times; block i's numbers (beta, gain for the
    C++ function, beta for the Python one) are its own, and new at every step."""

    def __init__(self, ext, blocks: int = BLOCKS) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.ext = ext
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(blocks))

    def forward(self, x: torch.Tensor, step: int, varying: bool) -> torch.Tensor:
        s = step if varying else 0
        for i, layer in enumerate(self.layers):
            beta, gain = 1.0 + 0.01 * i + 1e-5 * s, 1 + (31 * s + i) % 7
            x = x + PyAct.apply(self.ext.direct_sched_act(layer(x), beta, gain), 0.5 + 1e-5 * s, 1)
        return x.square().mean()


def _context(config: str, backend: str) -> contextlib.AbstractContextManager[None]:
    if config == "eager":
        return contextlib.nullcontext()
    if config == "stock_constant":
        return torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend=backend))
    return ca_dynsaved.enable(backend=backend)


def _steps(model: Blocks, x: torch.Tensor, config: str, steps: int, first: int, backend: str) -> list[float]:
    times = []
    for step in range(first, first + steps):
        for p in model.parameters():
            p.grad = None
        start = time.perf_counter()
        loss = model(x, step, config.endswith("varying"))
        with _context(config, backend):
            loss.backward()
        times.append(time.perf_counter() - start)
    return times


def _one_check_us(model: Blocks, x: torch.Tensor, backend: str) -> float:
    """One check alone: ``verify.check`` of the first block's node on new values,
    the smallest of 5 rounds of 200 (what a step pays per node, cache-warm)."""
    found = []
    real = verify.check

    def spy(plan, inputs, new):  # type: ignore[no-untyped-def]
        found.append((plan, inputs, new))
        return real(plan, inputs, new)

    _fresh()
    verify.check = spy
    try:
        _steps(model, x, "plugin_varying", 1, 0, backend)
    finally:
        verify.check = real
    plan, inputs, new = found[0]
    best = float("inf")
    for round_ in range(5):
        start = time.perf_counter()
        for i in range(200):
            real(plan, inputs, {**new, "beta": new["beta"] + 1e-7 * (round_ * 200 + i + 1)})
        best = min(best, (time.perf_counter() - start) / 200)
    return best * 1e6


def test_verify_blocks(benchmark, bench_ext, full_run, record):
    torch.manual_seed(0)
    blocks = BLOCKS if full_run else 4  # the quick mode checks the counts, on a smaller capture
    model = Blocks(bench_ext, blocks)
    x = torch.randn(BATCH, WIDTH)
    warm, steps, passes = (8, 5 * ALTERNATIONS, PASSES) if full_run else (2, ALTERNATIONS, 1)
    backend = "aot_eager"
    configs = CONFIGS if full_run else ("plugin_constant", "plugin_varying")  # the quick mode: counts
    medians: dict[str, list[float]] = {c: [] for c in configs}
    step = 0

    def window(config: str, n: int) -> list[float]:
        nonlocal step
        times = _steps(model, x, config, n, step, backend)
        step += n
        return times

    ratios: list[float] = []

    def measure() -> None:
        groups = [c for c in ("eager", "stock_constant") if c in configs] + ["plugin"]
        for n in range(passes):
            for group in groups[n % len(groups):] + groups[:n % len(groups)]:
                _fresh()
                gc.collect()
                if group != "plugin":
                    window(group, warm)
                    medians[group].append(statistics.median(window(group, steps)))
                    continue
                window("plugin_varying", warm)
                window("plugin_constant", warm)
                counters = torch._dynamo.utils.counters
                before = counters["ca_dynsaved"]["verify_traces"]
                times: dict[str, list[float]] = {"plugin_varying": [], "plugin_constant": []}
                for _ in range(ALTERNATIONS):
                    for config in times:
                        times[config] += window(config, steps // ALTERNATIONS)
                # every block's numbers are new at every varying step: a check each
                assert counters["ca_dynsaved"]["verify_traces"] - before == blocks * len(times["plugin_varying"])
                assert counters["ca_dynsaved"]["verify_fallbacks"] == 0
                assert (counters["compiled_autograd"]["captures"], counters["stats"]["unique_graphs"]) == (1, 1)
                assert {(node.name, node.handling) for node in ca_dynsaved.report().nodes} == TRACED
                for config, t in times.items():
                    medians[config].append(statistics.median(t))
                ratios.append(medians["plugin_varying"][-1] / medians["plugin_constant"][-1])

    benchmark.pedantic(measure, rounds=1, iterations=1)
    steady = {c: min(m) for c, m in medians.items()}
    result = {
        "model": "verify_blocks",
        "backend": backend,
        "passes": passes,
        "blocks": blocks,
        **{f"{c}_us": steady[c] * 1e6 for c in configs},
        **{f"{c}_spread": max(m) / min(m) for c, m in medians.items()},
        "varying_vs_constant": steady["plugin_varying"] / steady["plugin_constant"],
        "pass_ratios": ratios,
        "per_tuple_us": (steady["plugin_varying"] - steady["plugin_constant"]) / blocks * 1e6,
        "one_check_us": _one_check_us(model, x, backend) if full_run else 0.0,
    }
    benchmark.extra_info.update(result)
    if full_run:
        record(result)
