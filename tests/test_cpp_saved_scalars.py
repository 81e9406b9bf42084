"""C++ saved_data ints and doubles: one compile of the CA graph for any values."""

from __future__ import annotations

import pytest
import torch

import ca_dynsaved
from helpers import Counts, counts, leaf_grad_step, run_loop, scale_args, stock_enable

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release


def _scale_step(fn):
    return leaf_grad_step(lambda x, i: fn(x, *scale_args(i)))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("variant", ["traceable", "opaque"])
def test_one_compile_for_twelve_values(ext, backend, variant):
    fn = getattr(ext, f"scale_{variant}")
    run_loop(_scale_step(fn), lambda: ca_dynsaved.enable(backend=backend, fullgraph=True))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    nodes = ca_dynsaved.report().nodes
    # traceable: traced with sentinels (its s + t + a - b lifted from verify's run)
    assert [(n.opaque, n.keys and sorted(zip(n.keys, n.kinds))) for n in nodes] == [
        (variant == "opaque", [("a", "int"), ("b", "int"), ("s", "float"), ("t", "float")])
    ]


def test_stock_traceable_recompiles_until_the_limit(ext):
    """The baseline the plugin removes (torch 2.13): one compile per value, up to 8."""
    run_loop(_scale_step(ext.scale_traceable), stock_enable)
    assert counts() == Counts(
        captures=1, compiles=torch._dynamo.config.recompile_limit, graph_breaks=0
    )


def test_stock_non_traceable_breaks_the_graph(ext):
    run_loop(_scale_step(ext.scale_opaque), stock_enable)
    # The graph splits around the disabled C++ call: 3 graphs, 2 breaks recorded.
    assert counts() == Counts(captures=1, compiles=3, graph_breaks=2)


def test_stock_fullgraph_errors_on_new_value(ext):
    """Stock with fullgraph=True cannot even run the loop; the plugin can (above)."""
    step = _scale_step(ext.scale_traceable)
    with pytest.raises(Exception, match="(?i)recompil|fail_on_recompile|limit"):
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            for i in range(3):
                with stock_enable(fullgraph=True):
                    step(i)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_changing_shapes_cost_what_they_cost_stock(ext, backend):
    """Sizes that change are handled as stock handles them (automatic dynamic: one
    recompile); values changing as well add nothing under the plugin."""

    def step(values_vary: bool):
        def run(i: int):
            x = torch.linspace(-1.0, 1.0, 4 + i, requires_grad=True)
            ext.scale_traceable(x * 2, *scale_args(i if values_vary else 3)).sum().backward()
            return (x.grad,)

        return run

    run_loop(step(False), lambda: stock_enable(backend), steps=6)
    stock = counts()
    assert stock == Counts(captures=1, compiles=2, graph_breaks=0)
    ca_dynsaved.reset()
    torch._dynamo.utils.counters.clear()
    run_loop(step(True), lambda: ca_dynsaved.enable(backend=backend), steps=6)
    assert counts() == stock
