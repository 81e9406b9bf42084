"""Python autograd.Function / register_autograd ctx attributes."""

from __future__ import annotations


import numpy as np

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import UndefinedGradError
from helpers import (
    ENTRY_POINTS,
    STEPS,
    Counts,
    assert_grads_equal,
    counts,
    entry_point,
    frame_breaks,
    leaf_grad_step,
    run_loop,
    stock_counts,
    stock_enable,
)

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release


class ScaleFn(torch.autograd.Function):
    """ctx.k (int) and ctx.scale (float) used in tensor math."""

    @staticmethod
    def forward(ctx, x, k, scale):
        ctx.k, ctx.scale = k, scale
        ctx.save_for_backward(x)
        return x * k * scale + x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        # Tensor ops only: Python arithmetic between the two numbers (ctx.k *
        # ctx.scale) specialises the float on torch 2.11 / 2.12 (test_python_auto).
        return g * ctx.k * ctx.scale + g * 2 * x + (ctx.k - 1) * 0.5, None, None


@torch.library.custom_op("ca_dynsaved_tests::pool_grad", mutates_args=())
def pool_grad(grad: torch.Tensor, scale: float, ratio: int) -> torch.Tensor:
    """Stands for a ROI-pooling backward kernel: plain float/int schema arguments."""
    return grad * (scale * ratio)


@pool_grad.register_fake
def _(grad, scale, ratio):
    return torch.empty_like(grad)


@torch.library.custom_op("ca_dynsaved_tests::pool", mutates_args=())
def pool(x: torch.Tensor, scale: float, ratio: int) -> torch.Tensor:
    return x * (scale * ratio)


@pool.register_fake
def _(x, scale, ratio):
    return torch.empty_like(x)


def _pool_setup_context(ctx, inputs, output):
    _, ctx.scale, ctx.ratio = inputs


def _pool_backward(ctx, g):
    return pool_grad(g, ctx.scale, ctx.ratio), None, None


pool.register_autograd(_pool_backward, setup_context=_pool_setup_context)


class BranchFn(torch.autograd.Function):
    """A bool attribute picks the formula."""

    @staticmethod
    def forward(ctx, x, flag):
        ctx.flag = flag
        return x * 2 if flag else -x

    @staticmethod
    def backward(ctx, g):
        return (g * 2 if ctx.flag else -g), None


class ModeFn(torch.autograd.Function):
    """A str attribute picks the formula."""

    @staticmethod
    def forward(ctx, x, mode):
        ctx.mode = mode
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if ctx.mode == "sum":
            return g, None
        if ctx.mode == "mean":
            return g / x.numel(), None
        return g * (x == x.max()), None


class MultiFn(torch.autograd.Function):
    """Three tensor inputs (b without grad, c whose grad is always None), an int
    between them, two outputs, saved tensors and needs_input_grad."""

    @staticmethod
    def forward(ctx, a, k, b, c, s):
        ctx.k, ctx.s = k, s
        ctx.save_for_backward(a, b)
        return a * b * k, a * s + c

    @staticmethod
    def backward(ctx, g0, g1):
        a, b = ctx.saved_tensors
        ga = g0 * b * ctx.k + g1 * ctx.s
        gb = g0 * a * ctx.k if ctx.needs_input_grad[2] else None
        return ga, None, gb, None, None


class _TimesK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * k


class OddNoneFn(_TimesK):
    """No gradient when k is odd: None depends on a saved value."""

    @staticmethod
    def backward(ctx, g):
        return (None if ctx.k % 2 else g * ctx.k), None


class BadGradFn(_TimesK):
    """Returns a gradient for its non-tensor input, which eager refuses."""

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, g


_step = leaf_grad_step
scale_step = _step(lambda x, i: ScaleFn.apply(x, i, i / 2))
pool_step = _step(lambda x, i: pool(x, 0.25 + i / 2, i + 1))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(
    "step,handling",
    [(scale_step, "traced-dynamic"), (pool_step, "opaque")],
    ids=["tensor_math", "custom_op_schema"],
)
def test_int_float_ctx_attributes_compile_once(step, handling, backend):
    """python_policy="auto" (the default): tensor math is traced with the ctx
    numbers dynamic from the first compile; a float/int schema op runs opaque."""
    run_loop(step, lambda: ca_dynsaved.enable(backend=backend, fullgraph=True))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (record,) = ca_dynsaved.report().nodes
    assert (record.handling, record.opaque) == (handling, handling == "opaque")
    assert set(record.kinds) == {"int", "float"}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("step", [scale_step, pool_step], ids=["tensor_math", "custom_op_schema"])
def test_policy_opaque_runs_every_number_function_opaque(step, backend):
    run_loop(step, lambda: ca_dynsaved.enable(backend=backend, python_policy="opaque"))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (record,) = ca_dynsaved.report().nodes
    assert (record.handling, record.reason) == ("opaque", "")


def test_stock_baselines():
    """What the plugin removes (torch 2.13): an int in tensor math recompiles once
    before automatic dynamic; values passed to a float/int schema recompile until
    the recompile limit."""
    run_loop(scale_step, stock_enable)
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=0)
    ca_dynsaved.reset()
    torch._dynamo.utils.counters.clear()
    run_loop(pool_step, stock_enable)
    limit = torch._dynamo.config.recompile_limit
    assert counts() == Counts(captures=1, compiles=limit, graph_breaks=0)


def test_python_policy_stock_is_stock():
    run_loop(pool_step, lambda: ca_dynsaved.enable(backend="aot_eager", python_policy="stock"))
    limit = torch._dynamo.config.recompile_limit
    assert counts() == Counts(captures=1, compiles=limit, graph_breaks=0)
    (record,) = ca_dynsaved.report().nodes
    assert (record.opaque, record.reason) == (False, 'python_policy="stock"')


def test_python_policy_config_entry():
    with torch._dynamo.config.patch(**{ca_dynsaved.CONFIG_PYTHON_POLICY: "stock"}):
        run_loop(pool_step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=3)
    assert counts().compiles == 3
    with pytest.raises(ValueError, match="python_policy must be one of"):
        ca_dynsaved.enable(python_policy="symbolic")


def test_bool_attribute_keeps_its_guard():
    run_loop(_step(lambda x, i: BranchFn.apply(x, i % 2 == 0)), lambda: ca_dynsaved.enable(backend="aot_eager"))
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=0)
    (record,) = set(ca_dynsaved.report().nodes)
    assert not record.opaque and record.keys == ("flag",)
    assert record.reason == (
        "no int or float ctx attribute; ctx.flag guarded by Dynamo as stock guards it (a compile per distinct value)"
    )


def test_str_attribute_keeps_its_guard():
    modes = ("sum", "mean", "max")
    run_loop(_step(lambda x, i: ModeFn.apply(x, modes[i % 3])), lambda: ca_dynsaved.enable(backend="aot_eager"))
    assert counts() == Counts(captures=1, compiles=3, graph_breaks=0)


@pytest.mark.parametrize("kind", ENTRY_POINTS)
@pytest.mark.parametrize("fn", ["scale", "pool"])
def test_entry_points_give_the_same_counts(kind, fn):
    apply = {"scale": lambda x, i: ScaleFn.apply(x, i, i / 2), "pool": lambda x, i: pool(x, 0.25 + i / 2, i + 1)}[fn]

    def loss_and_leaf(i):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        return x, apply(x * 2, i).sum()

    with entry_point(kind) as backward:
        for i in range(STEPS):
            x, loss = loss_and_leaf(i)
            backward(loss)
            x_e, loss_e = loss_and_leaf(i)
            loss_e.backward()
            assert_grads_equal([x.grad], [x_e.grad])
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=frame_breaks(kind))


@pytest.mark.parametrize("use_both_outputs", [True, False])
def test_multi_io_none_grads(use_both_outputs):
    def step(i: int):
        a = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        b = torch.linspace(0.0, 2.0, 6)
        c = torch.ones(6, requires_grad=True)
        o1, o2 = MultiFn.apply(a * 2, i, b, c * 3, 0.25 * i)
        (o1.sum() + ((o2 * o2).sum() if use_both_outputs else 0)).backward()
        return a.grad, b.grad, c.grad

    results = run_loop(step, lambda: ca_dynsaved.enable(backend="inductor", fullgraph=True))
    assert all(r[0] is not None and r[1] is None and r[2] is None for r in results)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)


def test_value_dependent_none_raises_and_exclude_keeps_stock():
    step = _step(lambda x, i: OddNoneFn.apply(x, i))
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=1)
    with pytest.raises(UndefinedGradError, match="OddNoneFn returned an undefined gradient for input 0"):
        with ca_dynsaved.enable(backend="aot_eager"):
            step(1)
    ca_dynsaved.reset()
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager", exclude=["OddNoneFn"]), steps=4)
    assert {(n.opaque, n.reason) for n in ca_dynsaved.report().nodes} == {
        (False, "excluded by enable(exclude=...)")
    }


def test_gradient_for_a_non_tensor_input_is_refused_like_eager():
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="position 2, but the corresponding forward input was not a Variable"):
        BadGradFn.apply(x, 3).sum().backward()
    with pytest.raises(RuntimeError, match="position 2, but the corresponding forward input was not a Variable"):
        with ca_dynsaved.enable(backend="aot_eager"):
            BadGradFn.apply(x, 3).sum().backward()


@pytest.mark.parametrize("policy,eager_runs", [("auto", 0), ("opaque", 3)])
def test_create_graph_through_python_function(policy, eager_runs):
    """Traced (auto): stock CA's own create_graph handling; opaque: the captured
    graph runs eagerly with the backward called directly. Both equal eager."""
    for i in range(3):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        with ca_dynsaved.enable(backend="aot_eager", python_policy=policy):
            (g,) = torch.autograd.grad(ScaleFn.apply(x * 2, i, i / 2).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        x_e = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        (g_e,) = torch.autograd.grad(ScaleFn.apply(x_e * 2, i, i / 2).sum(), x_e, create_graph=True)
        (gg_e,) = torch.autograd.grad(g_e.sum(), x_e)
        torch.testing.assert_close((g, gg), (g_e, gg_e))
    assert torch._dynamo.utils.counters["ca_dynsaved"]["create_graph_eager_runs"] == eager_runs


def test_cpp_and_python_functions_in_one_graph(ext):
    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        y = ext.scale_opaque(ScaleFn.apply(x * 2, i, i / 2), i, 1 - i, i / 4, 0.5)
        pool(y, 0.5 + i, i + 2).sum().backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="inductor", fullgraph=True))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    assert {(n.name, n.handling) for n in ca_dynsaved.report().nodes} == {
        ("ScaleFn", "traced-dynamic"),
        ("torch::autograd::CppNode<ScaleFn<false> >", "opaque"),
        ("GeneratedBackwardFor_ca_dynsaved_tests_pool_default", "opaque"),
    }


class AnyScalarFn(torch.autograd.Function):
    """ctx.v: whatever number the caller passed (a Python int beyond int64, a numpy
    scalar, a 0-dim tensor); the backward reads it as a Python float."""

    @staticmethod
    def forward(ctx, x, v):
        ctx.v = v
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        v = ctx.v
        if not isinstance(v, (float, np.floating, torch.Tensor)):
            v = (int(v) % 1009) / 7  # an int of any size
        return g * float(v), None


NON_PYTHON_SCALARS = {
    "int_beyond_int64": lambda i: 2**64 + 3 * i,
    "numpy_int64": lambda i: np.int64(3 + i),
    "numpy_float32": lambda i: np.float32(0.5 + i),
    "numpy_float64": lambda i: np.float64(0.5 + i),
}


@pytest.mark.parametrize("kind", NON_PYTHON_SCALARS)
def test_ints_beyond_int64_and_numpy_scalars_run_opaque(kind):
    """Numbers Dynamo would guard on (stock CA cannot even compile an int beyond
    int64 or a numpy int64 here: BackendCompilerFailed) run opaque: one compile."""
    value = NON_PYTHON_SCALARS[kind]
    run_loop(_step(lambda x, i: AnyScalarFn.apply(x, value(i))), lambda: ca_dynsaved.enable(backend="aot_eager"))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (record,) = ca_dynsaved.report().nodes
    assert record.opaque and record.kinds == (type(value(0)).__name__,)


class TensorAttributeFn(torch.autograd.Function):
    """ctx.t: a 0-dim tensor attribute (not saved), used in tensor math only."""

    @staticmethod
    def forward(ctx, x, t):
        ctx.t = t
        return x * t

    @staticmethod
    def backward(ctx, g):
        return g * ctx.t, None


def _stock_then_plugin(step, steps: int = 5) -> Counts:
    """Stock's counts over ``steps``; then the plugin's run from a fresh state."""
    stock = stock_counts(step, steps)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=steps)
    return stock


def test_zero_dim_tensor_attribute_keeps_stock_tracing():
    """A 0-dim tensor on ctx is a graph input under stock CA, not a guarded value:
    a function whose backward traces keeps stock tracing, with exactly stock's
    counts and eager's gradients."""
    stock = _stock_then_plugin(_step(lambda x, i: TensorAttributeFn.apply(x, torch.tensor(0.5 + i))))
    assert counts() == stock == Counts(captures=1, compiles=1, graph_breaks=0)
    (record,) = set(ca_dynsaved.report().nodes)
    assert not record.opaque and "no int or float ctx attribute, and Dynamo traces its backward" in record.reason


def test_zero_dim_tensor_attribute_read_as_a_float_runs_opaque():
    """The same attribute read as a Python number (``float(ctx.v)``): stock breaks
    the graph there and recompiles; the backward runs opaque (graphbreak.py)."""
    stock = _stock_then_plugin(_step(lambda x, i: AnyScalarFn.apply(x, torch.tensor(0.5 + i))))
    assert stock == Counts(captures=1, compiles=4, graph_breaks=3)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (record,) = set(ca_dynsaved.report().nodes)
    assert record.opaque and record.reason.startswith("backward not traceable by Dynamo: ")
