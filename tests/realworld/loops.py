"""Training loops on third-party libraries, run eagerly, under stock CA and under the
plugin, each from a fresh compile state: counts with torch's counters, gradients kept
for comparing with eager."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch._dynamo.utils import counters

import ca_dynsaved
from helpers import Counts, assert_grads_equal, counts, stock_enable

MODES = ("eager", "stock", "plugin")
BACKEND = "aot_eager"  # the compile counts are the backend's to keep, not its kernels


def backward_under(mode: str, **options: Any) -> Any:
    """The context ``loss.backward()`` runs in for ``mode``."""
    if mode == "eager":
        return contextlib.nullcontext()
    if mode == "stock":
        return stock_enable(BACKEND)
    return ca_dynsaved.enable(backend=BACKEND, **options)


def train(
    step: Callable[[int], torch.Tensor],
    params: Sequence[torch.Tensor],
    mode: str,
    steps: int,
    **options: Any,
) -> tuple[Counts, list[list[torch.Tensor | None]]]:
    """``steps`` steps of ``step(i)`` (a loss) then its backward under ``mode``, from a
    fresh compile state; the counts and each step's gradients of ``params``."""
    ca_dynsaved.reset()
    counters.clear()
    grads = []
    for i in range(steps):
        for p in params:
            p.grad = None
        loss = step(i)
        with backward_under(mode, **options):
            loss.backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in params])
    return counts(), grads


def compare(
    step: Callable[[int], torch.Tensor], params: Sequence[torch.Tensor], steps: int, **options: Any
) -> dict[str, Counts]:
    """Counts of stock and the plugin over the same steps; both modes' gradients
    asserted equal to eager's at every step."""
    _, want = train(step, params, "eager", steps)
    found = {}
    for mode in ("stock", "plugin"):
        found[mode], got = train(step, params, mode, steps, **(options if mode == "plugin" else {}))
        assert_steps_equal(got, want)
    return found


def node(name: str) -> Any:
    """The report's record of the first node named ``name``."""
    return next(n for n in ca_dynsaved.report().nodes if n.name == name)


def assert_steps_equal(got: list[list[Any]], want: list[list[Any]]) -> None:
    """Every step's gradients equal (``None`` where eager's is)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_grads_equal(g, w)
