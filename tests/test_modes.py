"""Odd modes around a backward: autocast, torch.func transforms, tensor and node hooks.

Each either works like eager (same gradients, compiled once) or is refused as
eager refuses it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import ca_dynsaved
from helpers import STEPS, Counts, assert_grads_equal, counts, run_loop, scale_args, stock_enable, this_release
from test_python_ctx import ScaleFn


class PyMatFn(torch.autograd.Function):
    """Matmuls in backward, scaled by a saved float: autocast changes their dtype."""

    @staticmethod
    def forward(ctx, x, w, s):
        ctx.s = s
        ctx.save_for_backward(x, w)
        return x @ w * s

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gs = g * ctx.s
        return gs @ w.t(), x.t() @ gs, None


def _autocast_step(apply, autocast: bool):
    def step(i: int):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(8, 16, generator=gen, requires_grad=True)
        w = torch.randn(16, 4, generator=gen, requires_grad=True)
        loss = (apply(x, w, 0.5 + i) @ torch.randn(4, 4, generator=gen)).sum()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss.backward()
        return x.grad, w.grad

    return step


@pytest.mark.every_release  # a _compat path (README, "Supported torch releases")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", ["cpp_opaque", "cpp_traceable", "python", "python_opaque"])
def test_backward_under_autocast_matches_eager(ext, kind, backend):
    """A compiled graph runs with autocast off (AOTAutograd bakes it into the ops
    it traced); the opaque ops run the user's backward under the caller's autocast
    state, as eager's engine does, so its matmuls are bfloat16 like eager's. A
    traced Python backward (python_policy="auto") gets autocast as Dynamo traced it."""
    apply = {
        "cpp_opaque": ext.mat_opaque,
        "cpp_traceable": ext.mat_traceable,
        "python": PyMatFn.apply,
        "python_opaque": PyMatFn.apply,
    }[kind]
    policy = "opaque" if kind == "python_opaque" else None
    step = _autocast_step(apply, autocast=True)
    run_loop(step, lambda: ca_dynsaved.enable(backend=backend, python_policy=policy), steps=4)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = set(ca_dynsaved.report().nodes)
    # the traceable C++ reader is traced by default (sentinels, verified)
    assert node.handling == ("traced-dynamic" if kind in ("python", "cpp_traceable") else "opaque")
    # The comparison means something: autocast changes eager's gradients.
    plain = _autocast_step(apply, autocast=False)(0)
    assert not torch.allclose(step(0)[0], plain[0])


@pytest.mark.every_release  # a _compat path (README, "Supported torch releases")
def test_autocast_state_is_read_per_call(ext):
    """One CA graph, backward with and without autocast in turn: each call gets the
    state of its caller (Dynamo compiles the graph once per autocast state)."""
    on, off = (_autocast_step(ext.mat_opaque, autocast=a) for a in (True, False))
    run_loop(lambda i: on(i) if i % 2 else off(i), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=0)


class PyFuncFn(torch.autograd.Function):
    """torch.func-compatible (setup_context, vmap rule) with an int ctx attribute."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, k):
        return x * x * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.k = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 * x * ctx.k, None


TRANSFORMS = {
    "grad": lambda f, x, k: torch.func.grad(f)(x, k),
    "vjp": lambda f, x, k: torch.func.vjp(lambda x: f(x, k), x)[1](torch.tensor(1.0))[0],
    "vmap_grad": lambda f, x, k: torch.func.vmap(torch.func.grad(f), in_dims=(0, None))(
        x.expand(3, -1).contiguous(), k
    ),
    "jacrev": lambda f, x, k: torch.func.jacrev(f)(x, k),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_torch_func_transforms_run_like_eager(transform):
    """CA does not capture functorch's grad transforms: under the plugin they run
    exactly as eager (no capture, no compile)."""
    apply = TRANSFORMS[transform]

    def f(x, k):
        return PyFuncFn.apply(x, k).sum()

    for k in range(1, 5):
        x = torch.linspace(-1.0, 1.0, 4)
        with ca_dynsaved.enable(backend="aot_eager"):
            got = apply(f, x, k)
        torch.testing.assert_close(got, apply(f, x, k))
    assert counts() == Counts(captures=0, compiles=0, graph_breaks=0)


def test_torch_func_refuses_cpp_functions_as_eager_does(ext):
    def f(x, k):
        return ext.scale_opaque(x, k, 1, 0.5, 0.25).sum()

    message = r"cannot use C\+\+ torch::autograd::Function with functorch transforms"
    with pytest.raises(RuntimeError, match=message):
        torch.func.grad(f)(torch.ones(3), 2)
    with pytest.raises(RuntimeError, match=message):
        with ca_dynsaved.enable(backend="aot_eager"):
            torch.func.grad(f)(torch.ones(3), 2)


@pytest.mark.parametrize("kind", ["cpp_opaque", "cpp_traceable", "python"])
def test_hooks_around_custom_nodes(ext, kind):
    """A tensor hook on the input feeding the node and on its output (a pre-hook of
    the node), and the node's own pre- and post-hooks, each changing the gradient:
    CA traces the hooks around the opaque op, as stock traces them around the
    backward."""
    if kind == "python":
        apply = lambda x, i: ScaleFn.apply(x, i, 0.5 + i)  # noqa: E731
    else:
        fn = getattr(ext, f"scale_{kind.split('_')[1]}")
        apply = lambda x, i: fn(x, i, 1 - i, 0.5 + i, 0.25)  # noqa: E731
    seen = []

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        h = x * 2
        h.register_hook(lambda g: g * 3)  # receives the node's gradient for its input
        y = apply(h, i)
        y.register_hook(lambda g: g + 1)  # the node's incoming gradient
        y.grad_fn.register_prehook(lambda grad_outputs: (grad_outputs[0] * 2,))
        y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (grad_inputs[0] - 1, *grad_inputs[1:]))
        (y * y).sum().backward()
        seen.append(x.grad)
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    # The Python function's numbers only reach tensor math: traced, hooks and all.
    assert [n.handling for n in ca_dynsaved.report().nodes] == ["opaque" if kind == "cpp_opaque" else "traced-dynamic"]
    # The hooks are in play: without them the gradient differs.
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    (apply(x * 2, STEPS - 1) ** 2).sum().backward()
    assert not torch.allclose(x.grad, seen[-1])


def test_stock_counts_for_hooks_baseline(ext):
    """What stock CA does with the same hooks and values (recompiles per value)."""

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        h = x * 2
        h.register_hook(lambda g: g * 3)
        ext.scale_traceable(h, i, 1 - i, 0.5 + i, 0.25).sum().backward()
        return (x.grad,)

    run_loop(step, stock_enable)
    limit = torch._dynamo.config.recompile_limit
    assert counts() == Counts(captures=1, compiles=limit, graph_breaks=0)


def test_double_backward_through_hooked_node(ext):
    """create_graph=True with a hook on the node's input: every order like eager."""
    for i in range(3):
        results = []
        for plugin in (True, False):
            x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
            h = x * 2
            h.register_hook(lambda g: g * 3)
            loss = ext.scale_opaque(h, i, 1 - i, 0.5 + i, 0.25 + i).sum()
            if plugin:
                with ca_dynsaved.enable(backend="aot_eager"):
                    (g,) = torch.autograd.grad(loss, x, create_graph=True)
            else:
                (g,) = torch.autograd.grad(loss, x, create_graph=True)
            (gg,) = torch.autograd.grad(g.sum(), x)
            results.append((g, gg))
        assert_grads_equal(results[0], results[1])


@pytest.mark.every_release
def test_leaf_whose_grad_dtype_differs(ext):
    """A leaf whose gradient has another dtype (``Tensor.grad_dtype``; torch 2.15's
    FSDP2 mixed precision sets it on its bf16 unsharded parameters): the plugin
    gives eager's float64 gradient, once compiled for values changing every step.
    Stock CA's capture raises on it from torch 2.13 (2.11 and 2.12 do not check the
    dtype of the gradient their capture assigns)."""

    def step(i):
        w = torch.ones(3, requires_grad=True)
        w.grad_dtype = torch.float64
        ScaleFn.apply(w * 2, i + 1, 0.5 * i).sum().backward()
        return (w.grad,)

    results = run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=4)
    assert all(grad.dtype == torch.float64 for (grad,) in results)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    if this_release({"2.11": False, "2.12": False, "2.13": True, "2.14": True, "2.15": True}):
        with pytest.raises(RuntimeError, match="to a tensor with grad_dtype 'Double'"):
            with stock_enable():
                step(0)
    else:
        with stock_enable():
            assert step(0)[0].dtype == torch.float64


class _NanAt(torch.autograd.Function):
    """A NaN gradient where ``ctx.k`` is negative."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * (float("nan") if ctx.k < 0 else ctx.k), None


@pytest.mark.every_release
@pytest.mark.parametrize("kind", ["opaque", "python"])
def test_anomaly_mode_nan_check_as_stock(ext, kind):
    """Anomaly mode's NaN check (CA's NaN checker, which the plugin's runtime wrapper
    runs as stock's does): eager's gradients while there is no NaN, and stock's error
    naming the input when a backward returns one."""
    apply = _NanAt.apply if kind == "python" else (lambda x, k: ext.scale_opaque(x, *scale_args(k)))

    def grad(k: int, ctx_factory) -> torch.Tensor:
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        with torch.autograd.set_detect_anomaly(True, check_nan=True), ctx_factory():
            apply(x * 3.0, k).sum().backward()
        return x.grad

    def plugin():
        return ca_dynsaved.enable(backend="aot_eager", python_policy="opaque")

    for k in range(1, 4):
        torch.testing.assert_close(grad(k, plugin), grad(k, contextlib.nullcontext))
    if kind == "python":
        with pytest.raises(RuntimeError, match=r"Compiled Autograd returned NaN gradients for parameters: inputs\[\d+\]"):
            grad(-1, plugin)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
