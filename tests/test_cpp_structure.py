"""Several inputs and outputs, saved tensors, None gradients, and the fallbacks."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import UndefinedGradError
from helpers import Counts, counts, leaf_grad_step, run_loop

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release


def _multi_step(fn):
    def step(i: int):
        a = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        b = torch.linspace(0.0, 2.0, 6)  # does not require grad
        c = torch.ones(6, requires_grad=True)  # its C++ grad is always undefined
        o1, o2 = fn(a * 2, b, c * 3, i, 0.25 * i)
        (o1.sum() + (o2 * o2).sum()).backward()
        return a.grad, b.grad, c.grad

    return step


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("variant", ["traceable", "opaque"])
def test_multi_io_none_grads(ext, backend, variant):
    results = run_loop(
        _multi_step(getattr(ext, f"multi_{variant}")),
        lambda: ca_dynsaved.enable(backend=backend, fullgraph=True),
    )
    # run_loop compared with eager; eager's None for b (no grad) and c (undefined).
    assert all(r[0] is not None and r[1] is None and r[2] is None for r in results)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)


def test_unused_output_gets_materialized_zero_grad(ext):
    """An output outside the loss: the backward sees a zeros grad, as in eager."""

    def step(i: int):
        a = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        b = torch.linspace(0.0, 2.0, 6, requires_grad=True)
        c = torch.ones(6, requires_grad=True)
        o1, _ = ext.multi_traceable(a, b, c, i, 0.5 * i)
        o1.sum().backward()
        return a.grad, b.grad, c.grad

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)


def _odd_none_step(fn):
    return leaf_grad_step(fn, size=4)


@pytest.mark.parametrize("variant", ["traceable", "opaque"])
def test_value_dependent_none_grad_raises_naming_the_node(ext, variant):
    """k even: a gradient; k odd: None. One opaque graph cannot express both."""
    step = _odd_none_step(getattr(ext, f"odd_none_{variant}"))
    with ca_dynsaved.enable(backend="aot_eager"):
        (g,) = step(0)
    torch.testing.assert_close(g, torch.zeros(4))
    with pytest.raises(UndefinedGradError, match=r"CppNode<OddNoneFn<.*>.*undefined gradient for input 0"):
        with ca_dynsaved.enable(backend="aot_eager"):
            step(1)
    # The plugin is still usable: an even value runs and matches eager.
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=1)


@pytest.mark.parametrize("variant", ["traceable", "opaque"])
def test_excluded_node_keeps_stock_behaviour(ext, variant):
    """exclude= keeps a node stock: value-dependent None grads then match eager."""
    step = _odd_none_step(getattr(ext, f"odd_none_{variant}"))
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager", exclude=["OddNoneFn"]), steps=4)
    (record,) = {n for n in ca_dynsaved.report().nodes}
    assert (record.opaque, record.reason) == (False, "excluded by enable(exclude=...)")
    # Stock numbers for 4 values: traced and guarded per value, or split around
    # the disabled call.
    expected = {"traceable": Counts(1, 4, 0), "opaque": Counts(1, 4, 2)}[variant]
    assert counts() == expected


def test_create_graph_double_backward_matches_eager(ext):
    """create_graph=True: the plugin's graph runs eagerly with the C++ backward
    recorded by autograd, so second-order gradients match eager; the same cached CA
    graph without create_graph stays compiled."""

    def grad(i: int, create_graph: bool, ctx):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        y = ext.scale_traceable(x * 2, i, 2, 0.5 + i, 1.0 - i).sum()
        with ctx:
            (g,) = torch.autograd.grad(y, x, create_graph=create_graph)
        return x, g

    plugin = torch._dynamo.utils.counters["ca_dynsaved"]
    opaque = lambda: ca_dynsaved.enable(backend="aot_eager", cpp_policy="opaque")  # noqa: E731 (the opaque op's path)
    for i in range(3):
        x, g = grad(i, True, opaque())
        (gg,) = torch.autograd.grad(g.sum(), x)  # eager double backward
        x_e, g_e = grad(i, True, contextlib.nullcontext())
        (gg_e,) = torch.autograd.grad(g_e.sum(), x_e)
        torch.testing.assert_close((g, gg), (g_e, gg_e))
    assert plugin["create_graph_eager_runs"] == 3
    for i in range(4):
        _, g = grad(i, False, opaque())
        torch.testing.assert_close(g, grad(i, False, contextlib.nullcontext())[1])
    assert plugin["create_graph_eager_runs"] == 3
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)


@pytest.mark.parametrize("variant", ["traceable", "opaque"])
def test_unexpected_layout_falls_back_to_stock(ext, variant, monkeypatch):
    """A torch whose CppNode call layout differs (simulated): the node is traced as
    stock CA traces it, gradients stay right, and the report says why."""
    from ca_dynsaved._compat import layout

    monkeypatch.setattr(layout, "CPP_NODE_TRAILING_ARGS", layout.CPP_NODE_TRAILING_ARGS + 1)

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        getattr(ext, f"scale_{variant}")(x * 2, i, 1, 0.5, 2.0).sum().backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=3)
    (record,) = ca_dynsaved.report().nodes
    assert not record.opaque
    assert "unexpected CppNode argument layout" in record.reason
    # Stock numbers: a compile per value (traced) or a graph split around the call.
    expected = {"traceable": Counts(1, 3, 0), "opaque": Counts(1, 3, 2)}[variant]
    assert counts() == expected


def test_cpp_call_is_parsed_once_into_a_record_that_round_trips(ext, monkeypatch):
    """CA's packed C++ call arguments are parsed once, where the capture receives
    them, into ``_compat.layout.CppCall``; the record gives back CA's layout unchanged, and
    the node's parts are where the C++ code put them (4 saved numbers, one saved
    tensor, one forward output)."""
    from ca_dynsaved._compat import layout

    parses: list[Any] = []
    parse = layout.CppCall.parse

    def counting(args):
        parses.append(args)
        return parse(args)

    monkeypatch.setattr(layout.CppCall, "parse", staticmethod(counting))
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    with ca_dynsaved.enable(backend="aot_eager"):
        ext.scale_traceable(x * 2, 3, 1, 0.5, 2.0).sum().backward()
    (args,) = parses  # one custom-function node, parsed once
    call = parse(args)
    assert call.name == layout.cpp_node_name(args) and call.name.startswith("torch::autograd::CppNode<")
    kinds = {key: type(value) for key, value in zip(call.keys, call.values)}
    assert kinds == {"a": torch.SymInt, "b": torch.SymInt, "s": torch.SymFloat, "t": torch.SymFloat}
    assert len(call.saved) == 1 and isinstance(call.saved[0], torch.Tensor)
    assert len(call.output_info) == 1
    rebuilt, n = call.args(), len(call.keys)
    assert len(rebuilt) == len(args) and list(rebuilt[0]) == list(args[0])
    assert all(r is a for r, a in zip(rebuilt[1 : 1 + n], args[1 : 1 + n]))  # the values
    assert all(r is a for r, a in zip(rebuilt[1 + n], args[1 + n], strict=True))  # saved tensors
    assert all(r is a for r, a in zip(rebuilt[2 + n :], args[2 + n :], strict=True))  # the rest
