"""What the runtime wrapper binds for one run of a CA graph, for its opaque ops to read.

A custom op takes no Python objects, so what an opaque op needs besides its graph
arguments is bound for the duration of the run (``bound_run``): CA's ``hooks`` (the
Python ctx objects), the capture's ``NodeCapture``s (the C++ functionals, the values
CA hashed), the lifted ints and doubles of this run, and the caller's autocast state
and (where a Python node runs opaque) dispatch keys, under which eager's engine
would have called the backward. ``timing`` measures what the ops cost the plugin
(``benchmarks/test_opaque_overhead.py``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from ._compat.engine import AutocastState, autocast_state, dispatch_keys

_local = threading.local()


@dataclass
class NodeCapture:
    """What one opaque node of one capture holds besides its structure (``opaque.NodeSpec``):
    bound for a run of the capture's graph, where its op reads it."""

    fn: Callable[..., Any] | None  # C++: CppNode_apply_functional_ivalue<T>; Python: None
    captured: tuple[Any, ...]  # the values of the CAPTURED leaves
    defined: tuple[bool, ...] | None = None  # which outputs its backward returned, once run
    # per output, what validate_outputs kept as it was on the first run, as
    # (type, dtype, device, layout), else None (see outputs.finish)
    kept: tuple[tuple[Any, ...] | None, ...] | None = None
    # per output, the incoming grad it returned as is on that run (its index), or -1
    passthrough: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Run:
    """What one run of a CA graph binds for its opaque ops (see ``bound_run``)."""

    hooks: Sequence[Any]  # CA's hooks of this run: the Python ctx objects
    nodes: Sequence[NodeCapture]  # the capture's nodes, by slot
    autocast: AutocastState | None  # the caller's autocast state
    # the caller's local dispatch key sets (dispatch_keys), where a Python node runs opaque
    keys: tuple[Any, Any] | None
    # this run's lifted ints and doubles (scalars.Packer), which the C++ ops'
    # INT / FLOAT leaves index
    ints: Sequence[int] = ()
    floats: Sequence[float] = ()
    # CA's packed_data of this run (checkpoint's holders) and the capture's
    # checkpoint.Unpacks, which the unpack ops read
    packed: Sequence[Any] = ()
    unpacks: Any = None


class bound_run:
    """Make this run's CA ``hooks`` (holding the Python ctx objects), the capture's
    nodes, its lifted numbers and the caller's autocast state visible to the ops: a
    custom op takes no Python objects, and runs where autocast may have been switched
    off (below). ``keys``: read the caller's dispatch keys too (only a Python opaque
    node runs under them). A class, not a generator: it is entered on every backward."""

    __slots__ = ("_run", "_prior")

    def __init__(
        self,
        hooks: Sequence[Any],
        nodes: Sequence[NodeCapture],
        ints: Sequence[int] = (),
        floats: Sequence[float] = (),
        keys: bool = False,
        packed: Sequence[Any] = (),
        unpacks: Any = None,
    ) -> None:
        self._run = Run(hooks, nodes, autocast_state(), dispatch_keys() if keys else None, ints, floats, packed, unpacks)

    def __enter__(self) -> None:
        self._prior = getattr(_local, "run", None)
        _local.run = self._run

    def __exit__(self, *exc: Any) -> None:
        _local.run = self._prior


def bound(name: str) -> Run:
    """The run bound for node ``name``'s op; an error outside a runtime wrapper."""
    run = getattr(_local, "run", None)
    if run is None:
        raise RuntimeError(f"ca_dynsaved: {name} run outside the runtime wrapper of its CA graph")
    return run


@contextlib.contextmanager
def _caller_autocast(state: AutocastState) -> Iterator[None]:
    """Run a backward under the autocast state of the code that called backward.

    Eager's engine runs a custom backward under its caller's autocast state.
    AOTAutograd runs a compiled graph under ``torch._C._DisableAutocast`` (autocast
    is already baked into the ops it traced), but an opaque op's backward was never
    traced: without this its matmuls would run in float32 where eager's run in
    bfloat16."""
    devices, cache_enabled = state
    with contextlib.ExitStack() as stack:
        for device, dtype in devices:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache_enabled))
        yield


# --- what the ops cost the plugin (benchmarks/test_opaque_overhead.py) -------------------
TIMING: list[dict[str, float]] = []  # non-empty while timing(): the totals being kept


@contextlib.contextmanager
def timing() -> Iterator[dict[str, float]]:
    """Within the block, add up the seconds the ops spend (``ops``), of which in
    the user's backward (``backward``), count the calls (``calls``), and add up the
    runtime wrapper's own seconds before a compiled run (``wrapper``: report, scalar
    packing): the plugin's own share of an opaque node is ``ops - backward``, the
    op's dispatch, and ``wrapper`` over the graph's nodes."""
    totals = {"ops": 0.0, "backward": 0.0, "calls": 0, "wrapper": 0.0}
    TIMING.append(totals)
    try:
        yield totals
    finally:
        TIMING.remove(totals)


def timed(start: float, backward: float) -> None:
    """Add one op call (started at ``start``, ``backward`` seconds of it in the
    user's backward) to the innermost ``timing`` block."""
    totals = TIMING[-1]
    totals["ops"] += time.perf_counter() - start
    totals["backward"] += backward
    totals["calls"] += 1


def call_user_backward(run: Run, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` (the user's backward) under the caller's autocast state, and its
    seconds while timing (else 0)."""
    called = time.perf_counter() if TIMING else 0.0
    if run.autocast is None:  # no contextmanager on the common path
        outs = fn(*args)
    else:
        with _caller_autocast(run.autocast):
            outs = fn(*args)
    return outs, (time.perf_counter() - called if TIMING else 0.0)

