"""entmax 1.3: sparse attention-style activations and a sparse loss.

Its functions (``Entmax15Function``, ``SparsemaxFunction``, ``EntmaxBisectFunction``
with a learned alpha, ``Entmax15LossFunction``) define ``forward`` and ``backward``
as classmethods. Stock CA cannot compile any of them: Dynamo's ``call_backward``
asserts a plain function (``Expected FunctionType, got <class 'method'>``). The
plugin runs them opaque: the first three because their ``ctx.dim`` (an int) is a
dim argument (the symbolic probe finds its guard), the loss, which saves no number,
because Dynamo fails on its backward traced alone (graphbreak.py).

Quirk: none.
"""

from __future__ import annotations

import pytest
import torch

import entmax
from helpers import Counts, this_release
from loops import assert_steps_equal, node, train

#: A real library's training runs: the quick loop (docs/contributing.md) leaves them out.
pytestmark = pytest.mark.slow

STEPS = 6


@pytest.mark.every_release  # _compat's trace-alone failure path
def test_entmax_activations_and_loss() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 10)
    alpha = torch.nn.Parameter(torch.tensor(1.3))
    params = [lin.weight, lin.bias, alpha]

    def step(i: int) -> torch.Tensor:
        n = 4 + i % 3  # a new batch size each step, three of them
        z = lin(torch.randn(n, 6, generator=torch.Generator().manual_seed(i)))
        p = entmax.entmax15(z, dim=-1) + entmax.sparsemax(z, dim=-1)
        p = p + entmax.entmax_bisect(z, alpha, dim=-1, n_iter=20)
        return (p * torch.arange(10.0)).sum() + entmax.entmax15_loss(z, torch.arange(n) % 10).sum()

    _, want = train(step, params, "eager", STEPS)
    # Dynamo's assertion (torch 2.11's has no message), with the CA graph's call.
    with pytest.raises(AssertionError, match="call_backward"):
        train(step, params, "stock", STEPS)
    found, got = train(step, params, "plugin", STEPS)
    assert_steps_equal(got, want)
    assert found == Counts(captures=1, compiles=2, graph_breaks=0)
    for name in ("Entmax15Function", "SparsemaxFunction", "EntmaxBisectFunction"):
        assert node(name).handling == "opaque"
        assert node(name).reason == "ctx.dim needs its value (guard Eq(ctx.dim, -1))"
    message = ": Expected FunctionType, got <class 'method'>"
    failure = this_release({"2.11": "", "2.12": "", "2.13": message, "2.14": message, "2.15": message})
    assert node("Entmax15LossFunction").reason == (
        f"backward not traceable by Dynamo: tracing it failed (AssertionError{failure})"
    )
