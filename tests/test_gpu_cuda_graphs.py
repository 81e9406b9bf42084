"""On a CUDA GPU: the plugin under inductor and inductor's CUDA graphs
(``mode="reduce-overhead"``), saved values changing every step.

What could go wrong: a CUDA graph replays the kernels it recorded without running
Python, so an opaque op recorded into one would replay its first step's saved
values (a wrong gradient from the second step on). Each step here is compared with
eager. The CUDA-graph outcome (skips, graphs recorded) is compared with stock
compiled autograd on the same model with constant values: the plugin must not cost
the rest of the graph its CUDA graphs.

Skipped without CUDA (CI has none). ``bash tests/run_gpu.sh`` runs this module on a
GPU machine and writes the outcome (``CA_DYNSAVED_GPU_REPORT``, JSON) for the README.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

import ca_dynsaved
from helpers import Counts, assert_grads_equal, counts, scale_args, stock_enable
from test_python_ctx import ScaleFn, pool

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: run `bash tests/run_gpu.sh` on one (README, GPU and CUDA graphs)",
    ),
    # collected (imported) on every release, run where there is a GPU
    pytest.mark.every_release,
]

DEVICE = "cuda"
STEPS = 12
KINDS = ("cpp", "cpp_traced", "python_opaque", "python_traced")
#: backend label -> torch.compile mode
MODES = {"inductor": None, "reduce-overhead": "reduce-overhead"}
_OUTCOMES: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_outcomes():
    yield
    path = os.environ.get("CA_DYNSAVED_GPU_REPORT")
    if path and _OUTCOMES:
        info = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
        with open(path, "w") as f:
            json.dump({"environment": info, "cases": _OUTCOMES}, f, indent=2, sort_keys=True)


def _model_step(ext, kind: str, vary: bool) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """A step on CUDA: elementwise math, the custom function, more math, backward."""
    # float64: fused kernels and eager agree to ~1e-15 (in float32, to ~1e-4).
    w = torch.randn(4096, device=DEVICE, dtype=torch.float64, generator=torch.Generator(DEVICE).manual_seed(0))

    def step(i: int):
        j = i if vary else 3
        x = torch.randn(
            4096, device=DEVICE, dtype=torch.float64, generator=torch.Generator(DEVICE).manual_seed(i)
        )
        x.requires_grad_(True)
        h = (x * w).sin()
        if kind == "cpp":  # opaque: a C++ function reading toInt()/toDouble()
            h = ext.scale_traceable(h, *scale_args(j))
        elif kind == "cpp_traced":  # traced: toSymInt()/toSymFloat(), packed double on the CPU
            h = ext.sym_scale_traceable(h, j + 2, 0.5 - j / 8, False)
        elif kind == "python_opaque":  # opaque: a float-schema op in its backward
            h = pool(h, 0.25 + j / 2, j + 1)
        else:  # traced, its ctx numbers dynamic (a float tensorified by the backend)
            h = ScaleFn.apply(h, j, 1.0 - j / 4)
        h.cos().sum().backward()
        return (x.grad,)

    return step


def _run(step, ctx_factory) -> dict[str, Any]:
    """Every step against eager; the counts and the CUDA-graph outcome."""
    recorded = []
    init = cudagraph_trees.CUDAGraphNode.__init__

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        recorded.append(1)  # one CUDAGraphNode per recorded CUDA graph
        init(self, *args, **kwargs)

    cudagraph_trees.CUDAGraphNode.__init__ = spy
    try:
        for i in range(STEPS):
            torch.compiler.cudagraph_mark_step_begin()
            with ctx_factory():
                got = [g.clone() for g in step(i)]
            with torch._dynamo.compiled_autograd._disable():
                want = step(i)
            assert_grads_equal(got, want)
    finally:
        cudagraph_trees.CUDAGraphNode.__init__ = init
    return {
        "counts": dataclasses.asdict(counts()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cuda_graphs_recorded": len(recorded),
    }


def _fresh() -> None:
    ca_dynsaved.reset()
    counters.clear()


@pytest.mark.parametrize("backend", sorted(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_eager_every_step(ext, kind, backend):
    mode = MODES[backend]
    stock = _run(_model_step(ext, kind, vary=False), lambda: stock_enable("inductor", mode=mode))
    _fresh()
    plugin = _run(_model_step(ext, kind, vary=True), lambda: ca_dynsaved.enable(mode=mode))
    _OUTCOMES[f"{kind}/{backend}"] = {
        "stock_constant": stock,
        "plugin_varying": plugin,
    }
    one = dataclasses.asdict(Counts(captures=1, compiles=1, graph_breaks=0))
    assert plugin["counts"] == stock["counts"] == one
    if mode is None:
        assert plugin["cuda_graphs_recorded"] == stock["cuda_graphs_recorded"] == 0
    else:
        # The opaque op runs between CUDA-graphed partitions: no more skips than stock,
        # and CUDA graphs wherever stock has them.
        assert plugin["cudagraph_skips"] <= stock["cudagraph_skips"]
        assert (plugin["cuda_graphs_recorded"] > 0) == (stock["cuda_graphs_recorded"] > 0)


@pytest.mark.parametrize("kind", ["cpp", "python_opaque"])
def test_without_partitioning_the_graph_skips_cuda_graphs(ext, kind):
    """Without graph partitioning inductor cannot split around the op: it skips CUDA
    graphs for the whole CA graph, and the gradients stay right."""
    with torch._inductor.config.patch(graph_partition=False):
        outcome = _run(
            _model_step(ext, kind, vary=True), lambda: ca_dynsaved.enable(mode="reduce-overhead")
        )
    _OUTCOMES[f"{kind}/reduce-overhead, graph_partition=False"] = {
        "plugin_varying": outcome
    }
    assert outcome["counts"] == dataclasses.asdict(Counts(captures=1, compiles=1, graph_breaks=0))
    assert outcome["cudagraph_skips"] == 1
    assert outcome["cuda_graphs_recorded"] == 0


@pytest.mark.parametrize("backend", sorted(MODES))
def test_checkpointed_region(backend):
    """A non-reentrant checkpoint around a traced Python function, on CUDA: the unpack
    op (which recomputes the region, in Python) runs between CUDA-graphed partitions,
    never recorded into one; one compile, no break, eager's gradients every step."""
    import torch.utils.checkpoint as cp

    w = torch.randn(4096, device=DEVICE, dtype=torch.float64, generator=torch.Generator(DEVICE).manual_seed(0))
    recomputed = [0]

    def block(h: torch.Tensor, j: int) -> torch.Tensor:
        recomputed[0] += 1
        return ScaleFn.apply((h * w).sin(), j, 1.0 - j / 4).tanh()

    def step(i: int):
        x = torch.randn(4096, device=DEVICE, dtype=torch.float64, generator=torch.Generator(DEVICE).manual_seed(i))
        x.requires_grad_(True)
        cp.checkpoint(block, x * 2, i, use_reentrant=False).cos().sum().backward()
        return (x.grad,)

    outcome = _run(step, lambda: ca_dynsaved.enable(mode=MODES[backend]))
    _OUTCOMES[f"checkpoint/{backend}"] = {"plugin_varying": outcome}
    assert outcome["counts"] == dataclasses.asdict(Counts(captures=1, compiles=1, graph_breaks=0))
    assert recomputed[0] == 4 * STEPS  # forward and recomputation, plugin and eager
    if MODES[backend] is not None:
        assert outcome["cuda_graphs_recorded"] > 0
