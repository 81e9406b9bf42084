"""The CA graph's ``scalars`` list: its layout, fixed at capture, and its packing each run.

CA passes the lifted ``saved_data`` ints and doubles as a list of Python numbers (the
``scalars`` placeholder). Dynamo guards on a Python number it reads, so the graph
never hands them to an op: the opaque ops read them from the run (``Packer`` splits
them once per run), and where a traced node reads them the runtime wrapper appends
two tensors (all lifted ints as int64, all lifted doubles as float64), whose
metadata, fixed for a CA graph, is all Dynamo guards. ``Layout`` is the one place
that knows where each entry is.
"""

from __future__ import annotations

import array
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .opaque import FLOAT, INT


@dataclass
class Layout:
    """The order of a CA graph's ``scalars``: the lifted scalars (CA's, ``kinds``), then,
    where a traced node reads them (``packed``), the packed int64 and float64
    tensors and the ``derived_ints`` that sentinel-traced nodes compute from their
    numbers (``sentinel.Derived``), then one ``like`` per checkpoint unpack. The
    ``derived_floats`` they compute sit at the end of the float64 tensor, after the
    lifted doubles. Grows while the capture traces; the runtime reads it as it ends."""

    kinds: tuple[str, ...]
    packed: bool = False
    derived_ints: int = 0
    derived_floats: int = 0

    @property
    def lifted(self) -> int:
        return len(self.kinds)

    def packed_tensor(self, kind: str) -> int:
        """The index of the packed tensor of ``kind``'s lifted scalars."""
        return self.lifted + (0 if kind is INT else 1)

    def derived_int(self, at: int) -> int:
        """The index of the graph's derived int ``at``."""
        return self.lifted + 2 + at

    def derived_float(self, at: int) -> int:
        """The index in the float64 tensor of the graph's derived double ``at``."""
        return self.kinds.count(FLOAT) + at

    def unpack_like(self, slot: int) -> int:
        """The index of checkpoint unpack ``slot``'s ``like``, after everything else."""
        return self.lifted + (2 + self.derived_ints if self.packed else 0) + slot


class Packer:
    """A graph's lifted scalars (CA's list, by capture-time ``kinds``) split into its
    ints and its doubles, for the opaque C++ ops (``binding.bound_run``), and, with
    ``tensors`` (a traced node reads them), packed into one int64 and one float64
    tensor appended to the graph's scalars. Built once per graph: each run picks by
    precomputed indices and checks the types, both in C (itemgetter, issuperset).
    ``owners``: per lifted scalar, whose saved key it is ("MyFn's 'k'"), for the
    error a changed type gives."""

    def __init__(self, kinds: Sequence[str], tensors: bool, owners: dict[int, str] | None = None) -> None:
        self.kinds = tuple(kinds)
        self.tensors = tensors
        self.owners = owners or {}
        self._ints = picker([i for i, kind in enumerate(self.kinds) if kind is INT])
        self._floats = picker([i for i, kind in enumerate(self.kinds) if kind is not INT])

    def check_types(self, values: Sequence[Any]) -> None:
        """Raise ``SavedTypeChangedError`` for the first lifted value whose type is not its
        type at capture (CA's cache key does not hold it; an int64 slot would
        truncate a float, and a bool is no int here): before the graph runs."""
        if len(values) != len(self.kinds):
            raise RuntimeError(
                f"ca_dynsaved: CA graph captured with {len(self.kinds)} lifted scalars, called with {len(values)}"
            )
        if _ONLY_INT.issuperset(map(type, self._ints(values))) and _ONLY_FLOAT.issuperset(map(type, self._floats(values))):
            return
        index, value = next((i, v) for i, v in enumerate(values) if type(v) is not (int if self.kinds[i] is INT else float))
        raise SavedTypeChangedError(self.owners.get(index, f"lifted scalar {index}"), self.kinds[index], value)

    def __call__(
        self, values: list[Any], derived_ints: Sequence[int] = (), derived_floats: Sequence[float] = ()
    ) -> tuple[Sequence[int], Sequence[float], list[Any]]:
        """(the ints, the doubles, the graph's scalars: ``values``, then the packed
        tensors if any, the doubles computed from the saved numbers at the end of the
        float64 one, then the ints computed from them: ``sentinel.Derived``), for
        values ``check_types`` passed."""
        ints, floats = self._ints(values), self._floats(values)
        if not self.tensors:
            return ints, floats, values
        packed = (*floats, *derived_floats) if derived_floats else floats
        # frombuffer over an array (the tensor keeps it alive) is cheaper than
        # torch.tensor(list), which converts each element; it refuses an empty buffer.
        return ints, floats, [
            *values,
            torch.frombuffer(array.array("q", ints), dtype=torch.int64) if ints else _EMPTY_INTS,
            torch.frombuffer(array.array("d", packed), dtype=torch.float64) if packed else _EMPTY_FLOATS,
            *derived_ints,
        ]


class SavedTypeChangedError(TypeError):
    """A C++ function's saved number has another type than at capture.

    Raised before the backward's graph runs (nothing has run) when a ``saved_data``
    key the plugin lifted was an int at capture and is a double now, or the other way
    round: compiled autograd's cache key does not hold the type, so CA hands the step
    to the graph captured for the other type, which cannot take it. The message names
    the node, the key, both types and the fix: save the key as one type in the
    forward (``static_cast<double>(...)`` every time).

    Args:
        owner: the node and key, as "Fn's saved 'k'".
        kind: its kind at capture ("int" or "float").
        value: its value now.

    Example::

        try:
            with ca_dynsaved.enable():
                loss.backward()
        except ca_dynsaved.SavedTypeChangedError as e:
            print(e.owner, e.kind, e.value)
    """

    def __init__(self, owner: str, kind: str, value: Any) -> None:
        was = "an int" if kind is INT else "a double"
        now = {int: "an int", float: "a double", bool: "a bool"}.get(type(value), f"a {type(value).__name__}")
        super().__init__(
            f"ca_dynsaved: {owner} was {was} at capture and is {now} now ({value!r}): compiled autograd "
            f"keeps one graph for both types, so its graph cannot take it. Save it as one type in the "
            f"forward ({'static_cast<double>(...) every time' if kind is INT else 'the same type every time'})."
        )
        self.owner, self.kind, self.value = owner, kind, value


def picker(indices: Sequence[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """What picks the items at ``indices`` of a sequence, as a tuple (itemgetter: in C)."""
    if not indices:
        return lambda values: ()
    if len(indices) == 1:
        (index,) = indices
        return lambda values: (values[index],)
    return operator.itemgetter(*indices)


_ONLY_INT, _ONLY_FLOAT = frozenset({int}), frozenset({float})
_EMPTY_INTS = torch.empty(0, dtype=torch.int64)
_EMPTY_FLOATS = torch.empty(0, dtype=torch.float64)
