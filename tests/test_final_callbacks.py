"""Callbacks queued with ``Variable._execution_engine.queue_callback`` during a
compiled backward run after it, as the engine runs them after an eager one.

Stock compiled autograd drops a callback queued by code that runs outside
Dynamo's graph (a ``torch.compiler.disable``d hook): the engine puts it on the
graph task of the ``backward()`` CA took over, which ends without its
post-processing. FSDP2's post-backward (reduce-scatter, reshard) is such a
callback (test_distributed)."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import Variable

import ca_dynsaved

from ca_dynsaved._compat import engine
from helpers import ENTRY_POINTS, Counts, counts, entry_point, frame_breaks, stock_enable
from test_python_ctx import ScaleFn

STEPS = 4


def _model_step(hook, step: int):
    """A fresh leaf through a Python ctx function whose ints change every step,
    ``hook`` on the intermediate; returns (leaf, loss)."""
    x = torch.arange(4.0, requires_grad=True)
    y = ScaleFn.apply(x * 2, step + 2, 0.5 + step)
    y.register_hook(hook)
    return x, (y * y).sum()


def _eager_grad(step: int) -> torch.Tensor:
    x, loss = _model_step(lambda g: g, step)
    loss.backward()
    return x.grad


def _queueing_hook(events: list, x_of_step: dict):
    """A hook Dynamo does not trace that queues a callback, which queues another;
    each records what it sees of the leaf's gradient."""

    @torch.compiler.disable
    def hook(g):
        step = len([e for e in events if e[0] == "hook"])
        events.append(("hook", step))

        def first():
            events.append(("first", step, x_of_step[step].grad.clone()))
            Variable._execution_engine.queue_callback(lambda: events.append(("second", step)))

        Variable._execution_engine.queue_callback(first)
        return g

    return hook


@pytest.mark.every_release
@pytest.mark.parametrize("kind", ENTRY_POINTS)
def test_queued_callbacks_run_after_the_backward_in_order(kind):
    """Both callbacks run once per backward, the one queued by a callback after it,
    after every gradient is accumulated (the first sees the leaf's final grad,
    equal to eager's); one capture, one compile per graph piece as stock."""
    events: list = []
    leaves: dict = {}
    hook = _queueing_hook(events, leaves)
    with entry_point(kind) as backward:
        for step in range(STEPS):
            x, loss = _model_step(hook, step)
            leaves[step] = x
            backward(loss)
            torch.testing.assert_close(x.grad, _eager_grad(step))
    for step in range(STEPS):
        hook_at, first, second = events[3 * step : 3 * step + 3]
        assert hook_at == ("hook", step) and first[:2] == ("first", step) and second == ("second", step)
        torch.testing.assert_close(first[2], _eager_grad(step))
    assert len(events) == 3 * STEPS
    (capture,) = ca_dynsaved.report().captures
    assert capture.final_callbacks == 2 * STEPS
    # The disabled hook splits the CA graph in two graphs; the ctx numbers stay
    # dynamic in the resumed half, so nothing recompiles (stock: 3, below). Dynamo
    # counts the one break twice (the trace that finds it, and the restarted trace
    # that compiles up to it), as for stock.
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=2 + frame_breaks(kind))


@pytest.mark.every_release
def test_stock_drops_the_callbacks():
    """The defect, as a baseline: stock runs neither callback (and recompiles the
    resumed half of the graph for a new ctx value, until automatic dynamic)."""
    events: list = []
    leaves: dict = {}
    hook = _queueing_hook(events, leaves)
    for step in range(STEPS):
        x, loss = _model_step(hook, step)
        leaves[step] = x
        with stock_enable():
            loss.backward()
    assert events == [("hook", step) for step in range(STEPS)]
    assert counts() == Counts(captures=1, compiles=3, graph_breaks=2)


def test_a_backward_that_raises_runs_no_callback_and_restores_the_engine():
    """As in eager: a backward that fails skips the post-processing. The engine
    is the original again after the backward, failed or not."""
    events: list = []

    @torch.compiler.disable
    def hook(g):
        Variable._execution_engine.queue_callback(lambda: events.append("ran"))
        raise ValueError("hook failed")

    original = Variable._execution_engine
    x, loss = _model_step(hook, 0)
    with pytest.raises(ValueError, match="hook failed"):
        with ca_dynsaved.enable(backend="aot_eager"):
            loss.backward()
    assert events == []
    assert Variable._execution_engine is original
    x, loss = _model_step(lambda g: g, 1)
    with ca_dynsaved.enable(backend="aot_eager"):
        loss.backward()
    assert Variable._execution_engine is original


def test_a_nested_eager_backward_keeps_its_own_callbacks():
    """A backward started inside the compiled one (here torch.autograd.grad in a
    hook) has its own graph task: its callback runs when it ends, inside the hook,
    before the outer backward's, as in eager."""
    def run(ctx) -> list:
        events: list = []

        @torch.compiler.disable
        def hook(g):
            Variable._execution_engine.queue_callback(lambda: events.append("outer"))
            z = torch.ones(2, requires_grad=True)

            def inner_hook(gz):
                Variable._execution_engine.queue_callback(lambda: events.append("inner"))
                return gz

            with torch.enable_grad():  # off while a backward runs hooks
                w = z * 3
                w.register_hook(inner_hook)
                torch.autograd.grad(w.sum(), z)
            events.append("hook returns")
            return g

        x, loss = _model_step(hook, 0)
        with ctx:
            loss.backward()
        return events

    eager = run(torch._dynamo.compiled_autograd._disable())
    assert eager == ["inner", "hook returns", "outer"]
    assert run(ca_dynsaved.enable(backend="aot_eager")) == eager


def test_other_threads_keep_the_engine():
    """While a compiled backward runs on one thread, a callback queued on another
    thread goes to that thread's own (eager) backward."""
    import threading

    events: list = []
    started, release = threading.Event(), threading.Event()

    def eager_backward_in_thread():
        started.wait()
        x = torch.ones(2, requires_grad=True)
        y = x * 2

        def hook(g):
            Variable._execution_engine.queue_callback(lambda: events.append("thread"))
            return g

        y.register_hook(hook)
        y.sum().backward()
        events.append("thread backward returned")
        release.set()

    @torch.compiler.disable
    def blocking_hook(g):
        assert isinstance(Variable._execution_engine, engine._PluginEngine)
        started.set()
        assert release.wait(30)
        return g

    thread = threading.Thread(target=eager_backward_in_thread)
    thread.start()
    x, loss = _model_step(blocking_hook, 0)
    with ca_dynsaved.enable(backend="aot_eager"):
        loss.backward()
    thread.join(30)
    assert events == ["thread", "thread backward returned"]
