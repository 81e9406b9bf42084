"""Runs of opaque ops that only feed each other become one op.

Each opaque op is a dispatcher call (its arguments converted to and from IValues)
and, under inductor, an extern kernel with its own output checks: a cost per node
that no work in the node pays back (its measure: docs/benchmarks.md, "Component costs"). A
node whose incoming gradients all come from the previous opaque node, which feeds
nothing else, gains nothing from being a separate call: ``chains`` replaces such a
run with one ``ca_dynsaved::chain`` op, whose impl calls the same runners one after
the other (``run_chain``) and whose fake impl is the last node's.

It rewrites the graph the compiled code is made from, after the first run has
learned each node's undefined and passed-through outputs (``reuse.
name_learned_outputs``): a node that passes a gradient through ends a chain (the
next node then reads that gradient from before it), and what a chain's steps do
with undefined gradients and saved values is what the ops did.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .counting import count
from ._compat.dynamo import CUDAGRAPH_UNSAFE, without_dynamo
from . import opaque
from .caches import on_reset

_OPAQUE = (opaque.CPP_OP, opaque.PY_OP)


def chains(gm: torch.fx.GraphModule) -> int:
    """Fuse every run of two or more opaque ops in ``gm`` (in place; recompiles it);
    returns how many ops were folded into a previous one. The runs are found first,
    so each becomes one chain with one registered plan."""
    runs: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # a run's last op -> the run
    for node in list(gm.graph.nodes):
        if node.target in _OPAQUE:
            producer = _sole_producer(node)
            if producer is not None:
                runs[node] = [*runs.pop(producer, [producer]), node]
    fused = 0
    for run in runs.values():
        _fold(gm.graph, run)
        fused += len(run) - 1
    if fused:
        gm.recompile()
        count("fused_opaque_nodes", fused)
    return fused


def _sole_producer(node: torch.fx.Node) -> torch.fx.Node | None:
    """The opaque op (or chain) all of ``node``'s incoming grads come from, if that op
    feeds nothing but ``node``'s grads, each output at most once."""
    grads = node.args[0]
    if not isinstance(grads, (list, tuple)) or not grads:
        return None
    producer = None
    for g in grads:
        if not (isinstance(g, torch.fx.Node) and g.target is operator.getitem and len(g.users) == 1):
            return None
        source = g.args[0]
        if producer is None:
            producer = source
        if source is not producer or not isinstance(source, torch.fx.Node):
            return None
    if producer.target not in (*_OPAQUE, CHAIN_OP):
        return None
    if set(producer.users) != set(grads) or len(set(grads)) != len(grads):
        return None
    # node's other arguments must not read the producer's outputs either
    rest: list[torch.fx.Node] = []
    torch.fx.node.map_arg(node.args[1:], rest.append)
    return None if any(r in grads for r in rest) else producer


def _parts(node: torch.fx.Node) -> tuple[list[Step], list[Any], list[Any], list[Any]]:
    """(steps, grads, tensors, symints) of an opaque op or chain node."""
    if node.target is CHAIN_OP:
        grads, tensors, symints, plan = node.args
        return list(chain_steps(plan)), list(grads), list(tensors), list(symints)
    if node.target is opaque.CPP_OP:
        grads, tensors, symints, key, slot = node.args
        hook = None
    else:
        grads, tensors, symints, key, slot, hook = node.args
    step = Step(key, slot, hook, (0, len(tensors)), (0, len(symints)), None)
    return [step], list(grads), list(tensors), list(symints)


def _fold(graph: torch.fx.Graph, run: list[torch.fx.Node]) -> None:
    """Replace the ops of ``run`` (each feeding only the next's grads) with one chain
    node, where the last one was."""
    steps, grads, tensors, symints = _parts(run[0])
    for node in run[1:]:
        (step,), _, node_tensors, node_symints = _parts(node)
        sources = tuple(g.args[1] for g in node.args[0])
        t, s = len(tensors), len(symints)
        steps.append(
            Step(
                step.key, step.slot, step.hook,
                (t, t + len(node_tensors)), (s, s + len(node_symints)), sources,
            )
        )
        tensors += node_tensors
        symints += node_symints
    last = run[-1]
    with graph.inserting_before(last):
        chain = graph.call_function(CHAIN_OP, (grads, tensors, symints, register_chain(steps)))
    chain.meta = dict(last.meta)
    last.replace_all_uses_with(chain)
    graph.erase_node(last)
    for producer in reversed(run[:-1]):  # each one's outputs fed only the next op
        for g in list(producer.users):
            graph.erase_node(g)
        graph.erase_node(producer)


# --- the chain op: a run of opaque ops as one ----------------------------------------
opaque.LIB.define(
    "chain(Tensor?[] grads, Tensor?[] tensors, SymInt[] symints, str plan) -> Tensor?[]",
    tags=(CUDAGRAPH_UNSAFE,),
)


@dataclass(frozen=True)
class Step:
    """One opaque op of a chain: which runner, its key / slot / hook (None for C++),
    its slices of the chain's tensors and symints, and where its incoming grads come
    from (None: the chain's ``grads``; else indices into the previous step's outputs)."""

    key: str
    slot: int
    hook: int | None
    tensors: tuple[int, int]
    symints: tuple[int, int]
    sources: tuple[int, ...] | None


_CHAINS: dict[str, tuple[Step, ...]] = {}


def register_chain(steps: Sequence[Step]) -> str:
    """Store a chain's steps under a key derived from their content; return it."""
    steps = tuple(steps)
    plan = hashlib.sha1(repr(steps).encode()).hexdigest()[:20]
    _CHAINS[plan] = steps
    return plan


def chain_count() -> int:
    """Chain plans registered (one per fused run) since the last ``clear``."""
    return len(_CHAINS)


def chain_steps(plan: str) -> tuple[Step, ...]:
    return _CHAINS[plan]


@without_dynamo
def run_chain(grads, tensors, symints, plan):  # type: ignore[no-untyped-def]
    """Each step's op, in order, on the previous one's outputs, inside one dispatch:
    what the ops would do one by one, without the dispatcher between them."""
    outs = grads
    for step in _CHAINS[plan]:
        step_grads = grads if step.sources is None else [outs[j] for j in step.sources]
        step_tensors = tensors[step.tensors[0] : step.tensors[1]]
        step_symints = symints[step.symints[0] : step.symints[1]]
        if step.hook is None:
            outs = opaque.run_cpp(step_grads, step_tensors, step_symints, step.key, step.slot)
        else:
            outs = opaque.run_python(step_grads, step_tensors, step_symints, step.key, step.slot, step.hook)
    return outs


opaque.LIB.impl("chain", run_chain, "CompositeExplicitAutograd")


@torch.library.register_fake("ca_dynsaved::chain", lib=opaque.LIB)
def _(grads, tensors, symints, plan):  # type: ignore[no-untyped-def]
    last = _CHAINS[plan][-1]
    return opaque.fake_outputs(last.key, tensors[last.tensors[0] : last.tensors[1]], symints[last.symints[0] : last.symints[1]])


#: The OpOverload a fused run is in CA graphs: never removed as dead code (opaque.py).
CHAIN_OP = torch.ops.ca_dynsaved.chain.default
torch.fx.node.has_side_effect(CHAIN_OP)


@on_reset
def clear() -> None:
    """Forget every chain plan (only safe when no plugin CA graph is cached)."""
    _CHAINS.clear()
