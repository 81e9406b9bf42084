"""The report's records: what the capture hooks and the runtime wrapper write, and
what ``report()`` returns inside its ``Report``.

A key's values are seen in bulk: the runtime wrapper notes each run's values as a
row (``CaptureRecord.observe``), and the rows are seen in batches, and before
anything reads the report (``flush_pending``), where a dict per key dedupes in C.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from .decision import STOCK, TRACED, Decision

#: Distinct values kept per key; more are counted (up to MAX_COUNTED), not kept.
MAX_VALUES = 8
MAX_COUNTED = 1024
_CAPACITY = MAX_VALUES + MAX_COUNTED
#: Captures kept (the newest): a bool or str saved value that is new at every step
#: makes a capture per step.
MAX_CAPTURES = 256
MAX_REFUSED = 64


@dataclass
class KeyReport:
    """One saved_data key of a C++ function, or one ctx attribute of a Python one."""

    key: str
    kind: str  # of its function: "C++" or "Python"
    type: str
    handling: str  # TRACED, OPAQUE, REUSED or STOCK (names.Handling)
    reason: str
    fix: str
    values: list[Any] = field(default_factory=list)  # distinct values seen, first MAX_VALUES
    more_values: int = 0  # distinct values seen beyond those (counted up to MAX_COUNTED)
    recompiles: int = 0  # Dynamo recompiles of CA graphs whose failed guard names it
    guard: str = ""  # the newest such failed guard, as Dynamo reported it
    # the _seen_key of every distinct value seen, up to _CAPACITY: a set lookup per
    # value instead of comparing with each value kept, and the count of the others
    _seen: set[Any] = field(default_factory=set, repr=False, compare=False)

    @property
    def compiles(self) -> int:
        """Compiles of CA graphs specialised on it: for a value Dynamo guards (a
        stock ctx attribute, a stock C++ int/float), the first compile and each
        recompile its guard caused; 0 for a value the plugin keeps out of guards."""
        guarded = self.handling == STOCK and (self.kind == "Python" or self.type in ("int", "float"))
        # A traced Python number the probe let through and Dynamo guarded after all.
        missed = self.handling == TRACED and self.kind == "Python" and self.recompiles > 0
        return 1 + self.recompiles if guarded or missed else 0

    def see_all(self, values: Sequence[Any]) -> None:
        """``see`` each of ``values``, in order, cheaply: those already seen are
        dropped in C (a set difference on ``_seen_key``'s keys), and once MAX_VALUES
        are kept the new ones are only counted, in bulk. A key observed on every
        backward costs next to nothing once its values recur or its count is full."""
        if len(self._seen) >= _CAPACITY:
            return
        try:
            keys = dict.fromkeys(zip(map(type, values), values))  # ordered, in C
            new = keys.keys() - self._seen
        except TypeError:  # an unhashable value
            for value in values:
                self.see(value)
            return
        if not new:
            return
        if len(self.values) < MAX_VALUES:
            for key in keys:
                if key in new:
                    self.see(key[1])
            return
        fresh = [_seen_key(value) for _, value in new]  # NaN under one key
        self._seen.update(fresh[: _CAPACITY - len(self._seen)])
        self.more_values = min(len(self._seen) - len(self.values), MAX_COUNTED)

    def see(self, value: Any) -> None:
        if len(self._seen) >= _CAPACITY:
            return
        key = _seen_key(value)
        if key in self._seen:
            return
        self._seen.add(key)
        if len(self.values) < MAX_VALUES and not any(_same(seen, value) for seen in self.values):
            self.values.append(value)
            return
        self.more_values = min(len(self._seen) - len(self.values), MAX_COUNTED)


def _seen_key(value: Any) -> Any:
    """A set key equal for values ``_same`` calls equal: (type, value) for a hashable
    value (NaN by its repr), (type, repr) for any other."""
    if type(value) is float and value != value:
        return (float, "nan")
    try:
        hash(value)
    except TypeError:
        return (type(value), repr(value))
    return (type(value), value)


def _same(a: Any, b: Any) -> bool:
    """Equal values for the report; never raises (an array's ``==`` is no bool)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b) or bool(a != a and b != b)  # NaN is NaN
    except Exception:
        return False


@dataclass
class FunctionReport:
    """One custom function (C++ class or Python Function), over all captures."""

    name: str
    kind: str  # "C++" or "Python"
    opaque: bool
    reason: str  # why it kept stock behaviour, or why a Python function runs as it does
    keys: dict[str, KeyReport] = field(default_factory=dict)
    handling: str = ""  # "opaque", "stock" or (Python) "traced-dynamic"


@dataclass(frozen=True)
class NodeRecord:
    """One custom-function node of one CA capture."""

    name: str
    opaque: bool  # True: run through an opaque op; False: traced (stock or dynamic)
    keys: tuple[str, ...]  # saved_data keys, or ctx attribute names
    kinds: tuple[str, ...]  # per key: "int"/"float" (lifted, dynamic) or a type name
    reason: str = ""  # why the node kept stock behaviour, or runs as it does
    handling: str = ""  # "opaque", "stock" or "traced-dynamic"
    # what decided it, with the plan the capture carried out (decision.py)
    decision: Decision | None = field(default=None, compare=False, repr=False)


@dataclass
class CaptureRecord:
    """One CA capture made with the plugin."""

    ca_id: int  # CA's graph id: Dynamo's compile ids of this graph start "!<ca_id>/"
    start_time_us: int
    nodes: list[NodeRecord] = field(default_factory=list)
    # How its graph got compiled code: "" until its first run is done, then
    # "compiled" (a new structure) or "reused" (the code of an equal graph).
    compiled: str = ""
    scalars: dict[int, KeyReport] = field(default_factory=dict)  # lifted scalar index
    hooks: dict[int, FunctionReport] = field(default_factory=dict)  # ctx index in hooks
    # verify: steps an opted-in traced node ran opaque, newest MAX_REFUSED kept:
    # (node, its saved numbers, why the check refused them)
    refused: deque[tuple[str, dict[str, Any], str]] = field(default_factory=lambda: deque(maxlen=MAX_REFUSED))
    # Callbacks queued during its runs (queue_callback) that the plugin ran after
    # the graph; stock CA drops them (runtime.running_final_callbacks).
    final_callbacks: int = 0
    # the run on which its later hashed combinations got their own traced graph
    # (ways.tiered.wrap), or 0
    specialised: int = 0
    # the run on which that graph gave way to the opaque one (it kept recompiling,
    # or ran slower: ways.tiered.wrap), or 0
    despecialised: int = 0
    # a measured tiered capture's (ways.tiered.wrap) median run of its opaque graph and
    # of its own, in µs, once both are timed
    tier_times_us: tuple[float, float] | None = None
    # checkpointed saved tensors its graph unpacks with the plugin's op (checkpoint.py),
    # and why a run took the stock twin instead ("" if none did)
    unpacks: int = 0
    unpack_fallback: str = ""
    # combinations of the bools / strs its traced Python nodes read that run its
    # graph uncompiled (ways.python_traced.Combinations): (ctx.name -> value, why)
    eager_combinations: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    # those that run the capture's opaque graph instead, where every such node has
    # its opaque op there (ways.python_traced.Combinations.shared)
    opaque_combinations: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    # runs observed and not yet seen by the report's keys (observe / _flush), and
    # the (hook index, ctx attribute) of each of their hook values
    _rows: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = field(default_factory=list, repr=False)
    _layout: list[tuple[int, str]] = field(default_factory=list, repr=False)

    def refuse(self, name: str, values: dict[str, Any], reason: str) -> None:
        self.refused.append((name, values, reason))

    def observe(self, scalars: Any, hooks: Any) -> None:
        """Note the values this run carries (called by the runtime wrapper, on every
        backward): kept as a row and seen in batches (``_flush``), where a dict per
        key dedupes in C what ``KeyReport.see`` would do per value in Python. A row
        keeps plain values only: any other ctx attribute (which may hold tensors)
        is seen at once rather than kept alive for later steps."""
        if not self._rows:
            self._layout = [(index, name) for index, function in self.hooks.items() for name in function.keys]
            _PENDING[id(self)] = self
        values = [getattr(hooks[index], name, None) for index, name in self._layout]
        if not _KEPT.issuperset(map(type, values)):
            for n, value in enumerate(values):
                if type(value) not in _KEPT:
                    index, name = self._layout[n]
                    key = self.hooks[index].keys.get(name)
                    if key is not None:
                        key.see(value)
                    values[n] = _SEEN
        self._rows.append((tuple(scalars), tuple(values)))
        if len(self._rows) >= _BATCH:
            self._flush()

    def _flush(self) -> None:
        rows, self._rows = self._rows, []
        _PENDING.pop(id(self), None)
        if not rows:
            return
        scalar_rows, hook_rows = zip(*rows)
        columns = list(zip(*scalar_rows))  # transposed in C
        for index, key in self.scalars.items():
            key.see_all(columns[index])
        columns = list(zip(*hook_rows))
        for n, (index, name) in enumerate(self._layout):
            key = self.hooks[index].keys.get(name)
            if key is not None:
                key.see_all([v for v in columns[n] if v is not _SEEN])

    @property
    def observes(self) -> bool:
        return bool(self.scalars or self.hooks)


@dataclass
class UncapturedRecord:
    """A graph structure the plugin runs without compiled autograd (``payoff.py``)."""

    captures: int  # in a row, when it was decided
    nodes: tuple[str, ...]  # its custom-function nodes, as in its newest capture
    changed: dict[str, int]  # "function.key" of hashed saved values -> distinct values seen by then
    backwards: int = 0  # run without CA since
    tries: int = 0  # backwards tried under CA again that captured (or failed) again
    returned: bool = False  # a try hit CA's cache: it runs under CA again
    why: str = ""  # CA could not collect it (gate.py), or "": its captures kept changing

    @property
    def reason(self) -> str:
        state = "back under compiled autograd (a try hit its cache)" if self.returned else (
            f"{self.backwards} backwards run as plain autograd, {self.tries} tries under compiled autograd "
            + ("failed again" if self.why else "captured again")
        )
        if self.why:
            return f"compiled autograd cannot collect its graph: {self.why}; {state}"
        changed = ", ".join(f"{k} ({n} values)" for k, n in self.changed.items()) or "no custom-function value"
        return (
            f"captured {self.captures} backwards in a row (the saved values compiled autograd hashes "
            f"changed: {changed}), so no capture could pay off; {state}"
        )


#: Records holding observed runs not yet seen (CaptureRecord.observe), flushed in
#: batches of _BATCH runs and before anything reads the report.
_PENDING: dict[int, CaptureRecord] = {}
_BATCH = 64
#: Types of the values a row keeps (CaptureRecord.observe).
_KEPT = frozenset({int, float, bool, str, type(None)})
_SEEN = object()  # in a row: a value observe() saw at once


def flush_pending() -> None:
    for record in list(_PENDING.values()):
        record._flush()


def clear_pending() -> None:
    """Drop the rows not yet seen (the report is being emptied)."""
    _PENDING.clear()
