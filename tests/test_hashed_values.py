"""C++ bool / str / list / dict saved values: one compile across recaptures."""

from __future__ import annotations

import re

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import decision, reuse, tiers
from helpers import Counts, counts, leaf_grad_step, run_loop, stock_counts, stock_enable

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release

# (flip, mode, dims, (wa, wb)): every field changes the backward; D's list is longer.
COMBOS = [
    (False, "square", [1, 2], (1.0, 2.0)),
    (True, "square", [1, 2], (1.0, 2.0)),
    (False, "linear", [3], (0.5, 2.0)),
    (True, "linear", [2, 2, 2], (1.5, -1.0)),
]


def _config_step(fn):
    def apply(x, i):
        flip, mode, dims, (wa, wb) = COMBOS[i % len(COMBOS)]
        return fn(x, flip, mode, dims, wa, wb)

    return leaf_grad_step(apply)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("variant", ["traceable", "opaque"])
def test_four_combinations_one_compile(ext, backend, variant):
    """Hashed values only (no saved numbers). Non-traceable: every capture opaque,
    one compiled graph reused. Traceable: the first capture's combination as stock
    traces it (fused, the values constants); the 3 later ones opaque and uncompiled
    (eager) until their capture's run SPECIALISE_AFTER_RUNS, which 2 runs never reach."""
    results = run_loop(
        _config_step(getattr(ext, f"config_{variant}")),
        lambda: ca_dynsaved.enable(backend=backend, fullgraph=True),
        steps=8,
    )
    # Each combination really has its own gradient (and run_loop matched eager).
    grads = [r[0] for r in results[:4]]
    assert all(not torch.allclose(grads[i], grads[j]) for i in range(4) for j in range(i))
    assert counts() == Counts(captures=4, compiles=1, graph_breaks=0)
    plugin = torch._dynamo.utils.counters["ca_dynsaved"]
    captures = ca_dynsaved.report().captures
    if variant == "opaque":
        assert (plugin["reuse_misses"], plugin["reuse_hits"]) == (1, 3)
        assert [c.compiled for c in captures] == ["compiled"] + ["reused"] * 3
        return
    assert (plugin["reuse_misses"], plugin["reuse_hits"], plugin["held_eager_runs"]) == (0, 0, 6)
    assert [(n.handling, n.reason) for c in captures for n in c.nodes] == [("stock", decision.HASHED_ONLY)] + [
        ("opaque", f"no saved ints or doubles; {decision._LATER_COMBINATION}: {decision._tiered()}")
    ] * 3


def test_hashed_only_never_changing_is_stock(ext):
    """Hashed values that never change: stock's counts and stock's graph (the graph
    Dynamo hands the backend, so inductor fuses what it fuses under stock; no opaque
    op), eager's gradients."""
    step = leaf_grad_step(lambda x, i: ext.config_traceable(x, *_args(1)))
    codes: dict[str, list[str]] = {"stock": [], "plugin": []}

    def seen(into: list[str]):  # the backend: records the graph Dynamo gives it
        def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
            # symbols and bound functions are numbered per process
            into.append(re.sub(r"\b(s|\w*cpp_?node\w*?)\d+\b", r"\1", gm.code, flags=re.IGNORECASE))
            return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)

        return backend

    stock = stock_counts(step, 4, lambda: stock_enable(backend=seen(codes["stock"]), fullgraph=True))
    run_loop(step, lambda: ca_dynsaved.enable(backend=seen(codes["plugin"]), fullgraph=True), steps=4)
    assert counts() == stock == Counts(captures=1, compiles=1, graph_breaks=0)
    assert len(codes["plugin"]) == 1 and codes["plugin"] == codes["stock"]
    (node,) = ca_dynsaved.report().captures[0].nodes
    assert (node.handling, node.reason) == ("stock", decision.HASHED_ONLY)
    keys = ca_dynsaved.report().functions[node.name].keys.values()
    assert {(k.handling, k.fix) for k in keys} == {("stock", "")}  # no rewrite advised
    assert all("a constant of the node's traced graph" in k.reason for k in keys)
    assert torch._dynamo.utils.counters["ca_dynsaved"]["opaque_nodes"] == 0


def test_hashed_only_cycling_compiles_as_stock(ext, monkeypatch):
    """4 combinations in turn: the later ones get their own graph (stock's trace) at
    their capture's run SPECIALISE_AFTER_RUNS: 4 compiles in all, stock's count."""
    monkeypatch.setattr(tiers, "SPECIALISE_AFTER_RUNS", 3)
    step = _config_step(ext.config_traceable)
    stock = stock_counts(step, 16)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager", fullgraph=True), steps=16)
    assert counts() == stock == Counts(captures=4, compiles=4, graph_breaks=0)
    assert [c.specialised for c in ca_dynsaved.report().captures] == [0, 3, 3, 3]
    plugin = torch._dynamo.utils.counters["ca_dynsaved"]
    assert (plugin["specialised_captures"], plugin["held_eager_runs"]) == (3, 6)


@pytest.mark.parametrize("variant", ["traceable", "opaque"])
def test_stock_compiles_each_combination(ext, variant):
    run_loop(_config_step(getattr(ext, f"config_{variant}")), stock_enable, steps=8)
    # Per combination: a capture and a compile; non-traceable also splits the graph.
    expected = {"traceable": Counts(4, 4, 0), "opaque": Counts(4, 8, 4)}[variant]
    assert counts() == expected


@pytest.mark.parametrize("variant", ["traceable", "opaque"])
def test_list_length_that_changes_outputs_is_a_new_compile(ext, variant):
    split = getattr(ext, f"split_{variant}")
    chunks = [[4, 4], [2, 3, 3]]

    def step(i):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        outs = split(x * 2, chunks[i % 2])
        sum(o.sum() * (k + 1) for k, o in enumerate(outs)).backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    if variant == "opaque":
        assert counts() == Counts(captures=2, compiles=2, graph_breaks=0)
        assert [c.compiled for c in ca_dynsaved.report().captures] == ["compiled", "compiled"]
        return
    # traceable: the first capture's combination as stock traces it; the later one
    # opaque and uncompiled before its capture's run SPECIALISE_AFTER_RUNS
    assert counts() == Counts(captures=2, compiles=1, graph_breaks=0)
    assert [n.handling for c in ca_dynsaved.report().captures for n in c.nodes] == ["stock", "opaque"]


def test_cache_never_mixes_structures(ext):
    """Two backward graphs of different structure, alternating, each with values
    changing: each gets its own compiled code, every gradient matches eager."""
    config = _config_step(ext.config_opaque)
    scaled = leaf_grad_step(
        lambda x, i: ext.config_opaque(ext.scale_opaque(x, i, 1, 0.5, 2.0), *_args(i))
    )
    run_loop(lambda i: (config if i % 2 else scaled)(i // 2), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=16)
    assert counts() == Counts(captures=8, compiles=2, graph_breaks=0)
    assert reuse.cache_size() == 2


def _args(i):
    flip, mode, dims, (wa, wb) = COMBOS[i % len(COMBOS)]
    return flip, mode, dims, wa, wb


def test_cache_is_bounded(ext, monkeypatch):
    monkeypatch.setattr(reuse, "MAX_ENTRIES", 1)
    chunks = [[4, 4], [2, 3, 3], [8]]

    def step(i):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        sum(o.sum() * (k + 1) for k, o in enumerate(ext.split_opaque(x * 2, chunks[i % 3]))).backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    assert reuse.cache_size() == 1
    assert torch._dynamo.utils.counters["ca_dynsaved"]["reuse_evictions"] == 2


def test_code_is_reused_only_for_the_same_compiler(ext):
    step = _config_step(ext.config_opaque)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=2)
    run_loop(step, lambda: ca_dynsaved.enable(backend="eager"), steps=8)
    # Combos 0, 1 were captured under aot_eager (CA's cache keeps their compiler, as
    # stock does); 2, 3 are captured under eager and must not get aot_eager code.
    assert [c.compiled for c in ca_dynsaved.report().captures] == ["compiled", "reused", "compiled", "reused"]
    assert counts() == Counts(captures=4, compiles=2, graph_breaks=0)


@pytest.mark.parametrize("variant", ["traceable", "opaque"])
def test_none_grad_that_depends_on_a_hashed_value(ext, variant):
    """A bool decides whether the gradient is None: each value is its own capture,
    whose first run records its None, so each gets a graph of its own, and every
    step matches eager (None included)."""
    skip = getattr(ext, f"skip_{variant}")
    results = run_loop(
        leaf_grad_step(lambda x, i: skip(x, i % 2 == 1, i)),
        lambda: ca_dynsaved.enable(backend="aot_eager"),
        steps=8,
    )
    assert [r[0] is None for r in results] == [False, True] * 4
    # traceable: the later value (skip) runs opaque, uncompiled before its run 16
    assert counts() == Counts(captures=2, compiles={"traceable": 1, "opaque": 2}[variant], graph_breaks=0)


def test_first_capture_combinations_traced_later_ones_share(ext):
    """A traceable function with a saved number and a bool: the combination its first
    capture holds is traced (specialised on the bool, fused, as stock CA would); one
    first met in a later capture runs opaque and uncompiled until it has shown it
    repeats (test_repeating_combination_gets_its_own_graph)."""
    results = run_loop(
        leaf_grad_step(lambda x, i: ext.skip_traceable(x, i % 3 == 2, i)),
        lambda: ca_dynsaved.enable(backend="aot_eager"),
        steps=6,
    )
    assert [r[0] is None for r in results] == [False, False, True] * 2
    assert counts() == Counts(captures=2, compiles=1, graph_breaks=0)
    first, later = (capture.nodes[0] for capture in ca_dynsaved.report().captures)
    assert (first.handling, later.handling) == ("traced-dynamic", "opaque")
    assert first.reason.endswith("; each new value verified; its hashed values (skip) constants of this graph")
    assert later.reason.endswith(
        "; its hashed values are a combination first met after the function's first capture: "
        "opaque and uncompiled until the capture's run 16, then its own traced graph"
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_repeating_combination_gets_its_own_graph(ext, backend, monkeypatch):
    """A later combination that keeps coming back (skip=False after a first capture
    with skip=True; k new every step): opaque (its shared compile) until its
    capture's run SPECIALISE_AFTER_RUNS, which compiles its own graph with the node
    traced and k dynamic, verified per new k. Every step equals eager."""
    monkeypatch.setattr(tiers, "SPECIALISE_AFTER_RUNS", 3)
    step = leaf_grad_step(lambda x, i: ext.skip_traceable(x, i % 3 == 0, i + 2))
    results = run_loop(step, lambda: ca_dynsaved.enable(backend=backend, fullgraph=True), steps=3)
    assert [r[0] is None for r in results] == [True, False, False]
    assert counts() == Counts(captures=2, compiles=0, graph_breaks=0)  # skip=False: opaque, eager
    results = run_loop(step, lambda: ca_dynsaved.enable(backend=backend, fullgraph=True), steps=9)
    assert counts() == Counts(captures=2, compiles=2, graph_breaks=0)  # its run 3: its own
    first, later = ca_dynsaved.report().captures
    assert (first.specialised, later.specialised) == (0, 3)
    assert later.nodes[0].handling == "opaque" and later.nodes[0].reason.endswith(
        ": opaque and uncompiled until the capture's run 3, then its own traced graph"
    )
    plugin = torch._dynamo.utils.counters["ca_dynsaved"]
    assert (plugin["specialised_captures"], plugin["held_eager_runs"]) == (1, 2)
    assert plugin["verify_fallbacks"] == 0


def _mode_step(ext, modes, alphas):
    return leaf_grad_step(lambda x, i: ext.mode_fn(x, modes[i % len(modes)], alphas(i)))


def test_own_graph_hands_a_refused_value_to_the_opaque_one(ext, monkeypatch):
    """alpha > 0.5 takes a branch neither sentinel took: in the later mode's own
    graph verify refuses such a step, which then runs on the capture's opaque graph
    (eagerly: no compile more); every step equals eager."""
    monkeypatch.setattr(tiers, "SPECIALISE_AFTER_RUNS", 3)
    refused = {7, 11}  # odd: mode "neg", after its run 3 (step 5)
    step = _mode_step(ext, ["plain", "neg"], lambda i: 0.75 if i in refused else 0.25 + 0.01 * i)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=13)
    assert counts() == Counts(captures=2, compiles=2, graph_breaks=0)
    first, later = ca_dynsaved.report().captures
    assert (first.specialised, later.specialised) == (0, 3)
    assert [values["alpha"] for _, values, _ in later.refused] == [0.75, 0.75]
    assert torch._dynamo.utils.counters["ca_dynsaved"]["verify_fallbacks"] == 2


def test_own_graphs_are_capped_per_function(ext, monkeypatch):
    """With MAX_SPECIALISED = 1, of two later modes only the first to reach its run
    SPECIALISE_AFTER_RUNS gets a graph; the other's opaque graph is compiled then."""
    monkeypatch.setattr(tiers, "SPECIALISE_AFTER_RUNS", 2)
    monkeypatch.setattr(tiers, "MAX_SPECIALISED", 1)
    run_loop(_mode_step(ext, ["plain", "neg", "twice"], lambda i: 0.25 + 0.01 * i), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=9)
    assert counts() == Counts(captures=3, compiles=3, graph_breaks=0)
    assert [c.specialised for c in ca_dynsaved.report().captures] == [0, 2, 0]
    # a mode first met at the cap: opaque from its capture, its graph compiled at run 2
    run_loop(_mode_step(ext, ["other"], lambda i: 0.3), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=2)
    assert counts() == Counts(captures=4, compiles=4, graph_breaks=0)
    assert ca_dynsaved.report().captures[-1].nodes[0].reason.endswith(
        ": opaque, sharing compiled code with its other later combinations (the function has 1 with graphs of their own)"
    )
