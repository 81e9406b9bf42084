"""What the plugin did with each custom function, and why: the explain report.

The capture hooks (``compiler.py``) hand over each node's ``decision`` as it is
(``node``); the runtime wrapper adds the values each run carries; ``report()``
attributes Dynamo's recompiles of CA graphs to the saved key or ctx attribute
behind them (``explain.py``, which also words each key's reason and fix and the
table). The result is plain data (``to_dict`` / ``to_json``) and prints as a table;
its records (a function's, a key's, a capture's) are ``records.py``'s.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .caches import on_reset
from .decision import HASHED_ONLY, OPAQUE, REUSED, STOCK, TRACED, Decision
from .explain import attribute_recompiles, format_table, reason_and_fix
from .probe import is_number
from .records import (
    MAX_CAPTURES, CaptureRecord, FunctionReport, KeyReport, NodeRecord, UncapturedRecord, clear_pending, flush_pending,
)


@dataclass
class Report:
    """What ``ca_dynsaved.report()`` returns: what the plugin did with each custom
    function since the last reset. One live object, updated by later backwards and
    emptied by ``reset_report()``; ``to_dict()`` is a snapshot.

    Attributes:
        functions: dict, function name -> ``FunctionReport``: ``.name``, ``.kind``
            ("C++" or "Python"), ``.handling`` ("traced-dynamic", "opaque" or
            "stock"), ``.opaque``, ``.reason`` and ``.keys``: saved key / ctx
            attribute -> ``KeyReport`` (``.key``, ``.kind``, ``.type``, ``.handling``:
            its node's, or "stock" for a hashed value of a traced node, "reused"
            for one of an opaque C++ node; ``.reason``, ``.fix``,
            ``.values``: the first 8 distinct values, ``.more_values``: the count of
            the others, ``.recompiles`` / ``.guard``: Dynamo recompiles its guard
            caused, the newest guard, ``.compiles``).
        nodes: list of ``NodeRecord``, one per custom-function node of each kept
            capture: ``.name``, ``.opaque``, ``.keys``, ``.kinds``, ``.handling``,
            ``.reason``, ``.decision`` (the ``ca_dynsaved.decision.Decision`` the
            capture carried out: ``.plan``, ``.saved``, ``.verified``; not in
            ``to_dict``).
        captures: the newest 256 CA captures (``CaptureRecord``: ``.ca_id``,
            ``.nodes``, ``.compiled``: "compiled" or "reused", ``.refused``: steps
            ``verify`` ran a node opaque, ``.final_callbacks``).
        dropped_captures: how many older captures were dropped.
        uncaptured: graph structures run as plain autograd because no capture could
            pay off (``UncapturedRecord``: ``.nodes``, ``.reason``, ``.backwards``).

    Methods:
        to_dict(): plain data (functions, captures, dropped_captures, uncaptured).
        to_json(): ``to_dict()`` as JSON text (other values by ``repr``).
        __str__(): the table ``print(report)`` shows, then a note per function and
            key (reason, fix, the guard Dynamo recompiled on).

    Example::

        rep = ca_dynsaved.report()
        print(rep)
        handling = {n.name: n.handling for n in rep.nodes}
        json_text = rep.to_json()
    """

    captures: deque[CaptureRecord] = field(default_factory=lambda: deque(maxlen=MAX_CAPTURES))
    functions: dict[str, FunctionReport] = field(default_factory=dict)
    dropped_captures: int = 0  # older captures than those kept
    uncaptured: list[UncapturedRecord] = field(default_factory=list)

    @property
    def nodes(self) -> list[NodeRecord]:
        """Every node of every kept capture, oldest first."""
        return [n for capture in self.captures for n in capture.nodes]

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (dicts, lists, values as seen): keys
        ``functions``, ``captures``, ``dropped_captures``, ``uncaptured``."""
        return {
            "functions": [
                asdict(f) | {"keys": [_key_dict(k) for k in f.keys.values()]}
                for f in self.functions.values()
            ],
            "captures": [
                {
                    "ca_id": c.ca_id,
                    "compiled": c.compiled,
                    "nodes": [_node_dict(n) for n in c.nodes],
                    "refused": [list(r) for r in c.refused],
                    "final_callbacks": c.final_callbacks,
                    "specialised": c.specialised,
                    "despecialised": c.despecialised,
                    "tier_times_us": c.tier_times_us,
                }
                for c in self.captures
            ],
            "dropped_captures": self.dropped_captures,
            "uncaptured": [asdict(u) | {"reason": u.reason} for u in self.uncaptured],
        }

    def to_json(self) -> str:
        """``to_dict()`` as indented JSON; a value JSON cannot hold is its ``repr``."""
        return json.dumps(self.to_dict(), default=repr, indent=1)

    def __str__(self) -> str:
        """The table (function, key, type, handling, compiles, values seen), then a
        line per function and key: its reason, fix and the guard Dynamo named."""
        return format_table(self.functions, self.captures, self.uncaptured)


def _node_dict(node: NodeRecord) -> dict[str, Any]:
    """A node as plain data: its record's fields, not the decision's plan."""
    return {f.name: getattr(node, f.name) for f in fields(node) if f.name != "decision"}


def _key_dict(key: KeyReport) -> dict[str, Any]:
    data = asdict(key) | {"compiles": key.compiles}
    del data["_seen"]
    return data


_REPORT = Report()
# --- what the capture hooks call -------------------------------------------------------
#: TORCH_LOGS="ca_dynsaved" shows what the plugin did with each capture; "+ca_dynsaved"
#: adds the captured graph.
log = logging.getLogger("ca_dynsaved")


def log_capture(capture: CaptureRecord, graph_module: Any) -> None:
    """A capture's nodes, as decided, to the plugin's log (INFO), and its graph (DEBUG)."""
    if not log.isEnabledFor(logging.INFO):
        return
    for node in capture.nodes:
        what = f"{node.handling} ({node.reason})" if node.reason else node.handling
        keys = ", ".join(f"{k}: {t}" for k, t in zip(node.keys, node.kinds))
        log.info("capture !%d: %s %s; saved %s", capture.ca_id, node.name, what, keys or "nothing")
    log.debug("capture !%d graph:\n%s", capture.ca_id, graph_module.code)


def begin_capture(ca_id: int) -> CaptureRecord:
    record = CaptureRecord(ca_id, time.time_ns() // 1000)
    if len(_REPORT.captures) == _REPORT.captures.maxlen:
        _REPORT.dropped_captures += 1
    _REPORT.captures.append(record)
    return record


def _function(name: str, kind: str, handling: str, reason: str) -> FunctionReport:
    function = _REPORT.functions.get(name)
    if function is None or (function.handling, function.reason) != (handling, reason):
        # A function's handling can change (options, policy, a later combination of
        # its hashed values): the newest wins; the values seen stay its keys'.
        old, function = function, FunctionReport(name, kind, handling == OPAQUE, reason, handling=handling)
        if old is not None:
            function.keys.update(old.keys)
        _REPORT.functions[name] = function
    return function


def _key(function: FunctionReport, key: str, type_: str, handling: str, node_reason: str) -> KeyReport:
    entry = function.keys.get(key)
    if entry is None or (entry.type, entry.handling) != (type_, handling):
        chosen = function.handling == TRACED or node_reason == HASHED_ONLY
        reason, fix = reason_and_fix(function.kind, key, type_, handling, node_reason, chosen)
        old, entry = entry, KeyReport(key, function.kind, type_, handling, reason, fix)
        if old is not None and old.type == type_:  # the values seen, whatever ran them
            entry.values, entry.more_values, entry._seen = old.values, old.more_values, old._seen
        function.keys[key] = entry
    return entry


def node(capture: CaptureRecord, decision: Decision, hook: int = -1) -> None:
    """A node's ``decision``, as it is: its function's row (the newest decision of a
    function wins), a row per saved key or ctx attribute, and the capture's
    ``NodeRecord``. ``hook``: a Python node's index in CA's hooks (its ctx's values
    are observed there on every run); a C++ node's lifted keys are observed in the
    graph's scalars."""
    handling, reason = decision.handling, decision.reason
    function = _function(decision.name, decision.kind, handling, reason)
    for key, type_, value, lifted in decision.saved:
        entry = _key(function, key, type_, _key_handling(decision, value, lifted), reason)
        entry.see(value)
        if lifted is not None:
            capture.scalars[lifted] = entry
    if decision.kind == "Python" and decision.saved:
        capture.hooks[hook] = function
    keys = tuple(key for key, _, _, _ in decision.saved)
    kinds = tuple(type_ for _, type_, _, _ in decision.saved)
    capture.nodes.append(NodeRecord(decision.name, handling == OPAQUE, keys, kinds, reason, handling, decision))


def _key_handling(decision: Decision, value: Any, lifted: int | None) -> str:
    """How the plugin handles one saved key / ctx attribute of a node so decided."""
    if decision.handling == STOCK:
        return STOCK
    if decision.handling == TRACED:  # a number dynamic; a hashed value as stock has it
        number = lifted is not None if decision.kind == "C++" else is_number(value)
        return TRACED if number else STOCK
    if decision.kind == "C++" and lifted is None:  # opaque: the captures share code
        return REUSED
    return OPAQUE


def report() -> Report:
    """Every custom function the plugin has seen since the last reset, with its
    saved keys / ctx attributes, their values, handling, reason and fix.

    Takes no arguments. Returns the ``Report`` (see ``help(type(report()))``), with
    Dynamo's recompiles of CA graphs attributed to the key or attribute whose
    guard failed; the same object at every call, brought up to date.

    Example::

        with ca_dynsaved.enable(backend="aot_eager"):
            loss.backward()
        print(ca_dynsaved.report())  # or .to_dict(), .to_json(), .nodes
    """
    flush_pending()
    attribute_recompiles(_REPORT.functions, _REPORT.captures)
    return _REPORT


def uncaptured(captures: int, why: str = "", nodes: tuple[str, ...] = ()) -> UncapturedRecord:
    """A structure just sent to plain autograd after ``captures`` captures in a row
    (the newest captures): what its nodes are and which hashed values changed; or,
    with ``why``, one CA could not collect (no capture)."""
    if why:
        record = UncapturedRecord(0, nodes, {}, why=why)
        _REPORT.uncaptured.append(record)
        return record
    flush_pending()
    newest = list(_REPORT.captures)[-captures:]
    nodes = newest[-1].nodes if newest else []
    changed: dict[str, int] = {}
    for node in nodes:
        function = _REPORT.functions.get(node.name)
        for key, kind in zip(node.keys, node.kinds):
            entry = function.keys.get(key) if function is not None else None
            if entry is not None and entry.handling != TRACED and kind not in ("int", "float"):
                distinct = len(entry.values) + entry.more_values
                if distinct > 1:
                    changed[f"{node.name}.{key}"] = distinct
    record = UncapturedRecord(captures, tuple(n.name for n in nodes), changed)
    _REPORT.uncaptured.append(record)
    return record


@on_reset
def reset_report() -> None:
    """Empty the report (``report()``): its functions, captures and uncaptured
    structures. Compiled graphs and caches stay: a backward whose graph is already
    in the CA cache is not captured again, so it does not reappear in the report
    (``reset()`` drops both, to start over). Takes no arguments and returns None.

    Example::

        print(ca_dynsaved.report())
        ca_dynsaved.reset_report()  # e.g. after the warm-up steps
    """
    clear_pending()
    _REPORT.dropped_captures = 0
    _REPORT.captures.clear()
    _REPORT.functions.clear()
    _REPORT.uncaptured.clear()


