"""verify: each new tuple of a sentinel-traced node's saved numbers, checked before
the compiled graph uses it.

The node's plan (``sentinel.plan``) holds the template of its backward. ``Check``,
one per verified node of a capture, runs before each step: a tuple it has not seen
is recorded with those values (``check``: one comparison of flat lists against
the template, then, if that fails, leaf by leaf for the reason); the verdict is
cached per plan. A refused tuple runs that step with the node called directly
(``sentinel_traced.Fallback``); the values the backward computes from its numbers
(``sentinel.Derived``) come from this run and reach the graph as inputs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..counting import count
from .._compat.dynamo import exception_line
from .. import recording, sentinel
from ..recording import Inputs, Recording, describe
from ..scalars import picker

log = logging.getLogger("ca_dynsaved")


#: verify results kept per plan, the least recently used dropped first (a step counter
#: makes one a step; a tuple that comes back after this many others is checked again).
CHECKED_LIMIT = 256


@dataclass
class Check:
    """verify: which saved-number tuples of one opted-in node the template holds for."""

    name: str
    plan: sentinel.Plan
    inputs: recording.Inputs
    keys: tuple[str, ...]
    indices: tuple[int, ...]  # each key's index among the lifted scalars
    fallback: Any  # sentinel_traced.Fallback: what runs the node for a refused tuple
    # where its derived values go: (Derived.index, index among the graph's derived ints / floats)
    int_slots: tuple[tuple[int, int], ...] = ()
    float_slots: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        # what the check's result depends on besides the values: the plan (whose cache
        # it is) and the small tensors' layout
        self._layout = repr((self.inputs.saved, self.inputs.grads))
        self._pick = picker(self.indices)

    def verdict(self, scalars: Sequence[Any]) -> tuple[str, tuple[Any, ...]]:
        """('', the values the backward computes from them, which the graph takes as
        inputs) if these scalars' values may run traced; else (why not, ()). Cached
        per tuple, shared by the nodes of one plan; a float keyed by repr: -0.0 is
        not 0.0, and a NaN is unequal to itself."""
        values = self._pick(scalars)
        key = (self._layout, *[repr(v) if type(v) is float else v for v in values])
        checked = self.plan.checked
        found = checked.get(key)
        if found is not None:
            checked.move_to_end(key)  # the newest again: values that keep coming back stay
        else:
            count("verify_traces")
            found = checked[key] = check(self.plan, self.inputs, dict(zip(self.keys, values)))
            if len(checked) > CHECKED_LIMIT:  # values new every step: keep the newest
                checked.popitem(last=False)
            if found[0]:
                # The report keeps it (CaptureRecord.refused); never the user's WARNING log.
                log.info("ca_dynsaved: %s with saved %s runs opaque this step: %s", self.name, self.named(values), found[0])
        return found

    def place(self, derived: tuple[Any, ...], ints: list[Any], floats: list[Any]) -> None:
        """Put a tuple's ``derived`` values (its ``verdict``'s) where the graph reads
        them (a refused tuple has none: the graph that runs then does not read them)."""
        if derived:
            for index, at in self.int_slots:
                ints[at] = derived[index]
            for index, at in self.float_slots:
                floats[at] = derived[index]

    def named(self, values: Sequence[Any]) -> dict[str, Any]:
        return dict(zip(self.keys, values))


def check(plan_: sentinel.Plan, inputs: Inputs, new: dict[str, int | float]) -> tuple[str, tuple[int | float, ...]]:
    """('', the derived values) when the backward, run with ``new``, does exactly
    what the template says with those values: the same ops, the same arguments (the
    new values in the slots), the same tensors by origin, the same tensors returned;
    else (what differs, ())."""
    recording = inputs.record(inputs.values(new))
    if recording.error is not None:
        return f"its backward raised ({exception_line(recording.error)})", ()
    flat = recording.flat
    if len(flat) == len(plan_.flat):
        expected = plan_.flat.copy()
        for at, key, as_float in plan_.slots_at:
            expected[at] = float(new[key]) if as_float else new[key]
        for at in plan_.derived_at:
            expected[at] = flat[at]
        if flat == expected and list(map(type, flat)) == plan_.types and _signs_agree(plan_, flat, expected):
            return "", tuple(flat[at] for at in plan_.derived_at)
    return _difference(plan_, recording, new)


def _signs_agree(plan_: sentinel.Plan, flat: list[Any], expected: list[Any]) -> bool:
    """The zeros among the floats compared equal have the same sign (``-0.0 == 0.0``):
    the template's float constants that are zero, and the double slots given a zero."""
    for at in plan_.zeros_at:
        if math.copysign(1.0, flat[at]) != math.copysign(1.0, expected[at]):
            return False
    for at, _, _ in plan_.slots_at:
        value = expected[at]
        if value == 0.0 and type(value) is float and math.copysign(1.0, flat[at]) != math.copysign(1.0, value):
            return False
    return True


def _difference(plan_: sentinel.Plan, recording: Recording, new: dict[str, int | float]) -> tuple[str, tuple[int | float, ...]]:
    """``check``'s slow path, leaf by leaf: what differs first (('', derived) if
    nothing does: a NaN compares unequal in the flat comparison, equal here)."""
    ops = recording.ops()
    if len(ops) != len(plan_.template):
        at = next((i for i, (a, b) in enumerate(zip(ops, plan_.template)) if a[0] != b[0]), None)
        first = "" if at is None else f" (op {at} is {ops[at][0]}, not {plan_.template[at][0]})"
        return f"it runs {len(ops)} ops instead of {len(plan_.template)}{first}", ()
    names = [op for op, _ in plan_.template]
    derived: list[int | float] = []
    for index, ((op, leaves), (t_op, t_leaves)) in enumerate(zip(ops, plan_.template)):
        if op != t_op or len(leaves) != len(t_leaves):
            return f"op {index} is {op} instead of {t_op}", ()
        for position, (leaf, expected) in enumerate(zip(leaves, t_leaves)):
            if leaf is expected:  # the common case, an argument no saved number reaches
                continue
            kind = type(expected)
            if kind is sentinel.Derived:
                if sentinel.number_kind(leaf, leaf) is not expected.kind:
                    return f"argument {position - 1} of {op} is {leaf!r}, not a {expected.kind}", ()
                derived.append(leaf)
                continue
            if position and sentinel.is_origin(expected):
                if leaf != expected:
                    return (
                        f"argument {position - 1} of {op} (op {index}) is {describe(leaf, names)}, "
                        f"not {describe(expected, names)}"
                    ), ()
                continue
            if kind is sentinel.Slot:
                value = new[expected.key]
                expected = float(value) if expected.as_float else value
            if not sentinel.same(leaf, expected):
                return f"argument {position - 1} of {op} is {leaf!r}, not {expected!r}", ()
    returned = recording.returned()
    for i, (got, expected) in enumerate(zip(returned, plan_.returned)):
        if got != expected:
            return f"it returns {describe(got, names)} as gradient {i}, not {describe(expected, names)}", ()
    return "", tuple(derived)  # in Derived.index order: the plan numbered them in this walk's order
