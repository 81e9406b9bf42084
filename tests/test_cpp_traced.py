"""C++ functions that read their saved numbers with toSymInt() / toSymFloat(): traced
into the CA graph and fused, one compile for any values; every other C++ function
stays opaque, and the report says why."""

from __future__ import annotations

import pytest
import torch

import ca_dynsaved
from helpers import Counts, counts, leaf_grad_step, run_loop, scale_args, stock_enable
from test_python_ctx import ScaleFn

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release


def _a(i: int) -> int:
    return [0, 1, -3, 7, 2, 5, 9, 4, -1, 3, 6, 8][i]


def _s(i: int) -> float:
    return [0.0, 1.0, -0.5, 2.5, 1e-300, 3.0, -7.0, 0.25, 1e300, -0.0, 0.75, 4.5][i]


def _moderate(i: int) -> float:
    """A double a float32 op can take (leaky_relu refuses 1e300, in eager too)."""
    return 0.5 - i / 8


def _sym_step(fn, flag: bool = False, s=_s):
    return leaf_grad_step(lambda x, i: fn(x, _a(i), s(i), flag))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_symbolic_reader_is_traced_once(ext, backend):
    run_loop(_sym_step(ext.sym_scale_traceable), lambda: ca_dynsaved.enable(backend=backend, fullgraph=True))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = ca_dynsaved.report().nodes
    assert (node.handling, node.opaque) == ("traced-dynamic", False)
    assert node.reason == "reads its saved numbers symbolically (toSymInt/toSymFloat): a, s"
    c = torch._dynamo.utils.counters["ca_dynsaved"]
    assert (c["traced_cpp_nodes"], c["opaque_nodes"], c["cpp_probes"]) == (1, 0, 1)


def test_stock_specialises_the_symbolic_float(ext):
    """The baseline: under stock CA the same function recompiles for every new
    double (the backend specialises a float reaching aten.mul.Scalar), until the
    recompile limit."""
    run_loop(_sym_step(ext.sym_scale_traceable), stock_enable)
    assert counts() == Counts(captures=1, compiles=torch._dynamo.config.recompile_limit, graph_breaks=0)


#: function name -> (flag, handling, reason)
CASES = {
    # the symbolic probe's reason, then the sentinel traces' (cpp_policy="auto")
    "sym_branch_traceable": (False, "opaque", "saved 'a' is read as a plain number (guard a > 2); the ops it runs "
                             "depend on saved values (op 1 differs between two sentinel traces: a branch)"),
    "sym_leaky_traceable": (False, "opaque", "saved 's' (a double) reaches aten.leaky_relu.default, which would "
                            "specialise it; saved 's' (a double) reaches argument 1 of aten.leaky_relu.default, where "
                            "the backend would specialise it (only the scalar of mul/add/sub/div/pow on a floating "
                            "tensor can take it)"),
    "sym_scale_opaque": (False, "opaque", "not is_traceable: its backward is not traced"),
    # a constant bool: the first capture's combination is traced with sentinels
    "flagged": (True, "traced-dynamic", "traced with sentinels: uses its saved "
                "numbers only as op arguments: a, s; each new value verified; its hashed values (flag) constants "
                "of this graph"),
}


@pytest.mark.parametrize("case", CASES)
def test_what_stays_opaque_and_why(ext, case):  # and the one the sentinels trace
    flag, handling, reason = CASES[case]
    fn = ext.sym_scale_traceable if case == "flagged" else getattr(ext, case)
    run_loop(_sym_step(fn, flag, _moderate), lambda: ca_dynsaved.enable(backend="aot_eager", fullgraph=True))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = set(ca_dynsaved.report().nodes)
    assert (node.handling, node.reason) == (handling, reason)


def test_plain_reader_traced_with_sentinels(ext):
    """toInt()/toDouble() and numbers computed from them ((a + b) * s, 2 * t, a - b): the probe
    guards on the plain read, so the sentinel traces take the node; the computed
    values are lifted from verify's run of each new tuple."""
    run_loop(leaf_grad_step(lambda x, i: ext.scale_traceable(x, *scale_args(i))), lambda: ca_dynsaved.enable(backend="aot_eager"))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = ca_dynsaved.report().nodes
    assert node.handling == "traced-dynamic"
    assert node.reason == (
        "traced with sentinels: uses its saved numbers only as op arguments: none, and 3 values computed "
        "from them (lifted per new value); each new value verified"
    )


def test_traced_opaque_and_python_nodes_in_one_graph(ext):
    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        y = ext.sym_scale_traceable(x * 2, _a(i), _moderate(i), False)
        y = ext.scale_opaque(y, i, 1 - i, i / 4, 0.5)
        ScaleFn.apply(y, i, 0.5 + i).sum().backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="inductor", fullgraph=True))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    assert sorted(n.handling for n in ca_dynsaved.report().nodes) == ["opaque", "traced-dynamic", "traced-dynamic"]


def test_create_graph_through_a_traced_node(ext):
    for i in range(3):
        x = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64, requires_grad=True)
        with ca_dynsaved.enable(backend="aot_eager"):
            (g,) = torch.autograd.grad(ext.sym_scale_traceable(x * 2, _a(i), _s(i), False).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        x_e = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64, requires_grad=True)
        (g_e,) = torch.autograd.grad(ext.sym_scale_traceable(x_e * 2, _a(i), _s(i), False).sum(), x_e, create_graph=True)
        (gg_e,) = torch.autograd.grad(g_e.sum(), x_e)
        torch.testing.assert_close((g, gg), (g_e, gg_e))
