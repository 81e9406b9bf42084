"""Runs of opaque nodes that only feed each other run as one op (``fuse.py``): the
same gradients as eager, the same compile counts, one op where the run was; a node
feeding two consumers, or one that passes its gradient through, ends a run."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import ca_dynsaved
from ca_dynsaved import fuse
from helpers import ENTRY_POINTS, Counts, assert_grads_equal, counts, entry_point, frame_breaks, scale_args

#: Runs of opaque nodes as one op (fuse.py), on every release.
pytestmark = pytest.mark.every_release


class PyScale(torch.autograd.Function):
    """Run opaque (python_policy="opaque"); its ctx number changes the gradient."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * 1.5

    @staticmethod
    def backward(ctx, g):
        return g * (1.5 + ctx.k), None


def _alternating(ext, x, k):
    """5 opaque nodes in a row: C++, Python, C++, Python, C++."""
    for i in range(5):
        x = ext.scale_opaque(x, *scale_args(k + i)) if i % 2 == 0 else PyScale.apply(x, k + i)
    return x


def _with_matmul(ext, x, k, w):
    """C++, then a matmul node whose second gradient goes to w, then C++."""
    x = ext.scale_opaque(x, *scale_args(k)).reshape(1, 4)
    x = ext.mat_opaque(x, w, 0.5 + k)
    return ext.scale_opaque(x, *scale_args(k + 1))


def _with_passthrough(ext, x, k):
    """C++, a node returning its incoming gradient as is, C++."""
    x = ext.scale_opaque(x, *scale_args(k))
    x = ext.pass_opaque(x, k)
    return ext.scale_opaque(x, *scale_args(k + 1))


def _multi_twice(ext, x, k):
    """A 3-input, 2-output node feeding both outputs to another: the second's two
    incoming gradients both come from the first (and its third input's never)."""
    c = torch.ones(4)
    a, b = ext.multi_opaque(x, x * 2.0, c, k, 0.5 + k)
    a, b = ext.multi_opaque(a, b, c, k + 1, 1.5 - k)
    return a + b


CASES = {
    # name: (model, opaque nodes, of them folded into a previous one, chains)
    "alternating": (_alternating, 5, 4, 1),
    "with_matmul": (_with_matmul, 3, 1, 1),
    "with_passthrough": (_with_passthrough, 3, 0, 0),
    "multi_twice": (_multi_twice, 2, 1, 1),
}


def _grads(ext, case: str, k: int, backward) -> list[torch.Tensor | None]:
    model = CASES[case][0]
    x = torch.linspace(-1.0, 1.0, 4, requires_grad=True)
    w = torch.linspace(0.5, 2.0, 16).reshape(4, 4).requires_grad_()
    args = (w,) if case == "with_matmul" else ()
    backward(model(ext, x * 1.0, k, *args).sum())
    return [x.grad, w.grad]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_runs_of_opaque_nodes(ext, case, entry):
    _, nodes, folded, chains = CASES[case]
    options = {} if entry == "config" else {"python_policy": "opaque"}
    with torch._dynamo.config.patch(**{ca_dynsaved.CONFIG_PYTHON_POLICY: "opaque"}):
        with entry_point(entry, **options) as backward:
            for k in range(5):
                got = _grads(ext, case, k, backward)
                assert_grads_equal(got, _grads(ext, case, k, lambda loss: loss.backward()))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=frame_breaks(entry))
    ours = counters["ca_dynsaved"]
    assert (ours["opaque_nodes"], ours["fused_opaque_nodes"]) == (nodes, folded)
    # One chain op, and one registered plan, per run (not one per fold).
    assert fuse.chain_count() == chains


def test_create_graph_through_a_run(ext):
    """A double backward through a fused run: the captured graph runs eagerly with
    each op called directly (autograd records the chain's steps), as eager."""

    def second_order(ctx_factory) -> torch.Tensor:
        x = torch.linspace(-1.0, 1.0, 4, requires_grad=True)
        with ctx_factory():
            (g,) = torch.autograd.grad(_alternating(ext, x * 1.0, 2).sum(), x, create_graph=True)
        g.square().sum().backward()
        return x.grad

    def plugin():
        return ca_dynsaved.enable(backend="aot_eager", python_policy="opaque")

    want = second_order(torch._dynamo.compiled_autograd._disable)
    for _ in range(3):  # the first run learns; the runs after it use the fused graph
        torch.testing.assert_close(second_order(plugin), want)
    ours = counters["ca_dynsaved"]
    assert ours["fused_opaque_nodes"] == 4 and ours["create_graph_eager_runs"] == 3
