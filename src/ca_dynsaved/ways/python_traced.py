"""The traced way of a Python node: stock CA traces its backward, its ctx numbers
dynamic from the first compile (``decision.PythonTrace``).

A backward that also reads bools / strs / Nones is guarded by Dynamo on them, as
under stock (a compile per combination); the probe walked it for the capture's
combination only, so each new combination is probed before it compiles
(``Combinations``, from the node's ``GuardedNode``), and the ones it refuses, or
those past the cap, run elsewhere (the capture's opaque graph: ``tiered.GUARDED``;
else the graph uncompiled).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from .._compat.layout import grads_of
from .. import probe
from ..decision import PythonTrace
from ..records import CaptureRecord
from ..state import Capture

log = logging.getLogger("ca_dynsaved")


def trace_python(
    cap: Capture, plan: PythonTrace, hook: int, name: str, saved: Sequence[Any], metadatas: Sequence[Any], ctx: Any
) -> None:
    """Stock tracing (the caller's), with the ctx numbers dynamic from the first
    compile; each new combination of its guarded values probed before it compiles."""
    cap.dynamic_sources.extend(plan.sources)
    if plan.guarded:
        cap.guarded.append(GuardedNode(
            name, hook, plan.guarded, tuple(saved), tuple(m is not None for m in metadatas), grads_of(ctx)
        ))


@dataclass(frozen=True)
class GuardedNode:
    """A traced Python node whose backward reads bools / strs / Nones (``guarded``):
    its ctx is ``hooks[hook]``; ``saved``, ``tensor_inputs`` and ``grads`` (the
    capture's, as its sizes are ``saved``'s) are what its probe needs
    (``probe.verdict``)."""

    name: str
    hook: int
    guarded: tuple[str, ...]
    saved: tuple[Any, ...]
    tensor_inputs: tuple[bool, ...]
    grads: tuple[Any, ...]


#: Combinations of a capture's guarded ctx values (``Combinations``) that may compile:
#: each is a compile (Dynamo guards them, as under stock CA); past these, a new one
#: runs the capture's opaque graph, compiled once, its compile the cap's last (so
#: never more compiles than stock, which runs eagerly past Dynamo's recompile limit
#: of 8), or, where a guarded node has no opaque op, the graph uncompiled, as stock.
MAX_GUARDED_COMBINATIONS = 8


class Combinations:
    """The combinations of the guarded ctx values of a capture's traced Python
    nodes. The probe walked the backward for the capture's combination only; a
    backward may branch on a str into math the probe has not seen (a number that
    needs its value, a float the backend cannot take). So each new combination is
    probed (``probe.verdict``, the real ctx's values) before Dynamo compiles it: one
    the probe traces runs compiled (Dynamo's guard on it, a compile, as stock); one
    it refuses, or one past ``MAX_GUARDED_COMBINATIONS``, is sent away (``away``)
    each time it comes: where ``shared`` (every guarded node also has its opaque op
    in the capture's opaque graph: ``tiered.GUARDED``) to that graph, compiled,
    else to the graph run uncompiled, eagerly."""

    def __init__(self, nodes: Sequence[GuardedNode], record: CaptureRecord, shared: bool = False) -> None:
        self.nodes = tuple(nodes)
        self.record = record
        self.shared = shared
        self._reads = [(node.hook, name) for node in self.nodes for name in node.guarded]
        self._away: dict[tuple[Any, ...], bool] = {}  # combination -> sent away
        self._compiled = 0
        self._cap = MAX_GUARDED_COMBINATIONS - 1 if shared else MAX_GUARDED_COMBINATIONS

    def away(self, hooks: Sequence[Any]) -> bool:
        """Whether this run's combination is sent away from the traced graph."""
        combination = tuple(getattr(hooks[i], name, None) for i, name in self._reads)
        found = self._away.get(combination)
        if found is None:
            found = self._away[combination] = self._refusal(hooks, combination)
        return found

    def _refusal(self, hooks: Sequence[Any], combination: tuple[Any, ...]) -> bool:
        reason = ""
        if self._compiled >= self._cap:
            reason = f"the capture has compiled {self._cap} combinations of them"
        for node in self.nodes if not reason else ():
            verdict = probe.verdict(hooks[node.hook], node.saved, node.tensor_inputs, node.grads)
            if not verdict.traced:
                reason = f"{node.name}: {verdict.reason}"
                break
        if not reason:
            self._compiled += 1
            return False
        values = dict(zip((f"ctx.{name}" for _, name in self._reads), combination))
        if self.shared:
            self.record.opaque_combinations.append((values, reason))
        else:
            self.record.eager_combinations.append((values, reason))
        where = "the capture's opaque graph" if self.shared else "the graph uncompiled"
        log.info("capture !%d: %s run %s: %s", self.record.ca_id, values, where, reason)
        return True
