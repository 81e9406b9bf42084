"""One measurement: a model trained under one configuration, timed and counted.

Configurations: ``eager``; stock compiled autograd with saved values that never
change (``stock_constant``, the floor) and that change every step
(``stock_varying``); the plugin with values changing (``plugin_varying``), and, for
the Python and the C++ ``toDouble()`` functions, the plugin running them opaque
(``plugin_opaque_varying``: ``python_policy`` / ``cpp_policy="opaque"``: what tracing
with dynamic numbers gains over running the backward opaque, the plugin's default
for C++ readers before sentinel tracing became the default).
The ``cpp_direct`` variant's plugin configs opt it in with ``trace_cpp``:
``plugin_varying`` verifies each new value (the default), ``plugin_trust_varying``
does not (``verify=False``): their difference is verify's cost per new value.
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

import ca_dynsaved
from models import TRACE_CPP, values

CONFIGS = ("eager", "stock_constant", "stock_varying", "plugin_varying", "plugin_opaque_varying", "plugin_trust_varying")
#: Configs the quick mode leaves to the full run (``measure``).
QUICK_SKIPS = ("stock_varying",)
#: Configs that only concern some variants.
ONLY = {"plugin_opaque_varying": ("python", "cpp"), "plugin_trust_varying": ("cpp_direct",)}
#: Steady-state passes: the step time is the smallest of their medians (this
#: machine is noisy; the minimum is the least disturbed pass). Five, not three: one
#: config's three 0.2-s windows could all land in a slow stretch (the same code's
#: hashed steady step measured 0.83-1.58 x stock_varying over three 3-pass runs).
PASSES = 5
#: Variants whose first steps are measured further than the first 50, and warmed
#: that far before each steady pass: the hashed combinations get their own graphs at
#: their capture's run ``tiers.SPECIALISE_AFTER_RUNS`` (16: steps 61-63 with 4
#: combinations in turn), which the 2,000-step total and the steady step must include.
PREFIX = {"hashed": 100}


def cases(variants: tuple[str, ...]) -> list[tuple[str, str]]:
    """(variant, config) pairs: python_policy only concerns Python functions."""
    return [(v, c) for v in variants for c in CONFIGS if v in ONLY.get(c, (v,))]


def context(config: str, backend: str, variant: str = "") -> contextlib.AbstractContextManager[Any]:
    if config == "eager":
        return contextlib.nullcontext()
    if config == "plugin_opaque_varying":
        return ca_dynsaved.enable(backend=backend, python_policy="opaque", cpp_policy="opaque")
    if config.startswith("plugin"):
        trace_cpp = TRACE_CPP if variant == "cpp_direct" else ()
        return ca_dynsaved.enable(backend=backend, trace_cpp=trace_cpp, verify=config != "plugin_trust_varying")
    return torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend=backend))


def train(
    loss_fn: Callable[[int, bool], torch.Tensor],
    params: list[torch.nn.Parameter],
    config: str,
    steps: int,
    backend: str,
    first: int = 0,
    variant: str = "",
) -> list[float]:
    """Seconds of each step (forward, backward, no optimizer); ``loss_fn(step,
    varying)`` runs the forward."""
    times = []
    for step in range(first, first + steps):
        for p in params:
            p.grad = None
        start = time.perf_counter()
        loss = loss_fn(step, config.endswith("varying"))
        with context(config, backend, variant):
            loss.backward()
        times.append(time.perf_counter() - start)
    return times


def _fresh() -> None:
    """A fresh process's compile state (each config is measured from one)."""
    ca_dynsaved.reset()
    torch._dynamo.utils.counters.clear()


def _counts() -> dict[str, int]:
    counters = torch._dynamo.utils.counters
    return {
        "compiles": counters["stats"]["unique_graphs"],
        "captures": counters["compiled_autograd"]["captures"],
        # per backward: the counter counts each capture's opaque nodes once
        "opaque_nodes": counters["ca_dynsaved"]["opaque_nodes"] // max(1, counters["compiled_autograd"]["captures"]),
        "breaks": sum(counters["graph_break"].values()),
    }


def measure(
    benchmark: Any,
    loss_fn: Callable[[int, bool], torch.Tensor],
    params: list[torch.nn.Parameter],
    configs: list[str],
    full_run: bool,
    results_file: Path | None = None,
    **labels: Any,
) -> dict[str, dict[str, Any]]:
    """Every config of one model variant, interleaved. First each config's first
    steps from a fresh state: the total (compiles included) and the counts. Then
    ``PASSES`` passes, each running every config in turn from a fresh state, warmed
    past its compiles (stock_varying: past the recompile limit, as in a long run),
    then timed: the machine's drift reaches every config alike, and the steady step
    is the smallest of a config's pass medians. Each pass starts one config later
    (a rotation), so no config always runs first after the previous pass's compiles.
    The quick mode checks the counts against ``results_file`` (default ``RESULTS``)."""
    # The quick mode (the suite) checks counts, not timings: no steady passes there.
    steps, steady_steps, warm, backend, passes = (50, 30, 10, "inductor", PASSES) if full_run else (8, 0, 0, "aot_eager", 0)
    if not full_run:
        # stock_varying's counts are torch's (recompiles to the limit, none of this
        # code's): the full run measures them, and were most of the quick mode's time.
        configs = [c for c in configs if c not in QUICK_SKIPS]
    variant = labels.get("variant", "")
    prefix = PREFIX.get(variant, 0) if full_run else 0
    warm = max(warm, prefix)
    results: dict[str, dict[str, Any]] = {}

    def first_steps() -> None:
        for config in configs:
            _fresh()
            times = train(loss_fn, params, config, steps, backend, variant=variant)
            results[config] = {**labels, "config": config, "backend": backend, "steps": steps,
                               "total_s": sum(times), **_counts(), "step_s": times}
            if prefix:  # measured on, and counted again there
                more = train(loss_fn, params, config, prefix - steps, backend, steps, variant)
                results[config].update(prefix_steps=prefix, prefix_s=sum(times) + sum(more),
                                       prefix_compiles=_counts()["compiles"])

    benchmark.pedantic(first_steps, rounds=1, iterations=1)
    medians: dict[str, list[float]] = {c: [] for c in configs}
    step = steps
    for n in range(passes):
        for config in configs[n % len(configs):] + configs[:n % len(configs)]:
            _fresh()
            gc.collect()
            train(loss_fn, params, config, warm, backend, step, variant)
            medians[config].append(statistics.median(train(loss_fn, params, config, steady_steps, backend, step + warm, variant)))
            step += warm + steady_steps
    _fresh()
    source = results_file or RESULTS
    committed = None if full_run else json.loads(source.read_text())["results"]
    for config, result in results.items():
        steady = min(medians[config]) if passes else statistics.median(result["step_s"][steps // 2:])
        result.update(steady_us=steady * 1e6, passes=passes)
        if committed is not None:
            _check_committed(result, committed, source.name)
    benchmark.extra_info.update({c: {k: v for k, v in r.items() if k != "step_s"} for c, r in results.items()})
    return results


def run_model(
    benchmark: Any, record: Callable[[dict[str, Any]], None], full_run: bool,
    name: str, model: torch.nn.Module, x: torch.Tensor, variant: str,
) -> dict[str, dict[str, Any]]:
    """``measure`` every config of a model variant (its saved values from
    ``models.values``) and record the results for the results file."""
    results = measure(
        benchmark,
        lambda step, varying: model(x, *values(variant, step, varying)),
        list(model.parameters()),
        [c for v, c in cases((variant,))],
        full_run,
        model=name,
        variant=variant,
    )
    for result in results.values():
        record(result)
    return results


#: What ``pytest benchmarks/ --benchmark-only`` writes (conftest) and report.py reads.
RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"
#: The counts of a run, which the committed results (and the tables and plot made
#: from them: README, docs/benchmarks.md) must show.
COUNTS = ("compiles", "captures", "opaque_nodes", "breaks")


def _check_committed(result: dict[str, Any], committed_results: list[dict[str, Any]], name: str) -> None:
    """The quick mode's counts are the full run's (the compile counts do not depend on
    the backend or on the steps past the recompile limit): the committed results file
    must show what the code does now, or the published tables are stale."""
    key = (result["model"], result["variant"], result["config"])
    rows = [r for r in committed_results if (r.get("model"), r.get("variant"), r.get("config")) == key]
    assert rows, f"{name} has no row for {key}: run `pytest benchmarks/ --benchmark-only`"
    committed = {k: rows[0].get(k) for k in COUNTS}
    assert committed == {k: result[k] for k in COUNTS}, (
        f"{name} is stale for {key}: it shows {committed}, the code gives "
        f"{ {k: result[k] for k in COUNTS} }; run `pytest benchmarks/ --benchmark-only` and `python benchmarks/report.py`"
    )

