"""The tiered way: a node the capture holds two ways (``decision.Tiered``): opaque,
in the capture's opaque graph, and traced, in its specialised graph.

Which nodes: a C++ function's hashed-value combination first met after its first
capture (``tiers.COMBINATIONS``), a Python backward stock would recompile for or
break the graph at, a traced Python node with guarded values. At capture the node
is traced (as the traced ways trace it, or as stock does) and, at its validation,
also emitted as an opaque op (``validated``); ``graphs`` makes the capture's two
graphs of them. Each run, ``wrap`` chooses between them (``HELD``, ``MEASURED``,
``GUARDED``: ``tier_way``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..counting import count
from .._compat.capture import graphs_compiled
from .._compat.dynamo import without_dynamo
from .. import opaque, tiers
from ..decision import HASHED_ONLY, TRACED, Decision
from ..graphs import after_inputs
from ..records import CaptureRecord
from ..state import Capture, Deferred
from . import opaque_op

log = logging.getLogger("ca_dynsaved")


@dataclass
class Tier:
    """A tiered node in the capture's graph: traced, and also emitted as an opaque
    op; ``graphs`` makes the capture's graph of each way."""

    op: torch.fx.Node  # the opaque op
    keep: torch.fx.Node  # its one user until then, so CA's dead-code pass keeps it
    validated: list[torch.fx.Node | None]  # the traced outputs, as CA validated them
    traced: list[torch.fx.Node]  # what its trace recorded (in-place ops included)
    check: Any  # verify.Check, for the specialised graph only
    function: tuple[str, tuple[str, ...]]  # (name, saved keys): COMBINATIONS' count
    way: str  # how the capture chooses between its graphs (wrap)


def _keep(*args: Any) -> None:
    """A user of a tiered node's opaque op during capture (never run: removed before
    either graph is made)."""


# Side-effectful to FX's dead-code pass, so CA's own pass keeps the op it holds.
torch.fx.node.has_side_effect(_keep)


def also_opaque(
    cap: Capture, decision: Decision, grads: Sequence[Any], fn: Callable[..., Any] | None = None,
    call: Any = None, hook: int = -1, saved: Sequence[Any] = (),
) -> None:
    """A tiered node just traced: its opaque op waits for its validation."""
    opaque_ = dataclasses.replace(decision, plan=decision.plan.opaque)  # type: ignore[union-attr]
    cap.await_tier(Deferred(opaque_, list(grads), fn=fn, call=call, hook=hook, saved=tuple(saved), tier=decision.plan))  # type: ignore[arg-type]


def validated(cap: Capture, pending: Deferred, outputs: Sequence[Any], meta: Any) -> None:
    """At a tiered node's validation: its opaque op, held beside its trace; or,
    where the op cannot express the call, the trace alone (as for a combination
    of the function's first capture; a Python node: stock's)."""
    tier = pending.tier
    assert tier is not None
    check = cap.checks.pop() if tier.traced is not None and tier.traced.verify else None
    try:
        proxy_out = opaque_op.emit(cap, pending, meta)
    except opaque.Unexpressible as e:
        if tier.guarded is not None:  # its combinations past the cap run the graph uncompiled
            traced_ = dataclasses.replace(pending.decision, plan=tier.guarded)
            cap.guarded_untiered = True
        elif pending.call is None:
            traced_ = pending.decision.demoted(str(e))
        elif tier.traced is None:
            traced_ = pending.decision.demoted(f"{HASHED_ONLY} ({e})")
        else:
            traced_ = dataclasses.replace(
                pending.decision, handling=TRACED, reason=f"traced with sentinels: {tier.traced.plan.reason} ({e})",
                plan=tier.traced,
            )
        cap.record_node(traced_, pending.hook)
        if check is not None:
            cap.checks.append(check)
        return
    keep = cap.instance.fx_tracer.create_proxy("call_function", _keep, (proxy_out,), {})
    validated_ = [None if o is None else cap.to_proxy(o).node for o in outputs]
    if pending.call is not None:
        function, way = (pending.call.name, pending.call.keys), HELD
    else:  # Python: its opaque graph compiled when it runs
        function = (pending.decision.name, tuple(key for key, *_ in pending.decision.saved))
        way = MEASURED if tier.guarded is None else GUARDED
    cap.tiers.append(Tier(proxy_out.node, keep.node, validated_, cap.last_region, check, function, way))


def graphs(cap: Capture, id: str) -> torch.fx.GraphModule:
    """The capture's two graphs of its tiered nodes: returns the specialised one
    (them traced: a copy, their opaque ops dropped); the capture's own graph
    becomes the opaque one, in place (each op's outputs take the traced ones'
    users; the trace, whose in-place ops no dead-code pass removes, and CA's
    validation of it go, then CA's dead-code pass takes what only they read; a
    user that CA's reordering had pulled up to right after a traced output moves
    after the op)."""
    graph = cap.graph
    special = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    special.output(special.graph_copy(graph, env))
    for tier in cap.tiers:
        special.erase_node(env[tier.keep])
        special.erase_node(env[tier.op])
    specialised = torch.fx.GraphModule(cap.instance.fx_tracer.root, special, f"{id}Specialised")
    alive = set(graph.nodes)  # CA's dead-code pass may have erased some already

    def erase(node: torch.fx.Node) -> None:
        graph.erase_node(node)
        alive.discard(node)

    for tier in cap.tiers:
        erase(tier.keep)
        after = tier.op
        validation = set()
        for i, validated_ in enumerate(tier.validated):
            if validated_ not in alive:
                continue
            with graph.inserting_after(after):
                after = graph.call_function(operator.getitem, (tier.op, i))
            validated_.replace_all_uses_with(after)
            validation.add(validated_.args[0])
            erase(validated_)
        for node in [*validation, *reversed(tier.traced)]:
            if node in alive and not node.users:
                erase(node)
    after_inputs(graph)  # before the dead-code pass, whose lint checks the order
    cap.instance.dce()
    return specialised


@dataclass
class Hold:
    """Keeps a graph uncompiled while ``on`` (its runs eager)."""

    on: bool = True


#: How a tiered capture chooses between its graphs (``tiered``), by its nodes: a C++
#: node's later combination (held: ``first`` uncompiled until the switch), a Python
#: backward stock would recompile for or break at (measured), a traced Python node
#: with guarded values (guarded: ``graph`` from the first run).
HELD, MEASURED, GUARDED = "held", "measured", "guarded"


def tier_way(ways: Sequence[str]) -> str:
    """A capture's way from its tiered nodes': held if one is, guarded if all are,
    else measured (a guarded node's combinations past the cap then take ``first``
    from the switch on, as in the other ways)."""
    if HELD in ways:
        return HELD
    return GUARDED if ways and all(way == GUARDED for way in ways) else MEASURED


def wrap(
    first: Callable[..., Any],
    hold: Hold,
    specialised: Callable[[Callable[..., Any]], Callable[..., Any]],
    graph: torch.fx.GraphModule,
    compiler_fn: Callable[..., Any],
    functions: Sequence[tuple[str, tuple[str, ...]]],
    record: CaptureRecord,
    way: str = HELD,
) -> Callable[..., Any]:
    """The runtime wrapper of a capture with tiered nodes (``decision.Tiered``):
    ``first`` (its graph with them opaque), run eagerly while ``hold`` is on, until
    the capture's run ``tiers.SPECIALISE_AFTER_RUNS``; then, if ``tiers.COMBINATIONS`` lets
    ``functions`` have one more, ``graph`` (them traced) compiled by ``compiler_fn``
    and run by the wrapper ``specialised`` makes, which hands a step whose values
    verify refuses back to ``first``; if not, ``first`` compiled (code shared with
    the functions' other combinations at their cap). So a C++ function's later
    combination that repeats costs stock's one compile, one that does not come back
    16 times none; eager runs cost little against a compile (docs/cpp.md, "Hashed
    values"). ``GUARDED``: ``graph`` compiled from the first run, ``first`` (compiled
    when it first runs) for the combinations ``Combinations`` sends away.
    ``MEASURED`` (Python nodes tiered for a graph break or a number they
    specialise on: ``first`` compiled from the start, ``hold`` off; ``graph`` as
    stock made it, guarded by Dynamo as stock): ``graph`` gives way to ``first`` for
    good where it compiles in more than ``tiers.RECOMPILING_RUNS`` runs after its
    first (it churns, as under stock), or where its median of ``tiers.TIMED_RUNS``
    runs is slower than ``first``'s median over as many runs before the switch; and
    it is tried only once the run's sizes have stayed the same for that many runs
    (sizes that keep changing recompile stock's graph-broken pieces at every new
    one). A backward with ``create_graph=True`` always takes ``first``, whose eager
    run records the backward's history."""
    runs = 0
    chosen: list[Callable[..., Any]] = []
    asked = False  # COMBINATIONS once: a function at its cap stays opaque here
    # measured: runs of ``graph``'s code that compiled (its first not counted); the
    # timed runs of ``first`` (its latest with steady sizes) and of ``graph``; the
    # runs in a row whose sizes were the run before's
    recompiling = -1
    first_times: collections.deque[float] = collections.deque(maxlen=tiers.TIMED_RUNS)
    own_times: list[float] = []
    same_sizes, last_sizes = 0, None

    def give_way(why: str) -> None:
        chosen.clear()
        hold.on = False
        record.despecialised = runs
        log.info("capture !%d: run %d: back to its opaque graph: %s", record.ca_id, runs, why)

    def run_measured(inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        """``graph``'s run, watched for recompiles; timed until ``TIMED_RUNS`` of
        its runs compiled nothing (a GPU run synchronises only then)."""
        nonlocal recompiling
        before = graphs_compiled()
        if len(own_times) < tiers.TIMED_RUNS:
            out, seconds = _timed(chosen[0], inputs, sizes, scalars, hooks, packed_inputs)
        else:
            out, seconds = chosen[0](inputs, sizes, scalars, hooks, packed_inputs), None
        if graphs_compiled() != before:
            recompiling += 1
            if recompiling > tiers.RECOMPILING_RUNS:  # churning, as under stock
                give_way(f"its own graph compiled in {recompiling} runs after its first")
        elif seconds is not None:
            own_times.append(seconds)
            if len(own_times) == tiers.TIMED_RUNS:
                own, opaque_ = statistics.median(own_times), statistics.median(first_times)
                record.tier_times_us = (opaque_ * 1e6, own * 1e6)
                if own > opaque_:
                    give_way(f"its own graph's runs take {own * 1e6:.0f} us, the opaque graph's {opaque_ * 1e6:.0f}")
        return out

    measured = way == MEASURED
    run_chosen = run_measured if measured else (lambda *args: chosen[0](*args))

    def choose(compiled_fn: Callable[..., Any]) -> None:
        own = compiler_fn(graph)
        run = specialised(lambda *args: first(compiled_fn, *args))
        chosen.append(lambda *args: run(own, *args))

    @without_dynamo
    def wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        nonlocal runs, asked, same_sizes, last_sizes
        grad = torch.is_grad_enabled()
        runs += 1
        if chosen and (not grad or way == GUARDED):  # GUARDED: its graph is stock's, with create_graph too
            return run_chosen(inputs, sizes, scalars, hooks, packed_inputs)
        if way == GUARDED and not asked:
            asked = True
            choose(compiled_fn)
            return run_chosen(inputs, sizes, scalars, hooks, packed_inputs)
        steady = True
        if measured and not asked:
            same_sizes = same_sizes + 1 if sizes == last_sizes else 0
            last_sizes = list(sizes)
            steady = same_sizes >= min(tiers.TIMED_RUNS, tiers.SPECIALISE_AFTER_RUNS - 1)
        if way != GUARDED and not asked and not grad and runs >= tiers.SPECIALISE_AFTER_RUNS and steady:
            asked = True
            if not tiers.COMBINATIONS.promote(functions):
                hold.on = False  # at the cap: opaque for good, compiled
                return first(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs)
            choose(compiled_fn)
            record.specialised = runs
            count("specialised_captures")
            log.info("capture !%d: run %d: its own graph, tiered nodes traced (%s)",
                     record.ca_id, runs, ", ".join(name for name, _ in functions))
            return run_chosen(inputs, sizes, scalars, hooks, packed_inputs)
        # measured: the opaque graph's runs that may precede the switch (sizes as the
        # run before's, the first run (eager) not) are timed
        window = runs > tiers.SPECIALISE_AFTER_RUNS - 1 - tiers.TIMED_RUNS
        if measured and not asked and not grad and same_sizes and window:
            out, seconds = _timed(first, compiled_fn, inputs, sizes, scalars, hooks, packed_inputs)
            first_times.append(seconds)
            return out
        return first(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs)

    return wrapper


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and its wall time in seconds, the GPU's queued work included
    (a tiered capture's choice between its two graphs: ``tiered``)."""
    sync = torch.cuda.is_initialized()
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    if sync:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start
