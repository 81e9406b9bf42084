"""The capture's differential check of a traced C++ node: the graph against the node.

A traced node's region of the CA graph (its ops as the capture recorded them, the
lifted values swapped in) must compute what the node's own backward computes. The
proofs before it (``cpptrace.verdict``'s symbolic probe, ``sentinel.plan``'s
recordings) reason about what they saw; some C++ they cannot see: a branch on an
``IValue``'s tag (``v.isInt()``) takes another way under the symbolic probe than with
a real int, and the recordings run real tensors while the capture traces fake ones.
So at capture, once per traced node, both run on the same small random inputs with
the capture's values (a sentinel-traced node whose capture values verify refuses:
sentinel set 0's, the values its graph is built from), and must agree, or the node
runs opaque.

Random, not zeros: a region that takes one tensor where the node takes another, or
the arguments of a subtraction the other way round, gives other numbers. What equal
numbers cannot show (a branch whose two sides agree on these inputs) is what the
recordings compare op by op; this check is the one that runs the graph itself.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ._compat.dynamo import exception_line
from ._compat.symbolic import real_tensors_only
from .recording import Inputs

#: The generator's seed: a check is the same at every capture.
SEED = 20261206


def _random(sizes: Sequence[int], dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """Values in [0.5, 1.5) for a floating tensor (no sign change, no NaN from a
    log or a root to hide a difference behind), zeros otherwise (indices)."""
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.rand(list(sizes), generator=generator, dtype=dtype) + 0.5).to(device)
    return torch.zeros(list(sizes), dtype=dtype, device=device)


class _Region:
    """Evaluates a region of the CA graph on chosen values for its inputs: ``seeds``
    (a node -> its value: the incoming grads, the saved tensors, the scalars
    placeholder); a node outside the region is computed from the seeds when it can
    be (the packed scalars' reads at the graph's head)."""

    def __init__(self, seeds: dict[torch.fx.Node, Any]) -> None:
        self.env = dict(seeds)

    def value(self, node: torch.fx.Node) -> Any:
        found = self.env.get(node, self)
        if found is not self:
            return found
        if node.op != "call_function":
            raise LookupError(f"the region reads {node.op} {node.name}, which the check does not give")
        args = torch.fx.node.map_arg(node.args, self.value)
        kwargs = torch.fx.node.map_arg(node.kwargs, self.value)
        result = self.env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
        return result


def differs(
    inputs: Inputs,
    values: Sequence[Any],
    region: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node | None],
    grads: Sequence[torch.fx.Node | None],
    saved: Sequence[torch.fx.Node | None],
    scalars: tuple[torch.fx.Node, list[Any]],
    capture_sizes: tuple[list[Any], list[Any]],
) -> str:
    """'' when the ``region`` (whose results are ``outputs``), run with ``grads`` and
    ``saved`` (the nodes it reads them from) bound to random tensors and the scalars
    placeholder to ``scalars[1]``, gives what the node's own backward gives on the
    same tensors with saved ``values``; else how they differ. Tried on the small
    sizes of ``inputs`` first, then on the capture's (``capture_sizes``: saved,
    grads), for a backward whose ops hold literal sizes."""
    small = inputs.tensors(lambda sizes, dtype, device: (sizes, dtype, device))
    first = ""
    for layout in (small, capture_sizes):
        found = _compare(inputs, values, region, outputs, grads, saved, scalars, layout)
        if found is None:
            return ""
        first = first or found
        if not found.startswith("could not run"):
            return found
    return first


def _compare(
    inputs: Inputs, values: Sequence[Any], region: Sequence[torch.fx.Node], outputs: Sequence[torch.fx.Node | None],
    grads: Sequence[torch.fx.Node | None], saved: Sequence[torch.fx.Node | None],
    scalars: tuple[torch.fx.Node, list[Any]], layout: tuple[list[Any], list[Any]],
) -> str | None:
    generator = torch.Generator().manual_seed(SEED)

    def made(x: Any) -> Any:
        return _random(*x, generator) if isinstance(x, tuple) else x

    with real_tensors_only(), torch.no_grad():
        saved_values = [made(x) for x in layout[0]]
        grad_values = [None if g is None else made(g) for g in layout[1]]
        try:
            want = list(inputs.run(values, [_copy(t) for t in saved_values], [_copy(g) for g in grad_values]))
        except Exception as e:  # noqa: BLE001 - the node itself fails here: no comparison
            return f"could not run its own backward on these inputs ({exception_line(e)})"
        seeds: dict[torch.fx.Node, Any] = {scalars[0]: scalars[1]}
        for node, value in [*zip(grads, grad_values), *zip(saved, saved_values)]:
            if node is not None:
                seeds[node] = _copy(value)
        evaluate = _Region(seeds)
        try:
            for node in region:
                if node.op == "call_function":
                    evaluate.value(node)
            got = [None if o is None else evaluate.value(o) for o in outputs]
        except Exception as e:  # noqa: BLE001 - the region cannot run alone: no comparison
            return f"could not run its traced graph on these inputs ({exception_line(e)})"
        return _difference(got, want)


def _copy(t: Any) -> Any:
    return t.clone() if isinstance(t, torch.Tensor) else t


def _difference(got: Sequence[Any], want: Sequence[Any]) -> str | None:
    """None when each traced result equals the node's (None where it gives None),
    else the first difference."""
    if len(got) != len(want):
        return f"the traced graph gives {len(got)} gradients, its backward {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if (g is None) != (w is None):
            return f"gradient {i} is {'undefined' if g is None else 'defined'} in the traced graph, not in its backward"
        if g is None:
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"gradient {i} is {g.dtype}{list(g.shape)} in the traced graph, {w.dtype}{list(w.shape)} in its backward"
        try:
            torch.testing.assert_close(g, w, equal_nan=True, check_stride=False)
        except AssertionError:
            worst = (g - w).abs().max().item() if g.is_floating_point() else "?"
            return f"gradient {i} differs between the traced graph and its backward (by up to {worst})"
    return None
