"""Tracing C++ backwards that read saved numbers with ``toInt()`` / ``toDouble()``.

Such a backward turns the lifted symbol into a plain number, so a tracer cannot see
what it computes from it. It is traced anyway, by default (``decision.decide_cpp``;
``enable(trace_cpp=...)`` names functions the user vouches for): at capture the
functional runs with a *sentinel* in place of each number, and every op argument
equal to a sentinel becomes the lifted value (``ways.sentinel_traced``): an int as the graph's
symbolic scalar, a double (or an int cast to double) as the packed float64 tensor,
the op switched from ``X.Scalar`` to ``X.Tensor``. An argument computed from the
numbers (``2 * alpha``, ``k % 3``: a ``Derived``) becomes a graph input too, its
value per new tuple read from verify's run.

What the sentinels cannot show is checked (docs/cpp.md, "Why the default is sound"),
on recordings that hold where every tensor comes from (``recording``):

* ``plan`` (once per function and layout) records the backward twice on small
  real tensors, with two sentinel sets that differ in sign, parity and magnitude,
  and compares: the same ops, every argument equal in both (a tensor: from the same
  saved tensor, incoming grad or op result), the sentinel of the same saved number
  in both, or an int or double computed from them; the same tensors returned. A
  branch taken differently, a tensor picked or a result returned by value, a tensor
  no recorded op made (``from_blob``), a read of a tensor's sizes (``SizeWatched``
  tensors make it an op of the recording) or data: refused (the report says why; a
  ``trace_cpp`` name also warns), and the node stays opaque. A double may only
  reach an ``X.Scalar`` op's scalar on a floating tensor; anywhere else the backend
  would specialise it.
* Two sentinels cannot see everything (a branch both take the same way,
  ``std::min(k, 64)`` with both above 64). ``verify`` (always, except for a
  ``trace_cpp`` name with ``verify=False``) records the node the same way with
  each *new* tuple of values before the compiled graph uses it (``ways.verify``:
  one comparison of flat lists), and compares with the plan's template; on a
  difference that step runs the node directly (``ways.sentinel_traced.Fallback``),
  and the report names the node and the value.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .counting import count
from ._compat.dynamo import exception_line
from .caches import on_reset
from . import opaque
from .cpptrace import REWRITES
from . import recording
from .recording import UNKNOWN, Inputs, Recording, describe


def sentinel(kind: str, n: int, which: int) -> int | float:
    """The ``which``-th (0 or 1) sentinel of the ``n``-th saved number of ``kind``.
    The two differ in sign, parity and magnitude, so a transformation or a branch
    that depends on them usually differs between the traces; none is 0 or 1."""
    if kind is opaque.INT:
        return 7919 + 1000 * n if which == 0 else -(104728 + 1000 * n)
    return 0.3183098861837907 + n / 1024 if which == 0 else -(1.7320508075688772 + n / 1024)


@dataclass(frozen=True)
class Slot:
    """An op argument that is saved number ``key`` (``as_float``: an int cast to double)."""

    key: str
    kind: str
    as_float: bool = False


@dataclass(frozen=True)
class Derived:
    """An op argument the backward computes from its saved numbers (``2 * alpha``,
    ``k % 3``): lifted too, its value read from verify's run of each new tuple;
    ``index``: its place among the node's derived values."""

    kind: str
    index: int


_Op = tuple[Any, tuple[Any, ...]]  # (op, its argument leaves: the kwargs names, then each leaf)


@dataclass
class Plan:
    """Whether a node may be traced with sentinels, and the template ``verify`` checks.

    ``template``: sentinel set 0's recording, op by op, each sentinel argument a
    ``Slot``, each computed one a ``Derived``, each tensor its origin
    (``recording``); ``returned``: the origin of each returned tensor. The rest is
    the same template as one flat list, which a check compares in one C comparison
    once it has put the new values in: ``flat`` (sentinel set 0's), where each slot
    and derived value sits in it, the type each leaf must have, and where a float
    constant is zero (its sign is compared too: ``-0.0 == 0.0``)."""

    traced: bool
    reason: str
    template: tuple[_Op, ...] = ()
    kinds: dict[str, str] = field(default_factory=dict)  # saved key -> INT / FLOAT
    derived: tuple[tuple[int, int, str], ...] = ()  # (op index, leaf position, kind) per Derived
    returned: tuple[Any, ...] = ()
    flat: list[Any] = field(default_factory=list, repr=False)
    slots_at: tuple[tuple[int, str, bool], ...] = ()  # (flat position, key, as_float)
    derived_at: tuple[int, ...] = ()  # flat position of each Derived, by Derived.index
    types: list[type] = field(default_factory=list, repr=False)
    zeros_at: tuple[int, ...] = ()
    # verify's results, shared by every node of this plan: (its inputs' layout, values)
    # -> (refusal, derived values); a layer's worth of one function checks a tuple once
    checked: OrderedDict[tuple[Any, ...], tuple[str, tuple[Any, ...]]] = field(
        default_factory=OrderedDict, compare=False, repr=False
    )

    def derived_of(self, kind: str) -> list[int]:
        """The node's derived values of ``kind`` (their ``Derived.index``), in order."""
        return [i for i, (*_, k) in enumerate(self.derived) if k is kind]


_CACHE: dict[tuple[Any, ...], Plan] = {}


@on_reset
def clear() -> None:
    _CACHE.clear()
    _WARNED.clear()
    recording.clear()


def plan(name: str, inputs: Inputs, kinds: dict[str, str], warn: bool = False) -> Plan:
    """The verdict for this node's function and layout, traced on a miss; with
    ``warn`` (the user opted it in), a refusal warns once, naming the node and what
    it saw (otherwise the report says it)."""
    # the template holds the small tensors' layout (dtypes: a bf16 run of the same
    # function is another template) and the hashed values (by repr: a list or dict is
    # no dict key)
    key = (name, inputs.keys, tuple(kinds.values()), repr((inputs.saved, inputs.grads, inputs.constants)))
    found = _CACHE.get(key)
    if found is None:
        count("sentinel_plans")
        found = _CACHE[key] = _plan(inputs, kinds)
    if warn and not found.traced:
        refused(name, found.reason)
    return found


_WARNED: set[tuple[str, str]] = set()


def refused(name: str, reason: str) -> None:
    """Warn, once per node and reason, that trace_cpp could not trace this node."""
    if (name, reason) not in _WARNED:
        _WARNED.add((name, reason))
        warnings.warn(f"ca_dynsaved: trace_cpp refused {name}: {reason}; it runs opaque", stacklevel=3)


def values(kinds: dict[str, str], which: int) -> dict[str, int | float]:
    """Sentinel set ``which`` (0: the capture's) for saved keys of these kinds."""
    counts = {opaque.INT: 0, opaque.FLOAT: 0}
    found = {}
    for key, kind in kinds.items():
        found[key] = sentinel(kind, counts[kind], which)
        counts[kind] += 1
    return found


def match(leaf: Any, sentinels: dict[str, int | float], kinds: dict[str, str]) -> Slot | None:
    for key, value in sentinels.items():
        if type(leaf) is type(value) and leaf == value:
            return Slot(key, kinds[key])
        if kinds[key] is opaque.INT and type(leaf) is float and leaf == float(value):
            return Slot(key, opaque.INT, as_float=True)
    return None


def same(a: Any, b: Any) -> bool:
    """Equal op arguments: same type, and for floats the same bits' meaning (-0.0 is
    not 0.0, NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) or (a != a and b != b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an argument without a bool equality
        return a is b


def _plan(inputs: Inputs, kinds: dict[str, str]) -> Plan:
    sentinels = [values(kinds, 0), values(kinds, 1)]
    recordings = []
    for which, chosen in enumerate(sentinels):
        recording = inputs.record(inputs.values(chosen), dtypes=which == 0)
        if recording.error is not None:
            return Plan(False, f"its backward did not run on sentinel values ({exception_line(recording.error)})")
        recordings.append(recording)
    first, second = (r.ops() for r in recordings)
    dtypes = recordings[0].dtypes or {}
    if [op for op, _ in first] != [op for op, _ in second]:
        at = next((i for i, (a, b) in enumerate(zip(first, second)) if a[0] != b[0]), min(len(first), len(second)))
        return Plan(False, f"the ops it runs depend on saved values (op {at} differs between two sentinel traces: a branch)")
    for op, _ in first:
        refusal = _unseen_by_verify(op)
        if refusal:
            return Plan(False, refusal)
    ops = [op for op, _ in first]
    template = []
    derived: list[tuple[int, int, str]] = []
    for index, ((op, a_leaves), (_, b_leaves)) in enumerate(zip(first, second)):
        if len(a_leaves) != len(b_leaves):
            return Plan(False, f"the arguments of {op} (op {index}) depend on saved values")
        leaves = []
        for position, (a, b) in enumerate(zip(a_leaves, b_leaves)):
            slot_a = match(a, sentinels[0], kinds)
            slot_b = match(b, sentinels[1], kinds)
            if slot_a is not None or slot_b is not None:
                if slot_a != slot_b:
                    return Plan(False, f"argument {position - 1} of {op} is computed from a saved value ({a!r}, then {b!r})")
                refusal = _placement(op, a_leaves, position, slot_a, dtypes)
                if refusal:
                    return Plan(False, refusal)
                leaves.append(slot_a)
            elif position and (is_origin(a) or is_origin(b)):
                refusal = _flow(op, index, position, a, b, ops)
                if refusal:
                    return Plan(False, refusal)
                leaves.append(a)
            elif same(a, b):
                leaves.append(a)
            else:
                kind = number_kind(a, b)
                refusal = _derived_placement(op, a_leaves, position, kind, a, b, dtypes)
                if refusal:
                    return Plan(False, refusal)
                derived.append((index, position, kind))
                leaves.append(Derived(kind, len(derived) - 1))
        template.append((op, tuple(leaves)))
    returned, returned_b = recordings[0].returned(), recordings[1].returned()
    for i, (a, b) in enumerate(zip(returned, returned_b)):
        if a != b:
            return Plan(False, (
                f"which tensor it returns as gradient {i} depends on saved values ({describe(a, ops)} with "
                f"one sentinel set, {describe(b, ops)} with the other)"
            ))
        if a == UNKNOWN:
            return Plan(False, f"it returns as gradient {i} {describe(a)}, made outside dispatch: the recording cannot see its data")
    used = sorted({leaf.key for _, leaves in template for leaf in leaves if isinstance(leaf, Slot)})
    reason = "uses its saved numbers only as op arguments: " + (", ".join(used) or "none")
    if derived:
        reason += f", and {len(derived)} value{'s' if len(derived) > 1 else ''} computed from them (lifted per new value)"
    return _with_flat(Plan(True, reason, tuple(template), dict(kinds), tuple(derived), returned), recordings[0])


def is_origin(leaf: Any) -> bool:
    """A tensor's origin (``recording``): the only tuple among an op's leaves after
    the kwargs names, since lists and tuples are flattened."""
    return type(leaf) is tuple


def _flow(op: Any, index: int, position: int, a: Any, b: Any, ops: Sequence[Any]) -> str:
    """Why a tensor argument cannot be traced, or '': it must come from the same
    place with both sentinel sets, and from a recorded op or an input."""
    where = f"argument {position - 1} of {op} (op {index})"
    if a != b:
        return (
            f"which tensor it passes as {where} depends on saved values ({describe(a, ops)} with one sentinel "
            f"set, {describe(b, ops)} with the other)"
        )
    if a == UNKNOWN:
        return f"{where} is {describe(a)} (from_blob, a pointer, a global): the recording cannot see its data"
    return ""


def _with_flat(plan_: Plan, recording: Recording) -> Plan:
    """``plan_`` with its flat template (see ``Plan``) from sentinel set 0's recording."""
    flat = list(recording.flat)
    types = [type(leaf) for leaf in flat]
    slots, derived_at = [], [0] * len(plan_.derived)
    for (_, leaves), start in zip(plan_.template, recording.starts):
        for position, leaf in enumerate(leaves):
            at = start + 1 + position
            if type(leaf) is Slot:
                slots.append((at, leaf.key, leaf.as_float))
                types[at] = float if leaf.as_float or leaf.kind is opaque.FLOAT else int
            elif type(leaf) is Derived:
                derived_at[leaf.index] = at
                types[at] = int if leaf.kind is opaque.INT else float
    numbers = {at for at, *_ in slots} | set(derived_at)
    zeros = tuple(at for at, leaf in enumerate(flat) if type(leaf) is float and leaf == 0.0 and at not in numbers)
    plan_.flat, plan_.slots_at, plan_.derived_at, plan_.types, plan_.zeros_at = flat, tuple(slots), tuple(derived_at), types, zeros
    return plan_


def number_kind(a: Any, b: Any) -> str | None:
    """INT / FLOAT when both traces gave a number of that type there (a bool is no
    number here), else None."""
    if type(a) is type(b) is int:
        return opaque.INT
    if type(a) is type(b) is float:
        return opaque.FLOAT
    return None


def _floating_self(leaves: tuple[Any, ...], dtypes: dict[Any, torch.dtype]) -> bool:
    """The op's first argument is a floating-point tensor (``leaves[0]`` is the
    kwargs names, so argument 0 is ``leaves[1]``)."""
    dtype = dtypes.get(leaves[1]) if len(leaves) > 1 and is_origin(leaves[1]) else None
    return dtype is not None and dtype.is_floating_point


def _derived_placement(
    op: Any, leaves: tuple[Any, ...], position: int, kind: str | None, a: Any, b: Any, dtypes: dict[Any, torch.dtype]
) -> str:
    """Why an argument computed from the saved numbers cannot be lifted, or ''."""
    computed = f"argument {position - 1} of {op} is computed from a saved value ({a!r}, then {b!r})"
    if kind is None:
        return computed + ", and is not an int or a double"
    if kind is opaque.INT:
        return ""
    if op in REWRITES and position == 2 and _floating_self(leaves, dtypes):
        return ""
    return computed + (
        ", a double where the backend would specialise it (only the scalar of mul/add/sub/div/pow on a "
        "floating tensor can take it)"
    )


#: Tensor metadata whose value verify's small tensors do not share with the real
#: ones (the rank, ``aten.dim``, is fixed for a CA graph, and dtype and device
#: are not read through dispatch).
_METADATA = frozenset(
    f"aten::{name}" for name in (
        "size", "sym_size", "stride", "sym_stride", "numel", "sym_numel", "storage_offset",
        "sym_storage_offset", "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense",
    )
)


def _unseen_by_verify(op: Any) -> str:
    """Why ``op`` in a backward's recording makes verify blind to what it depends
    on, or '': a read of a tensor's sizes (verify runs tensors of at most 2 elements
    a dimension, so a branch on a size could go either way on the real ones), or of
    a tensor's data (verify runs zeros)."""
    name = getattr(getattr(op, "_schema", None), "name", "")
    if name in _METADATA:
        return f"its backward reads a tensor's sizes ({op}), which verify cannot check for other sizes"
    tags = getattr(op, "tags", ())
    if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags:
        return f"its backward reads a tensor's data ({op}), which verify cannot check"
    return ""


def _placement(op: Any, leaves: tuple[Any, ...], position: int, slot: Slot, dtypes: dict[Any, torch.dtype]) -> str:
    """Why a saved number cannot be made dynamic where it is, or ''. ``leaves[0]`` is
    the kwargs names, so an op's argument ``i`` is ``leaves[i + 1]``."""
    if slot.kind is opaque.INT and not slot.as_float:
        return ""  # a symbolic int graph input: Dynamo guards it if it must
    if op in REWRITES and position == 2 and _floating_self(leaves, dtypes):
        return ""
    what = "int cast to double" if slot.as_float else "double"
    return (
        f"saved '{slot.key}' (a {what}) reaches argument {position - 1} of {op}, where the "
        "backend would specialise it (only the scalar of mul/add/sub/div/pow on a floating tensor can take it)"
    )
