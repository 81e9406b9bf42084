"""Whether capturing a backward can pay off: a graph whose captures keep changing
runs as plain autograd, which is what its steps then cost least as.

CA hashes the saved values it does not lift (a bool, a str, a list such as a
GNN function's ``src.sizes()``): each new value is a new capture, tens of
milliseconds of CA's Python for a few dozen nodes (DESIGN-NOTES §10), and a
capture's first run is the captured graph run eagerly (``runtime.py``). A graph
whose hashed values change every batch is captured every step, and its compiled
code never runs: each step costs a capture plus an eager run, several times eager.

The policy, per structure of the autograd graph (the node types and edges,
walked from the backward's roots):

* a structure captured ``torch._dynamo.config.recompile_limit`` (8) backwards in a
  row runs without compiled autograd from then on: the engine's own backward,
  eager's result by definition. The same limit, and the same way out, as Dynamo's
  for a frame that keeps recompiling; a few hashed values that cycle (a flag, a
  mode, bucketed sizes) stay under it and keep hitting CA's cache;
* of those, one backward in ``retry`` runs under CA again (``retry`` from
  ``FIRST_RETRY``, doubling up to ``MAX_RETRY`` while it still captures): a cache
  hit (the values came back, e.g. bucketed batch sizes) returns it to CA;
* the walk (a Python step per node) runs only while it can matter: after a backward
  that captured, and while a structure runs without CA. A steady loop that hits
  the cache never walks.

A structure CA cannot collect (``uncollectable``: the gate saw CA's collection
assert on it) is sent to plain autograd the same way, retried as rarely.

Never about correctness: a structure key that confused two graphs would only pick
the slower of two right answers. ``report()`` lists each structure run without CA,
the hashed saved values that changed (or why CA cannot collect it), and how many
backwards ran so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

from .counting import count
from ._compat.capture import capture_count, no_ca, node_name
from .caches import on_reset
from . import report
from .records import UncapturedRecord


def misses_allowed() -> int:
    """Consecutive captures of one structure before it runs without CA."""
    return int(torch._dynamo.config.recompile_limit)


#: A structure run without CA tries CA again after this many backwards, doubling up
#: to MAX_RETRY while the try still captures.
FIRST_RETRY = 64
MAX_RETRY = 4096
#: Structures remembered (the oldest is forgotten beyond).
MAX_STRUCTURES = 64


@dataclass
class _Structure:
    misses: int = 0  # captures in a row
    uncaptured: bool = False  # runs without CA
    retry: int = FIRST_RETRY  # backwards without CA before the next try under CA
    since_try: int = 0
    record: UncapturedRecord | None = field(default=None, repr=False)


_structures: dict[Hashable, _Structure] = {}
_watching = [True]  # walk the next backward's graph


@on_reset
def clear() -> None:
    _structures.clear()
    _watching[0] = True


def structure_key(roots: Any) -> Hashable:
    """The autograd graph below ``roots`` (tensors or gradient edges) as node types
    and edges, in a fixed depth-first order."""
    nodes = [getattr(r, "grad_fn", None) if isinstance(r, torch.Tensor) else getattr(r, "node", None) for r in roots]
    order: dict[Any, int] = {}
    key: list[Any] = []
    stack = [n for n in nodes if n is not None]
    while stack:
        node = stack.pop()
        if node in order:
            continue
        order[node] = len(order)
        edges = node.next_functions
        edge_key = tuple((-1 if m is None else order.get(m, -2), i) for m, i in edges)
        key.append((type(node), node_name(node), edge_key))
        stack.extend(m for m, _ in edges if m is not None)
    return tuple(key)


def roots(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The roots of a ``run_backward`` call (its tensors or gradient edges)."""
    return args[0] if args else kwargs.get("tensors", ())


def _structure(roots_: Any) -> _Structure:
    key = structure_key(roots_)
    structure = _structures.get(key)
    if structure is None:
        if len(_structures) >= MAX_STRUCTURES:
            _structures.pop(next(iter(_structures)))
        structure = _structures[key] = _Structure()
    return structure


def uncollectable(roots_: Any, reason: str, nodes: Sequence[str]) -> None:
    """The structure below ``roots_`` runs without CA from now on, as one whose
    captures keep changing does (the same retries): CA could not collect it
    (``reason``; ``nodes``: its C++ custom functions, one of which is why)."""
    structure = _structure(roots_)
    if structure.uncaptured:  # a retry that failed again
        structure.retry = min(2 * structure.retry, MAX_RETRY)
        assert structure.record is not None
        structure.record.tries += 1
    else:
        structure.uncaptured = True
        structure.since_try = 0
        structure.record = report.uncaptured(0, why=reason, nodes=tuple(nodes))
    _watching[0] = True


def run(run_backward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A backward under a plugin context (``gate.gate``): under CA, or without it
    where the policy says so."""
    if not _watching[0]:
        before = capture_count()
        out = run_backward(*args, **kwargs)
        if capture_count() != before:
            _watching[0] = True
        return out
    structure = _structure(roots(args, kwargs))
    if structure.uncaptured:
        structure.since_try += 1
        if structure.since_try < structure.retry:
            assert structure.record is not None
            structure.record.backwards += 1
            count("uncaptured_backwards")
            with no_ca():
                return run_backward(*args, **kwargs)
        structure.since_try = 0
    before = capture_count()
    out = run_backward(*args, **kwargs)
    _note(structure, captured=capture_count() != before)
    return out


def _note(structure: _Structure, captured: bool) -> None:
    if captured:
        structure.misses += 1
        if structure.uncaptured:
            structure.retry = min(2 * structure.retry, MAX_RETRY)
            assert structure.record is not None
            structure.record.tries += 1
        elif structure.misses >= misses_allowed():
            structure.uncaptured = True
            structure.retry = FIRST_RETRY
            structure.record = report.uncaptured(structure.misses)
    else:
        structure.misses = 0
        if structure.uncaptured:
            structure.uncaptured = False
            assert structure.record is not None
            structure.record.returned = True
    _watching[0] = captured or any(s.uncaptured for s in _structures.values())
