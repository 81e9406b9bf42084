"""Python backwards Dynamo cannot trace run as one opaque op (graphbreak.py)."""

from __future__ import annotations

import bisect

import pytest
import torch
from torch._dynamo.utils import counters

import ca_dynsaved
from helpers import (
    ENTRY_POINTS,
    Counts,
    assert_grads_equal,
    counts,
    entry_point,
    frame_breaks,
    run_loop,
    scale_args,
    stock_counts,
    stock_enable,
    this_release,
)

_TABLE = (1, 3, 5, 8)


def _refused_lookup(mode: str) -> float:
    """A plain helper Dynamo refuses (a C builtin it has no rule for); on fake
    tensors it runs fine, so only a trace by Dynamo tells."""
    return float(bisect.bisect_right(_TABLE, len(mode)))


_LOOKUP_LINE = _refused_lookup.__code__.co_firstlineno + 3


class LookupFn(torch.autograd.Function):
    """No ctx number: a str mode and a saved tensor; the backward calls the helper."""

    @staticmethod
    def forward(ctx, x, mode):
        ctx.mode = mode
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x * _refused_lookup(ctx.mode), None


class ItemFn(torch.autograd.Function):
    """Reads a saved tensor's value in the backward: ``.item()``."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (1.0 + x.abs().max().item())


class TraceableFn(torch.autograd.Function):
    """A bool picks the branch; tensor math only: stock CA traces it."""

    @staticmethod
    def forward(ctx, x, flip):
        ctx.flip = flip
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return (-g if ctx.flip else g) * x.cos(), None


def _sized_step(apply, sizes=(5, 7, 9)):
    """``step(i)``: a leaf of a size new every step, ``apply(x * 2, i)``, its grad."""

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, sizes[i % len(sizes)], requires_grad=True)
        apply(x * 2, i).sum().backward()
        return (x.grad,)

    return step


LOOKUP = _sized_step(lambda x, i: LookupFn.apply(x, "ab" if i % 2 else "abcdef"))
#: Stock CA's counts for LOOKUP over 6 steps (measured).
LOOKUP_STOCK = {"2.11": Counts(1, 9, 7), "2.12": Counts(1, 9, 7)} | dict.fromkeys(("2.13", "2.14", "2.15"), Counts(1, 8, 6))


@pytest.mark.every_release
@pytest.mark.parametrize("kind", ENTRY_POINTS)
def test_untraceable_helper_runs_opaque(kind):
    """Stock breaks the graph at the helper, and recompiles the pieces as sizes
    change; the plugin: no break, the sizes' compiles only (a static graph, then a
    dynamic one), gradients equal eager under every entry point."""
    assert stock_counts(LOOKUP, 6) == this_release(LOOKUP_STOCK)
    with entry_point(kind) as backward:
        for i in range(6):
            x, x_e = (torch.linspace(-1.0, 1.0, (5, 7, 9)[i % 3], requires_grad=True) for _ in range(2))
            mode = "ab" if i % 2 else "abcdef"
            backward(LookupFn.apply(x * 2, mode).sum())
            LookupFn.apply(x_e * 2, mode).sum().backward()
            assert_grads_equal([x.grad], [x_e.grad])
    # The config path captures the first size again (as stock does there).
    assert counts() == Counts(captures=2 if kind == "config" else 1, compiles=2, graph_breaks=frame_breaks(kind))
    node = ca_dynsaved.report().nodes[0]
    assert node.opaque and node.reason == (
        "backward not traceable by Dynamo: Attempted to call function marked as skipped "
        "(Dynamo does not know how to trace the builtin `_bisect.bisect_right.`) "
        f"at {__file__}:{_LOOKUP_LINE} in _refused_lookup"
    )


@torch.library.custom_op("ca_dynsaved_tests::lookup_scale", mutates_args=())
def lookup_scale(x: torch.Tensor, mode: str) -> torch.Tensor:
    return x * x


lookup_scale.register_fake(lambda x, mode: torch.empty_like(x))


def _lookup_setup(ctx, inputs, output):
    ctx.mode = inputs[1]
    ctx.save_for_backward(inputs[0])


def _lookup_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g * x * _refused_lookup(ctx.mode), None


lookup_scale.register_autograd(_lookup_backward, setup_context=_lookup_setup)


def test_register_autograd_backward_runs_opaque():
    """A custom op's register_autograd backward: the user's, in a Function class
    torch generates (torch's module, not one of torch's own functions)."""
    step = _sized_step(lambda x, i: lookup_scale(x, "ab" if i % 2 else "abcdef"))
    assert stock_counts(step, 6) == this_release(LOOKUP_STOCK)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=0)
    node = ca_dynsaved.report().nodes[0]
    assert node.opaque and node.reason.endswith(f"at {__file__}:{_LOOKUP_LINE} in _refused_lookup")


def test_item_in_backward_runs_opaque():
    step = _sized_step(lambda x, i: ItemFn.apply(x))
    assert stock_counts(step, 6) == Counts(captures=1, compiles=7, graph_breaks=6)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=0)
    node = ca_dynsaved.report().nodes[0]
    assert node.opaque and node.reason.startswith(
        "backward not traceable by Dynamo: Unsupported Tensor.item() call with capture_scalar_outputs=False"
    )


@pytest.mark.every_release
def test_traceable_backward_keeps_stock_and_is_traced_once():
    """A backward Dynamo traces keeps stock's trace (its bool guarded as stock guards
    it; nothing to lift): stock's counts and frame
    statistics exactly (the trace alone leaves no trace in them), one trace for the
    function and ctx layout over every capture and value."""
    step = _sized_step(lambda x, i: TraceableFn.apply(x, bool(i % 2)))
    run_loop(step, stock_enable, steps=6)
    stock, stock_frames = counts(), dict(counters["frames"])
    ca_dynsaved.reset()
    counters.clear()
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    assert counts() == stock == Counts(captures=1, compiles=3, graph_breaks=0)
    assert dict(counters["frames"]) == stock_frames
    assert counters["ca_dynsaved"]["dynamo_probes"] == 1
    node = ca_dynsaved.report().nodes[0]
    assert (node.handling, node.reason) == (
        "traced-dynamic",
        "no int or float ctx attribute; ctx.flip guarded by Dynamo as stock guards it (a compile per distinct value)",
    )


def test_stock_policy_keeps_the_break():
    assert stock_counts(LOOKUP, 6) == this_release(LOOKUP_STOCK)
    run_loop(LOOKUP, lambda: ca_dynsaved.enable(backend="aot_eager", python_policy="stock"), steps=6)
    assert counts() == this_release(LOOKUP_STOCK)
    assert counters["ca_dynsaved"]["dynamo_probes"] == 0


def test_create_graph_through_an_untraceable_backward():
    """Double backward through it: the graph runs with the backward called directly
    (as every opaque Python node under create_graph), equal to eager."""

    def grads(x):
        (g,) = torch.autograd.grad(LookupFn.apply(x * 2, "abc").sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad((g * g).sum(), x)
        return g.detach(), gg

    for n in (5, 7, 9):
        x = torch.linspace(-1.0, 1.0, n, requires_grad=True)
        with ca_dynsaved.enable(backend="aot_eager"):
            got = grads(x)
        assert_grads_equal(got, grads(x))
    assert counters["ca_dynsaved"]["create_graph_eager_runs"] == 3
    assert ca_dynsaved.report().nodes[0].opaque


class AdjointFn(torch.autograd.Function):
    """Its backward differentiates something itself, as an adjoint method does:
    ``torch.autograd.grad`` under ``enable_grad`` (and a non-traceable helper)."""

    @staticmethod
    def forward(ctx, x, w, mode):
        ctx.mode = mode
        ctx.save_for_backward(x, w)
        return (x * w).tanh()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), w.detach().requires_grad_()
            out = (xd * wd).tanh()
            gx, gw = torch.autograd.grad(out, (xd, wd), g * _refused_lookup(ctx.mode))
        return gx, gw, None


def test_nested_autograd_in_an_opaque_backward_of_a_compiled_graph():
    """The compiled graph calls the op below autograd; the backward runs with the
    caller's dispatch keys, so its own ``torch.autograd.grad`` records history. The
    weight takes no gradient here: its output is dropped (an invalid edge)."""

    def step(i):
        x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        w = torch.full((6,), 0.5 + i)  # needs no grad
        AdjointFn.apply(x * 2, w, "abcd").sum().backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=4)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    assert ca_dynsaved.report().nodes[0].opaque


def test_dispatch_keys_read_only_where_a_python_node_runs_opaque(ext, monkeypatch):
    """The caller's dispatch keys are read once per backward of a graph with a Python
    opaque node (its backward runs under them), never for a graph whose opaque nodes
    are all C++; gradients equal eager's both ways."""
    from ca_dynsaved import binding

    reads: list[int] = []
    keys = binding.dispatch_keys
    monkeypatch.setattr(binding, "dispatch_keys", lambda: reads.append(1) or keys())

    def cpp_step(i):
        x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        ext.scale_opaque(x * 2, *scale_args(i)).sum().backward()
        return (x.grad,)

    def python_step(i):
        x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        AdjointFn.apply(x * 2, torch.full((6,), 0.5 + i), "abcd").sum().backward()
        return (x.grad,)

    run_loop(cpp_step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=3)
    assert reads == [] and ca_dynsaved.report().nodes[0].opaque
    run_loop(python_step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=3)
    assert len(reads) == 3


class SplitFn(torch.autograd.Function):
    """Its backward returns two views of one buffer, as torchdiffeq's adjoint returns
    its parameters' gradients."""

    @staticmethod
    def forward(ctx, a, b, mode):
        ctx.mode = mode
        return a * b

    @staticmethod
    def backward(ctx, g):
        flat = torch.cat([g * _refused_lookup(ctx.mode), g * 2])
        return flat[: g.numel()], flat[g.numel() :], None


def test_outputs_that_alias_each_other_are_copied():
    """A custom op may not return two aliasing outputs (an error where torch's
    ``error_on_custom_op_aliasing`` is on, as in CI; a warning elsewhere)."""

    def step(i):
        a, b = (torch.linspace(-1.0, 1.0, 6, requires_grad=True) for _ in range(2))
        SplitFn.apply(a * 2, b + i, "abc").sum().backward()
        return a.grad, b.grad

    with torch._functorch.config.patch(error_on_custom_op_aliasing=True):
        run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=3)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    assert ca_dynsaved.report().nodes[0].opaque
