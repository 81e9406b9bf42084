"""Backwards whose captures keep changing run as plain autograd (``payoff.py``).

The pattern of GNN libraries: a C++ function saves ``src.sizes()`` as an int list
(CA hashes lists: every new batch size is a new capture) and a bool that
alternates. With the batch size changing every step, a capture never pays off;
after ``recompile_limit`` captures in a row the plugin runs that graph's backwards
without compiled autograd, and tries CA again now and then."""

from __future__ import annotations

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import payoff
from helpers import ENTRY_POINTS, Counts, counts, entry_point, frame_breaks, stock_enable

pytestmark = pytest.mark.every_release

LIMIT = 8  # torch._dynamo.config.recompile_limit's default


def _gnn_step(ext, w: torch.Tensor, nodes: int, step: int, backward, halve: bool) -> torch.Tensor:
    """Two message-passing layers over ``nodes`` nodes (3 edges a node): a
    non-traceable and a traceable C++ gather, each saving its source's sizes and
    the bool ``halve``; returns w's gradient."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(nodes, 8, generator=gen)
    src = torch.randint(0, nodes, (3 * nodes,), generator=gen)
    dst = torch.randint(0, nodes, (3 * nodes,), generator=gen)
    w.grad = None
    h = x @ w
    for gather in (ext.gather_opaque, ext.gather_traceable):
        messages = gather(h, src, halve)
        h = torch.zeros_like(h).index_add(0, dst, messages).relu()
    backward(h.square().mean())
    return w.grad.clone()


def _run(ext, sizes, backward, alternate: bool = True) -> None:
    """A step per batch size in ``sizes``, each against eager; the bool alternates
    by step (``alternate``) or stays True."""
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for step, nodes in enumerate(sizes):
        halve = step % 2 == 0 or not alternate
        got = _gnn_step(ext, w, nodes, step, backward, halve)
        torch.testing.assert_close(got, _gnn_step(ext, w, nodes, step, lambda loss: loss.backward(), halve))


@pytest.mark.parametrize("kind", ENTRY_POINTS)
def test_sizes_changing_every_step_run_as_plain_autograd(ext, kind):
    """12 steps, a new batch size each: 8 captures (compiled code never used:
    each capture's one run is eager), then plain autograd; eager's gradients at
    every step, nothing compiled, no graph break; the report says why."""
    with entry_point(kind) as backward:
        _run(ext, [20 + step for step in range(12)], backward)
    assert counts() == Counts(captures=LIMIT, compiles=0, graph_breaks=frame_breaks(kind))
    (record,) = ca_dynsaved.report().uncaptured
    assert (record.captures, record.backwards, record.tries, record.returned) == (LIMIT, 4, 0, False)
    assert record.changed == {
        "torch::autograd::CppNode<GatherFn<false> >.src_shape": LIMIT,
        "torch::autograd::CppNode<GatherFn<false> >.halve": 2,
        "torch::autograd::CppNode<GatherFn<true> >.src_shape": LIMIT,
        "torch::autograd::CppNode<GatherFn<true> >.halve": 2,
    }
    assert f"captured {LIMIT} backwards in a row" in record.reason and "4 backwards run as plain autograd" in record.reason
    assert "src_shape (8 values)" in str(ca_dynsaved.report())


def test_stock_captures_every_step(ext):
    """The baseline: stock CA captures and compiles every step, and breaks its
    graph around the non-traceable gather."""
    _run(ext, [20 + step for step in range(12)], lambda loss: _stock_backward(loss))
    got = counts()
    assert got.captures == 12 and got.graph_breaks > 0 and got.compiles >= 12


def _stock_backward(loss):
    with stock_enable():
        loss.backward()


def test_values_that_cycle_stay_under_compiled_autograd(ext):
    """Two bucketed batch sizes and the alternating bool: 2 captures (size 20 with
    halve, size 24 without: the bool follows the step), then CA's cache hits; the
    first capture's compiled code runs; the second's combination (a later one for
    the traceable gather) runs eagerly until its capture's run 16; nothing runs as
    plain autograd."""
    _run(ext, [20, 24] * 6, _plugin_backward)
    assert counts() == Counts(captures=2, compiles=1, graph_breaks=0)
    assert torch._dynamo.utils.counters["ca_dynsaved"]["held_eager_runs"] == 6
    assert ca_dynsaved.report().uncaptured == []


def _plugin_backward(loss):
    with ca_dynsaved.enable(backend="aot_eager"):
        loss.backward()


def test_a_try_that_hits_the_cache_returns_to_compiled_autograd(ext, monkeypatch):
    """After the switch to plain autograd, one backward in FIRST_RETRY (here 3)
    runs under CA again: while sizes keep changing it captures again (and the
    next try waits twice as long); once they repeat a captured one, the try hits
    CA's cache and the graph is back under CA (the bool stays True here)."""
    monkeypatch.setattr(payoff, "FIRST_RETRY", 3)
    new_sizes = [20 + step for step in range(LIMIT)] + [40, 41, 42]  # 42: a try, captures
    _run(ext, new_sizes + [20] * 7, _plugin_backward, alternate=False)
    (record,) = ca_dynsaved.report().uncaptured
    # steps 8, 9: plain; 10: a try (captures, retry 6); 11-15: plain; 16: a try
    # with size 20, captured at step 0: a hit, back under CA for steps 17, 18.
    assert (record.backwards, record.tries, record.returned) == (7, 1, True)
    assert counts().captures == LIMIT + 1
    assert torch._dynamo.utils.counters["ca_dynsaved"]["uncaptured_backwards"] == 7


def test_a_loop_that_hits_the_cache_never_walks_the_graph(ext, monkeypatch):
    """The structure walk runs after a backward that captured, not in a steady
    loop: the bool alternates, so 2 captures, then hits; 3 walks (the first
    backward, the one after each capture), none after the first hit."""
    walks = []
    key = payoff.structure_key
    monkeypatch.setattr(payoff, "structure_key", lambda roots: walks.append(1) or key(roots))
    _run(ext, [20] * 12, _plugin_backward)
    assert len(walks) == 3
    assert counts() == Counts(captures=2, compiles=1, graph_breaks=0)


def test_tries_under_compiled_autograd_get_rarer(ext):
    """300 steps, a new str at each (a C++ function's hashed mode): 8 captures, then
    plain autograd with a try under CA at the 64th backward (captures again: the
    next waits 128) and at the 128th after it; 10 captures in all, 290 backwards as
    plain autograd, every gradient eager's."""

    def step(i):
        x = torch.linspace(-1.0, 1.0, 16, requires_grad=True)
        ext.config_opaque(x * 2, True, f"mode-{i}", [1, 2], 0.5, 1.5).sum().backward()
        return x.grad

    for i in range(300):
        with ca_dynsaved.enable(backend="aot_eager"):
            got = step(i)
        torch.testing.assert_close(got, step(i))
    assert counts() == Counts(captures=LIMIT + 2, compiles=0, graph_breaks=0)
    (record,) = ca_dynsaved.report().uncaptured
    assert (record.backwards, record.tries, record.returned) == (290, 2, False)
    assert record.changed == {"torch::autograd::CppNode<ConfigFn<false> >.mode": LIMIT}  # at the switch
