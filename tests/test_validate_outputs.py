"""An opaque backward's gradients go through what the engine's validate_outputs does
(a cast to the input's dtype, a sum down to its shape) on every run, as in eager,
also once the op skips that call for outputs the first run's call kept as they were
(``outputs._kept``): a later run that returns another dtype or shape is validated."""

from __future__ import annotations

import pytest
import torch

import ca_dynsaved
from helpers import Counts, counts


class Reshaped(torch.autograd.Function):
    """Its gradient, by ``ctx.k % 3``: as is; in float64; broadcast over a new leading
    dimension of 3 (a third each), which validate_outputs sums back."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        g = g * (2.0 + ctx.k)
        if ctx.k % 3 == 1:
            return g.double(), None
        if ctx.k % 3 == 2:
            return (g / 3).expand(3, *g.shape), None
        return g, None


def _grad(k: int) -> torch.Tensor:
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    Reshaped.apply(x * 3.0, k).sum().backward()
    return x.grad


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_later_runs_that_need_validating_are_validated(backend):
    for k in range(7):  # as is first (the run that learns), then every kind in turn
        with ca_dynsaved.enable(backend=backend, python_policy="opaque"):
            got = _grad(k)
        want = _grad(k)
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    assert torch._dynamo.utils.counters["ca_dynsaved"]["opaque_nodes"] == 1
