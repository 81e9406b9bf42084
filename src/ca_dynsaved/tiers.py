"""When a capture's later combinations get graphs of their own: the counts a tiered
node (``decision.Tiered``) waits for, and which combinations of each function have
had one (``COMBINATIONS``). ``decision`` reads them to decide a node; the tiered way
(``ways/tiered.py``) reads them each run to choose its graph. Module attributes, so
a test may set them."""

from __future__ import annotations

from typing import Sequence

from .caches import on_reset

#: A later combination's capture runs opaque and uncompiled until its run number
#: ``SPECIALISE_AFTER_RUNS``, which compiles its own graph, the node traced with these
#: hashed values as constants (as stock CA compiles every combination at its first
#: run): a value new every step never gets there and costs no compile; a combination
#: that keeps coming back (a cycle, a schedule) has shown it repeats. At most
#: ``MAX_SPECIALISED`` combinations a function get one; later ones then run opaque,
#: sharing one compiled graph (docs/cpp.md, "Hashed values"; a compile costs as much
#: as hundreds of uncompiled runs: docs/benchmarks.md, "Component costs").
SPECIALISE_AFTER_RUNS = 16
MAX_SPECIALISED = 8
#: A Python backward Dynamo breaks the graph at, or one that specialises on a ctx
#: number, runs opaque, compiled, until its capture's run ``SPECIALISE_AFTER_RUNS``;
#: then as stock runs it (its graph-broken pieces, fused as stock fuses them, with
#: stock's guards). Their first run compiles them and a value's first change
#: recompiles them once (Dynamo makes it dynamic); a graph that compiles in more than
#: ``RECOMPILING_RUNS`` runs after its first (a value it specialises on, sizes that
#: keep changing) churns as under stock: the capture goes back to its opaque graph
#: for good (``ways.tiered``) ...
RECOMPILING_RUNS = 2
#: ... and where stock's graph is no faster: its median over ``TIMED_RUNS`` runs that
#: compile nothing against the opaque graph's over as many runs before the switch (an
#: opaque op beside matmuls can beat graph-broken pieces; measured in benchmarks/).
TIMED_RUNS = 8


class _Combinations:
    """Which combinations of a C++ function's hashed values (bool, str, lists) get
    graphs specialised on them. CA captures a graph per combination; the ones the
    function's *first* capture holds (a per-layer mode, a flag that never changes)
    are traced, fused, as stock CA would; a combination first met in a later
    capture (values that cycle or keep changing) runs opaque and uncompiled until it
    has repeated (``Tiered``), then gets its own graph, up to ``MAX_SPECIALISED`` a
    function (``promoted`` counts them; docs/cpp.md, "Hashed values"). Per function
    name and saved keys; ``ca_dynsaved.reset()`` clears it."""

    def __init__(self) -> None:
        self.first: dict[tuple[str, tuple[str, ...]], tuple[int, set[str]]] = {}
        self.promoted: dict[tuple[str, tuple[str, ...]], int] = {}  # later combinations given a graph

    def specialised(self, name: str, keys: tuple[str, ...], combination: str, capture: int) -> bool:
        seen = self.first.setdefault((name, keys), (capture, set()))
        if seen[0] == capture:
            seen[1].add(combination)
        return combination in seen[1]

    def may_specialise(self, name: str, keys: tuple[str, ...]) -> bool:
        return self.promoted.get((name, keys), 0) < MAX_SPECIALISED

    def promote(self, functions: Sequence[tuple[str, tuple[str, ...]]]) -> bool:
        """Count one more specialised combination for each function, if all are under
        the cap (one capture's tiered nodes are specialised together)."""
        if not all(self.may_specialise(*f) for f in functions):
            return False
        for f in functions:
            self.promoted[f] = self.promoted.get(f, 0) + 1
        return True

    def clear(self) -> None:
        self.first.clear()
        self.promoted.clear()


COMBINATIONS = _Combinations()
on_reset(COMBINATIONS.clear)
