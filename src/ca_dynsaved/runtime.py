"""The runtime wrapper of a plugin CA graph: what each run needs, and which code runs.

``compiler.end_capture`` fixes what a capture's runs need in one ``RunSpec``;
``make_runtime_wrapper`` wraps CA's runtime wrapper for one of its graphs, and
each way a run goes is its own small function:

* Scalars: the lifted numbers' types are checked, then split (and, for traced
  nodes, packed) by the capture's ``scalars.Packer``, in ``scalars.Layout``'s order.
* Bound data: CA's ``hooks`` (where the Python ctx objects are) and the capture's
  ``NodeCapture``s (hashed values, C++ functionals), for the ops to read
  (``binding.bound_run``).
* Which code (``_opaque_fn``): whether a backward leaves a gradient undefined cannot
  be seen at capture, so the first run of a capture is the captured graph run
  eagerly; it records those gradients, which then become part of the graph
  (``reuse.py``), and later runs use the compiled function of that graph, or of an
  equal one compiled for another capture. A backward with ``create_graph=True``
  (grad mode on inside CA) must record the backward's own autograd history, which
  an opaque op without a derivative cuts; CA's cache does not tell such calls
  apart, so those calls run the captured graph eagerly with each opaque op
  replaced by a direct call.
* Verify (``ways/verify.py``): a step whose values a check refuses runs a copy of
  the graph with the refused nodes called directly (``_fallback_fn``).
* Final callbacks: those queued while the graph runs by code outside Dynamo's graph
  run after it, as after an eager backward (``running_final_callbacks``; stock CA
  drops them, FSDP2's post-backward among them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .counting import count
from ._compat.dynamic_state import mark_dynamic_scalars
from ._compat.dynamo import without_dynamo
from ._compat.engine import collecting_final_callbacks
from . import binding, checkpoint, fuse, opaque, reuse
from .graphs import Differentiable
from .records import CaptureRecord
from .scalars import Packer
from .ways import checkpointed
from .ways.python_traced import Combinations
from .ways.sentinel_traced import fallback_graph
from .ways.tiered import Hold
from .ways.verify import Check

log = logging.getLogger("ca_dynsaved")


@dataclass(frozen=True)
class RunSpec:
    """What every run of a capture needs, fixed at its end: CA's ``runtime_wrapper``
    (sizes made once, final callbacks run), the capture's ``record``, the backend
    (``compiler_fn``), its opaque ops' ``nodes``; ``packer`` when C++ opaque ops or
    traced nodes read the lifted scalars; ``dynamic_sources``: the scalars Dynamo
    must treat as dynamic, re-marked when the graph's code is regenerated;
    ``derived``: how many ints and doubles sentinel-traced nodes compute from their
    numbers (``sentinel.Derived``), which their checks give per step; ``unpacks``:
    the graph's checkpoint unpacks, whose ``like`` tensors each run appends to the
    scalars (a run that cannot describe them takes the stock twin), learned on the
    first run, which is eager; ``fallback_base``: what a refused step's graph is
    copied from (``sentinel_traced.fallback_graph``)."""

    runtime_wrapper: Callable[..., Any]
    record: CaptureRecord
    compiler_fn: Callable[..., Any]
    nodes: Sequence[binding.NodeCapture]
    packer: Packer | None = None
    dynamic_sources: tuple[str, ...] = ()
    derived: tuple[int, int] = (0, 0)
    unpacks: checkpoint.Unpacks | None = None
    fallback_base: torch.fx.GraphModule | None = None


def running_final_callbacks(runtime_wrapper: Callable[..., Any], record: CaptureRecord) -> Callable[..., Any]:
    """CA's ``runtime_wrapper``, then every callback queued with
    ``Variable._execution_engine.queue_callback`` while it ran, in order, including
    callbacks queued by callbacks: what the engine's post-processing does at the end
    of an eager backward, and what stock CA skips for callbacks queued by code that
    runs outside Dynamo's graph (a ``torch.compiler.disable``d hook such as FSDP2's
    pre-backward, whose post-backward callback reduce-scatters the gradients and
    reshards the parameters). A callback queued by code Dynamo traces is still
    Dynamo's (run by the graph's ``exec_final_callbacks``). A backward that raises
    runs none, as in eager. ``record.final_callbacks`` counts those run."""

    @without_dynamo
    def wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        with collecting_final_callbacks() as queued:
            out = runtime_wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs)
            i = 0
            while i < len(queued):  # a callback may queue more
                queued[i]()
                i += 1
        record.final_callbacks += i
        return out

    return wrapper


def make_runtime_wrapper(
    spec: RunSpec,
    graph_module: torch.fx.GraphModule,
    checks: Sequence[Check] = (),
    refused: Callable[..., Any] | None = None,
    hold: Hold | None = None,
    combinations: Combinations | None = None,
) -> Callable[..., Any]:
    """Wrap CA's runtime wrapper (``spec``'s) for ``graph_module``, one of the
    capture's graphs. ``checks``: the verify checks of its sentinel-traced nodes;
    ``refused``: what runs a step a check refuses (called with the run's arguments
    after ``compiled_fn``), else a copy of the graph with the refused nodes called
    directly (``_fallback_fn``); ``hold``: while on, the graph runs eagerly,
    uncompiled (``ways.tiered``); ``combinations``: a run whose guarded ctx values
    it sends away takes ``refused`` where it is ``shared`` (this graph a tiered
    capture's traced one), else this graph eagerly. A lifted value whose type is
    not its capture's raises before anything runs (``SavedTypeChangedError``)."""
    runtime_wrapper, record, nodes, packer, unpacks = spec.runtime_wrapper, spec.record, spec.nodes, spec.packer, spec.unpacks
    compiled: list[Callable[..., Any]] = []  # set once every node in the graph has run
    # a tiered capture's traced graph lacks its tiered nodes' opaque ops
    learning = [nodes[slot] for slot in opaque.slots_in(graph_module.graph)]
    # Only a Python opaque node and a checkpoint unpack run under the caller's
    # dispatch keys: read them then.
    python = any(node.fn is None for node in nodes) or unpacks is not None
    fallbacks: dict[tuple[int, ...], torch.fx.GraphModule] = {}  # by refused checks

    def _fallback_fn(which: tuple[int, ...]) -> Callable[..., Any]:
        """A step some checks refused: the graph with those nodes called directly."""
        gm = fallbacks.get(which)
        if gm is None:
            assert spec.fallback_base is not None
            gm = fallbacks[which] = fallback_graph(spec.fallback_base, [checks[i].fallback for i in which])
        return Differentiable(gm).run_to_list if torch.is_grad_enabled() else gm

    def _traced_only_fn(compiled_fn: Callable[..., Any], eager: bool) -> Callable[..., Any]:
        """Nothing opaque: the graph as captured (traced C++ nodes may read the packed
        floats); with sentinel-traced nodes its first run is eager, as a graph with
        opaque nodes runs it, so a capture used once (a batch whose captures change)
        compiles nothing."""
        if eager:
            return graph_module
        if compiled or not checks:
            return compiled_fn
        compiled.append(compiled_fn)
        count("first_eager_runs")
        return graph_module

    def _opaque_fn(compiled_fn: Callable[..., Any], eager: bool, learned: bool) -> Callable[..., Any]:
        """Opaque ops or unpacks: eager until each op has run once (and the unpacks'
        strides are learned), then the compiled code of the graph with what the run
        learned (``reuse``); eager again with ``create_graph`` or while held."""
        if not compiled and learned and all(node.defined is not None for node in learning) and not (hold and hold.on):
            reuse.name_learned_outputs(graph_module, nodes)
            fuse.chains(graph_module)  # new code: mark it again
            mark_dynamic_scalars(graph_module.forward.__code__, spec.dynamic_sources)
            fn, record.compiled = reuse.compiled_for(graph_module, compiled_fn, spec.compiler_fn)
            compiled.append(fn)
            log.info("capture !%d: first run done; %s code", record.ca_id, record.compiled)
        if torch.is_grad_enabled() and learning:  # its opaque ops called directly
            count("create_graph_eager_runs")
            return Differentiable(graph_module).run_to_list
        if compiled and not eager:
            return compiled[0]
        if not eager:
            count("held_eager_runs" if hold and hold.on else "first_eager_runs")
        return graph_module

    @without_dynamo
    def wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        start = time.perf_counter() if binding.TIMING else 0.0
        if packer is not None:
            packer.check_types(scalars)
        verdicts = [check.verdict(scalars) for check in checks]
        reasons = _refusals(checks, verdicts, scalars, record) if checks else {}
        if reasons and refused is not None:
            return refused(inputs, sizes, scalars, hooks, packed_inputs)
        eager = combinations is not None and combinations.away(hooks)
        if eager and combinations.shared:  # type: ignore[union-attr]
            # this graph is a tiered capture's traced one: its opaque graph takes it
            assert refused is not None
            count("guarded_opaque_runs")
            return refused(inputs, sizes, scalars, hooks, packed_inputs)
        record.observe(scalars, hooks)
        if eager:
            count("guarded_eager_runs")
        ints: Sequence[int] = ()
        floats: Sequence[float] = ()
        if packer is not None:
            ints, floats, scalars = _packed(packer, checks, verdicts, spec.derived, scalars)
        if unpacks is not None:
            likes = unpacks.likes(hooks, packed_inputs)
            if isinstance(likes, str):
                if not reasons:
                    fn = checkpointed.stock_twin(unpacks, likes, record, spec.compiler_fn)
                    with binding.bound_run(hooks, nodes, ints, floats, python):
                        return runtime_wrapper(fn, inputs, sizes, scalars, hooks, packed_inputs)
                likes = [None] * len(unpacks.slots)  # the eager fallback below takes any hook
            scalars = [*scalars, *likes]
        if reasons:
            with binding.bound_run(hooks, nodes, ints, floats, python, packed_inputs, unpacks):
                return runtime_wrapper(_fallback_fn(tuple(reasons)), inputs, sizes, scalars, hooks, packed_inputs)
        if not nodes and unpacks is None:
            return runtime_wrapper(_traced_only_fn(compiled_fn, eager), inputs, sizes, scalars, hooks, packed_inputs)
        learned = unpacks is None or unpacks.learned
        fn = _opaque_fn(compiled_fn, eager, learned)
        if binding.TIMING:
            binding.TIMING[-1]["wrapper"] += time.perf_counter() - start
        with binding.bound_run(hooks, nodes, ints, floats, python, packed_inputs, unpacks):
            out = runtime_wrapper(fn, inputs, sizes, scalars, hooks, packed_inputs)
        if not learned:
            unpacks.done_first_run()  # type: ignore[union-attr]
        return out

    return wrapper


def _refusals(
    checks: Sequence[Check], verdicts: Sequence[tuple[str, Any]], scalars: Sequence[Any], record: CaptureRecord
) -> dict[int, str]:
    """The checks whose ``verdicts`` refuse this step's values, each with why (to
    the report)."""
    reasons = {i: reason for i, (reason, _) in enumerate(verdicts) if reason}
    if reasons:
        count("verify_fallbacks")
        for i, reason in reasons.items():
            record.refuse(checks[i].name, checks[i].named([scalars[j] for j in checks[i].indices]), reason)
    return reasons


def _packed(
    packer: Packer, checks: Sequence[Check], verdicts: Sequence[tuple[str, Any]], derived: tuple[int, int],
    scalars: list[Any],
) -> tuple[Sequence[int], Sequence[float], list[Any]]:
    """This step's ints and doubles, and the graph's scalars (``scalars.Layout``),
    the values the checks' nodes compute from their numbers (their ``verdicts``)
    placed."""
    derived_ints, derived_floats = [0] * derived[0], [0.0] * derived[1]
    for check, (_, values) in zip(checks, verdicts):
        check.place(values, derived_ints, derived_floats)
    return packer(scalars, derived_ints, derived_floats)
