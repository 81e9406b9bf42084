"""A Python backward stock would recompile for or break the graph at runs opaque
until its capture has run ``tiers.SPECIALISE_AFTER_RUNS`` times with steady
sizes, then as stock runs it (its graph-broken pieces fused), back to opaque for
good where stock's graph keeps recompiling or runs slower (``ways.tiered.wrap``,
``tiers.RECOMPILING_RUNS``, ``tiers.TIMED_RUNS``); never handed to stock
where stock's graph would not run as eager does."""

from __future__ import annotations

import bisect

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import tiers
from ca_dynsaved.ways import tiered
from helpers import Counts, assert_grads_equal, counts, on_whole_suite_release, run_loop, stock_counts
from test_python_auto import ModFn
from test_python_ctx import AnyScalarFn

_TABLE = (1, 3, 5, 8)


def _lookup(n: int) -> float:
    """A C builtin Dynamo has no rule for: the backward breaks the graph here."""
    return float(bisect.bisect_right(_TABLE, n))


class ScaledLookup(torch.autograd.Function):
    """A ctx float into tensor math, a ctx int through the untraceable helper."""

    @staticmethod
    def forward(ctx, x, scale, k):
        ctx.scale, ctx.k = scale, k
        ctx.save_for_backward(x)
        return x * x * scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x * (2 * ctx.scale) * _lookup(ctx.k), None, None


class ModeLookup(torch.autograd.Function):
    """A ctx float into tensor math, a ctx str through the untraceable helper: the
    probe traces it, Dynamo breaks the graph at the helper."""

    @staticmethod
    def forward(ctx, x, scale, mode):
        ctx.scale, ctx.mode = scale, mode
        ctx.save_for_backward(x)
        return x * x * scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x * (2 * ctx.scale) * _lookup(len(ctx.mode)), None, None


def _step(values, fn=ScaledLookup):
    """``step(i)``: a leaf of a fixed size, ``ScaledLookup`` with ``values(i)``."""

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        fn.apply(x * 2, *values(i)).sum().backward()
        return (x.grad,)

    return step


@pytest.fixture
def promote_at_3(monkeypatch):
    monkeypatch.setattr(tiers, "SPECIALISE_AFTER_RUNS", 3)


def _capture() -> dict:
    (capture,) = ca_dynsaved.report().to_dict()["captures"]
    return capture


@pytest.mark.every_release
def test_values_that_repeat_get_stocks_graph(promote_at_3):
    """Constant values: opaque for two runs (one compile), then stock's pieces at
    run 3 (stock's compiles and breaks), which never recompile: stock's counts plus
    the opaque graph's compile, gradients equal eager at every step."""
    step = _step(lambda i: (1.5, 4))
    stock = stock_counts(step, 8)
    if on_whole_suite_release():
        assert stock == Counts(captures=1, compiles=4, graph_breaks=3)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=2)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    assert counts() == Counts(captures=1, compiles=stock.compiles + 1, graph_breaks=stock.graph_breaks)
    capture = _capture()
    assert (capture["specialised"], capture["despecialised"]) == (3, 0)
    (node,) = capture["nodes"]
    assert (node["handling"], node["reason"]) == ("opaque", "ctx.k needs its value (guard ctx.k >= 5)")


def test_a_float_that_changes_is_made_dynamic_once(promote_at_3):
    """A new float every step: stock's graph recompiles once (Dynamo makes it a
    symbol) and stays; so does the plugin's after run 3."""
    step = _step(lambda i: (1.0 + i / 8, 4))
    stock = stock_counts(step, 10)
    assert stock == Counts(captures=1, compiles=5, graph_breaks=4)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=10)
    assert counts() == Counts(captures=1, compiles=6, graph_breaks=4)
    capture = _capture()
    assert (capture["specialised"], capture["despecialised"]) == (3, 0)


def test_a_value_stock_recompiles_for_goes_back_to_opaque(promote_at_3):
    """A str the backward reads, new every step: stock's graph compiles for each
    one (stock: to Dynamo's recompile limit). The plugin's takes over at run 3 and
    compiles again at runs 4, 5 and 6; after the third, the capture runs its opaque
    graph for good: no compile, no break after that."""
    step = _step(lambda i: (1.5, f"m{i}"), ModeLookup)
    assert stock_counts(step, 14) == Counts(captures=1, compiles=11, graph_breaks=10)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    assert counts() == Counts(captures=1, compiles=8, graph_breaks=6)
    capture = _capture()
    assert (capture["specialised"], capture["despecialised"]) == (3, 6)
    assert capture["nodes"][0]["reason"].startswith("backward not traceable by Dynamo: ")
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=8)
    assert counts() == Counts(captures=1, compiles=8, graph_breaks=6)


def test_create_graph_after_stocks_graph_took_over(promote_at_3):
    """A double backward after the promotion: the capture's graph runs with the
    backward called directly, equal to eager."""
    step = _step(lambda i: (1.5, 4))
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=4)
    assert _capture()["specialised"] == 3

    def grads(x):
        (g,) = torch.autograd.grad(ScaledLookup.apply(x * 2, 1.5, 4).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad((g * g).sum(), x)
        return g.detach(), gg

    x, x_e = (torch.linspace(-1.0, 1.0, 6, requires_grad=True) for _ in range(2))
    with ca_dynsaved.enable(backend="aot_eager"):
        got = grads(x)
    assert_grads_equal(got, grads(x_e))


def _clocked(monkeypatch, opaque_s: float, stock_s: float) -> None:
    """Each tiered run's measured time: ``opaque_s`` before the switch to stock's
    graph, ``stock_s`` after it (the choice, not this machine's noise, is tested)."""

    def timed(fn, *args):
        switched = ca_dynsaved.report().captures[0].specialised
        return fn(*args), stock_s if switched else opaque_s

    monkeypatch.setattr(tiered, "_timed", timed)


@pytest.mark.every_release
@pytest.mark.parametrize("stock_faster", [True, False])
def test_the_faster_graph_is_kept(promote_at_3, monkeypatch, stock_faster):
    """After the switch, ``TIMED_RUNS`` (8) runs of stock's graph that compile
    nothing (runs 4-11) against the opaque graph's before it: stock's graph stays
    where it is faster, else the capture goes back to its opaque graph at run 11.
    Either way no compile after the switch's, gradients equal eager."""
    _clocked(monkeypatch, 2e-3, 1e-3 if stock_faster else 3e-3)
    step = _step(lambda i: (1.5, 4))
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=3)
    switched = counts()
    run_loop(lambda i: step(i + 3), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=11)
    assert counts() == switched
    if on_whole_suite_release():
        assert switched == Counts(captures=1, compiles=5, graph_breaks=3)
    capture = _capture()
    assert capture["tier_times_us"] == pytest.approx((2e3, 1e3 if stock_faster else 3e3))
    assert (capture["specialised"], capture["despecialised"]) == (3, 0 if stock_faster else 11)


class ClassmethodBackward(torch.autograd.Function):
    """A classmethod backward (as entmax's): Dynamo fails on it, so stock's compile
    of the CA graph would raise."""

    @staticmethod
    def forward(ctx, x, mode):
        ctx.mode = mode
        ctx.save_for_backward(x)
        return x * x

    @classmethod
    def backward(cls, ctx, g):
        (x,) = ctx.saved_tensors
        return g * x * 2.0, None


#: name -> (apply, the reason's start): backwards stock's graph would not run as eager
NEVER_STOCK = {
    "dynamo_fails": (lambda x, i: ClassmethodBackward.apply(x, "a"), "backward not traceable by Dynamo: tracing it failed"),
    # test_python_auto's ModFn: ctx.k % 1000 in float math, which the backend cannot rebuild
    "float_not_rebuilt": (lambda x, i: ModFn.apply(x, 1003 + i, 0.5), "ctx.k reaches"),
    # test_python_ctx's AnyScalarFn: an int beyond int64, which stock's compile refuses
    "int_beyond_int64": (lambda x, i: AnyScalarFn.apply(x, 2**64 + 3 * i), "ctx.v is an int beyond int64"),
}


@pytest.mark.parametrize("case", NEVER_STOCK)
def test_a_backward_stock_cannot_run_is_never_handed_to_it(promote_at_3, case):
    """Where stock's compile would raise (Dynamo fails on the backward, a float the
    backend cannot rebuild, an int beyond int64), the node is not tiered: opaque at
    every run, one compile, never stock's graph."""
    apply, reason = NEVER_STOCK[case]

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        apply(x * 2, i).sum().backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=8)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    capture = _capture()
    assert capture["specialised"] == 0
    assert capture["nodes"][0]["handling"] == "opaque" and capture["nodes"][0]["reason"].startswith(reason)


class ClassmethodSpecialising(torch.autograd.Function):
    """A ctx int the backward needs the value of (the probe refuses it), in a
    classmethod backward Dynamo fails on: the probe alone would tier it."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * 1.0

    @classmethod
    def backward(cls, ctx, g):
        return g * (2.0 if ctx.k > 2 else 3.0), None


def test_a_specialising_backward_dynamo_fails_on_is_never_handed_to_stock(promote_at_3):
    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        ClassmethodSpecialising.apply(x * 2, i).sum().backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=8)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    capture = _capture()
    assert capture["specialised"] == 0
    assert capture["nodes"][0]["reason"] == "ctx.k needs its value (guard ctx.k > 2)"  # the probe's, as before


def test_a_value_dependent_none_after_the_switch_is_eagers(promote_at_3):
    """Opaque, a step of the other parity raises UndefinedGradError (the opaque
    op cannot return None where the capture learned a tensor); from run 3, stock's
    graph, guarded on the parity, gives eager's None and eager's gradient in turn."""
    from test_python_ctx import OddNoneFn

    def step(k: int):
        x, y = (torch.linspace(-1.0, 1.0, 6, requires_grad=True) for _ in range(2))
        (OddNoneFn.apply(x * 2, k) + y).sum().backward()
        return x.grad, y.grad

    run_loop(lambda i: step(2), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=1)
    with pytest.raises(ca_dynsaved.UndefinedGradError, match="OddNoneFn"):
        with ca_dynsaved.enable(backend="aot_eager"):
            step(3)
    results = run_loop(lambda i: step(i + 3), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    assert _capture()["specialised"] == 3
    assert [grads[0] is None for grads in results] == [True, False, True, False, True, False]


def test_sizes_that_keep_changing_keep_the_opaque_graph(promote_at_3):
    """Sizes new at every run (three in turn): stock's graph-broken pieces would
    recompile for them (pytorch_wavelets' round trip: 29 compiles in 8 steps), so
    the capture is not switched while they change: the opaque graph's two compiles
    (its sizes static, then dynamic), no break. Once the sizes hold for two runs
    in a row after a first (promote_at_3: min(TIMED_RUNS, 3 - 1)), stock's graph."""

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, (5, 7, 9)[i % 3] if i < 9 else 6, requires_grad=True)
        ModeLookup.apply(x * 2, 1.5, "ab").sum().backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=9)
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=0)
    assert _capture()["specialised"] == 0
    run_loop(lambda i: step(i + 9), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=4)
    assert _capture()["specialised"] == 12  # steps 9-11 of size 6: the third
    assert counts() == Counts(captures=1, compiles=6, graph_breaks=3)


def _mixed_step(mode):
    """ScaledLookup (tiered: Dynamo breaks at it) then test_properties' PyScaleFn
    (traced, its ctx.mode guarded: ``mode(i)``) in one capture."""
    from test_properties import PyScaleFn

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        y = ScaledLookup.apply(x * 2, 1.5, 4)
        PyScaleFn.apply(y, 3, 0.5 + i, False, mode(i)).sum().backward()
        return (x.grad,)

    return step


def test_a_guarded_node_beside_a_tiered_one_takes_the_capture_s_way(promote_at_3):
    """Both nodes are opaque in the capture's opaque graph, which runs first (the
    tiered node's way, ``ways.tiered.MEASURED``); from run 3 the graph with both traced,
    where a new ctx.mode compiles (Dynamo's guard) until the capture's churn rule
    sends it back to its opaque graph for good: a str new every step ends
    compiled, with no more compiles (stock: to Dynamo's recompile limit). Eager's
    gradients at every step."""
    step = _mixed_step(lambda i: f"m{i}")
    assert stock_counts(step, 16) == Counts(captures=1, compiles=11, graph_breaks=10)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=8)
    assert counts() == Counts(captures=1, compiles=8, graph_breaks=6)
    capture = _capture()
    assert (capture["specialised"], capture["despecialised"]) == (3, 6)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=8)
    assert counts() == Counts(captures=1, compiles=8, graph_breaks=6)


def test_guarded_values_create_graph():
    """A double backward through a traced node with a guarded ctx.mode: the traced
    graph compiled as stock compiles it (a capture with create_graph and one
    without), never the opaque graph's eager run; equal to eager throughout, fewer
    compiles than stock (ctx.s new every step: one compile, not two, each)."""
    from test_properties import PyScaleFn

    def grads(i: int, create_graph: bool):
        x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(PyScaleFn.apply(x * x, 3, 0.5 + i, False, "square").sum(), x, create_graph=create_graph)
        if create_graph:
            (g,) = torch.autograd.grad(g.sum(), x)
        return (g,)

    sequence = [True, False, False, True, False]
    assert stock_counts(lambda i: grads(i, sequence[i]), 5) == Counts(captures=3, compiles=5, graph_breaks=0)
    for i, create_graph in enumerate(sequence):
        with ca_dynsaved.enable(backend="aot_eager"):
            got = grads(i, create_graph)
        assert_grads_equal(got, grads(i, create_graph))
    assert counts() == Counts(captures=2, compiles=3, graph_breaks=0)
    assert torch._dynamo.utils.counters["ca_dynsaved"]["create_graph_eager_runs"] == 0


@pytest.mark.every_release
@pytest.mark.parametrize("fn", ["guarded", "tiered"])
def test_a_leaf_s_gradient_straight_from_the_node(promote_at_3, fn):
    """The node's input is a leaf: CA pulls its accumulate_grad up to right after the
    traced output, before the opaque op, which the opaque graph then feeds (its order
    fixed before CA's dead-code pass lints it). A guarded node (a ctx str beside a
    float) and a tiered one (Dynamo breaks at it); eager's gradients, stock's
    compiles or fewer."""
    from test_properties import PyScaleFn

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        if fn == "guarded":
            PyScaleFn.apply(x, 3, 0.5 + i, False, "square").sum().backward()
        else:
            ScaledLookup.apply(x, 1.5, 4).sum().backward()
        return (x.grad,)

    stock = stock_counts(step, 6)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    if fn == "guarded":  # the float dynamic from the first compile; stock: constant, then dynamic
        assert (stock.compiles, counts()) == (2, Counts(captures=1, compiles=1, graph_breaks=0))
    else:  # stock's graph from run 3, the opaque graph's compile before it
        assert counts() == Counts(captures=1, compiles=stock.compiles + 1, graph_breaks=stock.graph_breaks)
