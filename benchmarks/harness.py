"""One measurement: a model trained under one configuration, timed and counted.

Configurations: ``eager``; stock compiled autograd with saved values that never
change (``stock_constant``, the floor) and that change every step
(``stock_varying``); the plugin with values changing (``plugin_varying``), and, for
Python functions, the plugin with ``python_policy="opaque"`` (``plugin_opaque_varying``:
what tracing with dynamic ctx numbers gains over running the backward opaque).
The ``cpp_direct`` variant's plugin configs opt it in with ``trace_cpp``:
``plugin_varying`` verifies each new value (the default), ``plugin_trust_varying``
does not (``verify=False``): their difference is verify's cost per new value.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Any, Callable

import torch

import ca_dynsaved
from models import TRACE_CPP, values

CONFIGS = ("eager", "stock_constant", "stock_varying", "plugin_varying", "plugin_opaque_varying", "plugin_trust_varying")
#: Configs that only concern one variant.
ONLY = {"plugin_opaque_varying": "python", "plugin_trust_varying": "cpp_direct"}
#: Steady-state passes: the step time is the smallest of their medians (this
#: machine is noisy; the minimum is the least disturbed pass).
PASSES = 3


def cases(variants: tuple[str, ...]) -> list[tuple[str, str]]:
    """(variant, config) pairs: python_policy only concerns Python functions."""
    return [(v, c) for v in variants for c in CONFIGS if ONLY.get(c, v) == v]


def context(config: str, backend: str, variant: str = "") -> contextlib.AbstractContextManager[Any]:
    if config == "eager":
        return contextlib.nullcontext()
    if config == "plugin_opaque_varying":
        return ca_dynsaved.enable(backend=backend, python_policy="opaque")
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


def measure(
    benchmark: Any,
    loss_fn: Callable[[int, bool], torch.Tensor],
    params: list[torch.nn.Parameter],
    config: str,
    full_run: bool,
    **labels: Any,
) -> dict[str, Any]:
    """Total of the first steps (compiles included), then the steady step time."""
    steps, steady_steps, backend = (50, 30, "inductor") if full_run else (8, 3, "aot_eager")
    times: list[float] = []
    variant = labels.get("variant", "")
    benchmark.pedantic(
        lambda: times.extend(train(loss_fn, params, config, steps, backend, variant=variant)), rounds=1, iterations=1
    )
    passes = []
    for n in range(PASSES):
        gc.collect()
        first = steps + n * steady_steps
        passes.append(statistics.median(train(loss_fn, params, config, steady_steps, backend, first, variant)))
    counters = torch._dynamo.utils.counters
    result = {
        **labels,
        "config": config,
        "backend": backend,
        "steps": steps,
        "total_s": sum(times),
        "steady_us": min(passes) * 1e6,
        "passes": PASSES,
        "compiles": counters["stats"]["unique_graphs"],  # in all steps
        "captures": counters["compiled_autograd"]["captures"],
        # per backward: the counter counts each capture's opaque nodes once
        "opaque_nodes": counters["ca_dynsaved"]["opaque_nodes"] // max(1, counters["compiled_autograd"]["captures"]),
        "step_s": times,
    }
    benchmark.extra_info.update({k: v for k, v in result.items() if k != "step_s"})
    return result


def run_model(
    benchmark: Any, record: Callable[[dict[str, Any]], None], full_run: bool,
    name: str, model: torch.nn.Module, x: torch.Tensor, variant: str, config: str,
) -> dict[str, Any]:
    """``measure`` a model's training steps (its saved values from ``models.values``)
    and record the result for the results file."""
    result = measure(
        benchmark,
        lambda step, varying: model(x, *values(variant, step, varying)),
        list(model.parameters()),
        config,
        full_run,
        model=name,
        variant=variant,
    )
    record(result)
    return result
