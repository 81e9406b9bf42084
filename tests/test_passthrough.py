"""A backward that returns its incoming gradient as is: the compiled graph hands
that gradient on itself (no copy; a custom op may not return an alias of its
input), gradients equal eager's and nothing the user holds is mutated; a backward
that stops passing it through on a later run is refused with an error."""

from __future__ import annotations

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import UndefinedGradError
from helpers import Counts, counts

#: The opaque op's pass-through paths, on every release.
pytestmark = pytest.mark.every_release


class PyPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.k >= 0 else g * 2.0), None


class _Clones:
    """Counts Tensor.clone calls from Python (the copy an aliasing output costs the
    op, which runs beneath any dispatch mode a test could install)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.clones = 0
        self._monkeypatch = monkeypatch
        self._clone = torch.Tensor.clone

    def __enter__(self) -> "_Clones":
        def counted(t, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.clones += 1
            return self._clone(t, *args, **kwargs)

        self._monkeypatch.setattr(torch.Tensor, "clone", counted)
        return self

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        self._monkeypatch.setattr(torch.Tensor, "clone", self._clone)


def _apply(ext, kind: str):
    if kind == "python":
        return PyPass.apply
    return getattr(ext, f"pass_{kind}")


def _step(ext, kind: str, k: int, gradient: torch.Tensor, x: torch.Tensor) -> None:
    y = _apply(ext, kind)(x * 3.0, k)
    (y * 2.0).backward(gradient)


@pytest.mark.parametrize("kind", ["traceable", "opaque", "python"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_passthrough_without_copy(ext, kind, backend, monkeypatch):
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    x_e = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    # .grad exists from the start: a first backward into a missing .grad is a
    # capture of its own.
    x.grad, x_e.grad = torch.zeros(8), torch.zeros(8)
    gradient = torch.linspace(0.5, 2.0, 8)
    kept = gradient.clone()
    clones = _Clones(monkeypatch)
    for k in range(6):
        # .grad accumulates over the steps (never zeroed): an aliasing gradient
        # that leaked into x.grad would be mutated by the next accumulation.
        with ca_dynsaved.enable(backend=backend, python_policy="opaque"):
            if k >= 2:  # compiled runs (the first run learns, eagerly)
                with clones:
                    _step(ext, kind, k, gradient, x)
            else:
                _step(ext, kind, k, gradient, x)
        _step(ext, kind, k, gradient, x_e)
        torch.testing.assert_close(x.grad, x_e.grad)
        torch.testing.assert_close(gradient, kept)  # the user's gradient untouched
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    c = torch._dynamo.utils.counters["ca_dynsaved"]
    assert (c["opaque_nodes"], c["passthrough_outputs"]) == (1, 1)
    assert clones.clones == 0


@pytest.mark.parametrize("kind", ["opaque", "python"])
def test_passthrough_that_changes_is_refused(ext, kind):
    """Whether the backward passes its gradient through depends on k: the graph
    learned "through" at k=1; at k=-1 the op raises, naming the node."""
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    for k in (1, 2):
        with ca_dynsaved.enable(backend="aot_eager", python_policy="opaque"):
            _step(ext, kind, k, torch.ones(8), x)
    with pytest.raises(UndefinedGradError, match=r"Pass(Fn|).*returned a new tensor as gradient for input 0.*as is"):
        with ca_dynsaved.enable(backend="aot_eager", python_policy="opaque"):
            _step(ext, kind, -1, torch.ones(8), x)


def test_a_new_tensor_on_the_first_run_keeps_the_copy_path(ext):
    """Learned "new tensor" at k=-1: later runs that pass the gradient through get
    a copy (the op may not alias its input), and equal eager."""
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    x_e = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    for k in (-1, -2, 3, 4):
        with ca_dynsaved.enable(backend="inductor"):
            _step(ext, "opaque", k, torch.ones(8), x)
        _step(ext, "opaque", k, torch.ones(8), x_e)
        torch.testing.assert_close(x.grad, x_e.grad)
    assert torch._dynamo.utils.counters["ca_dynsaved"]["passthrough_outputs"] == 0
