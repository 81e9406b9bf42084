"""The sentinel-traced way: a C++ backward that reads its numbers with ``toInt()`` /
``toDouble()`` (``decision.SentinelTrace``; the proof is ``sentinel.py``'s).

At capture (``trace``): the functional runs with sentinel set 0 in place of its
numbers (``cpptrace.trace``), and the region it recorded is rewritten: each
sentinel becomes the lifted value (``rewrite``: an int the graph's symbolic scalar,
a double, or an int cast to double, a 0-dim read of the packed float64 tensor, the
op switched from ``X.Scalar`` to ``X.Tensor``), each value computed from them (a
``sentinel.Derived``) a graph input the run fills (``rewrite_derived``,
``_place_derived``). A verified node gets its ``verify.Check``, and a ``Fallback``:
the node called directly, for a step whose values the check refuses, on a copy
of the capture's graph (``fallback_graph``) in which its inputs were kept alive.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .._compat.layout import CppCall
from .._compat.symbolic import TorchDispatchMode
from .. import cpptrace, sentinel
from ..cpptrace import REWRITES
from ..decision import SentinelTrace
from ..graphs import after_inputs
from ..opaque import FLOAT, INT
from ..state import Capture, Traced
from .verify import Check


def trace(
    cap: Capture, fn: Callable[..., Any], grads: Any, call: CppCall, plan: SentinelTrace
) -> tuple[list[Any], list[Any], list[torch.fx.Node], Check | None, str]:
    """Trace a plain reader with the sentinels in place of its saved numbers, then
    swap them, and the values it computes from them, for the lifted ones (read at
    the graph's head). Returns (the outputs CA gets, the output nodes, the
    region, verify's check or None, why the trace and its template do not line
    up, or '')."""
    numbers = sentinel.values(plan.plan.kinds, 0)
    ops = NodesOfOps(cap.graph) if plan.plan.derived else None
    # the region, recorded before the rewrite adds reads at the head
    (outs, out_nodes), region = cap.recorded(
        lambda: cpptrace.trace(cap.instance, fn, grads, call, values=plan.inputs.values(numbers), around=ops)
    )
    symbols = dict(zip(call.keys, call.values))
    rewrite(
        region,
        plan.plan.kinds,
        lambda slot: cap.packed_value(symbols[slot.key].node, slot.as_float),
        lambda slot: cap.to_proxy(symbols[slot.key]).node,
    )
    nodes = ops.nodes if ops is not None else []
    refusal = unplaceable(plan.plan, nodes)
    if refusal:
        return outs, out_nodes, region, None, refusal
    slots = _place_derived(cap, plan.plan, nodes)
    check = _check(cap, fn, grads, call, plan, region, out_nodes, slots) if plan.verify else None
    return outs, out_nodes, region, check, ""


def kept(cap: Capture, check: Check | None, region: list[torch.fx.Node]) -> None:
    """A sentinel-traced node whose trace the capture keeps (``region``); a verified
    one's ``check`` runs each step, and its inputs stay in the graph for its
    fallback, which also needs the validation of its outputs (``state.Traced``)."""
    cap.last_region = region
    if check is None:
        return
    cap.checks.append(check)
    fb = check.fallback
    cap.pending = Traced(fb)
    cap.graph.call_function(keep_alive, (*fb.grads, *fb.saved))


def fallback_base(cap: Capture, id: str) -> torch.fx.GraphModule:
    """The graph as it is, its verified nodes' inputs kept (``keep_alive``): what a
    refused step's fallback graph is made from (``fallback_graph``); the graph that
    runs compiled loses its keep_alive nodes, and what only they kept."""
    base = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    base.output(base.graph_copy(cap.graph, env))
    module = torch.fx.GraphModule(cap.instance.fx_tracer.root, base, f"{id}Fallback")
    for check in cap.checks:
        check.fallback = check.fallback.remapped(env)
    without_keep_alive(cap.graph)
    cap.instance.dce()
    return module


def _check(
    cap: Capture, fn: Callable[..., Any], grads: Any, call: CppCall, plan: SentinelTrace, region: list[torch.fx.Node],
    out_nodes: list[Any], slots: tuple[tuple[tuple[int, int], ...], ...],
) -> Check:
    """verify's check of a sentinel-traced node, run before each step with new
    values, and what runs the node directly for a step it refuses."""
    fallback = Fallback(
        fn,
        call.detached(),
        # (kind, slot) of each lifted number; (None, value) of each hashed value
        tuple(
            (cap.lifted[v.node].kind, cap.lifted[v.node].slot) if k in plan.plan.kinds else (None, v)
            for k, v in zip(call.keys, call.values)
        ),
        [cap.node_of(g) for g in grads],
        [cap.node_of(t) for t in call.saved],
        [p.node for p in cap.packed_proxies()],
        region,
        out_nodes,
    )
    keys = tuple(k for k in call.keys if k in plan.plan.kinds)  # the numbers, as plan.scalars
    return Check(call.name, plan.plan, plan.inputs, keys, plan.scalars, fallback, *slots)


def _place_derived(cap: Capture, plan: sentinel.Plan, nodes: list[Any]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The graph reads each value the node computes from its numbers (a
    ``sentinel.Derived``) from the run: an int from the scalars list after the
    packed tensors (dynamic from the first compile), a double from the float64
    packed tensor after the lifted doubles (``scalars.Layout``). Returns (int slots,
    float slots) as ``verify.Check`` places them: (Derived.index, index among the
    graph's)."""
    if not plan.derived:
        return ((), ())
    layout = cap.layout
    ints, floats = [], []
    for index in plan.derived_of(INT):
        ints.append((index, layout.derived_ints))
        cap.dynamic_sources.append(f"L['scalars'][{layout.derived_int(layout.derived_ints)}]")
        layout.derived_ints += 1
    for index in plan.derived_of(FLOAT):
        floats.append((index, layout.derived_floats))
        layout.derived_floats += 1
    at_int, at_float = dict(ints), dict(floats)

    def value_for(derived: sentinel.Derived) -> torch.fx.Node:
        # placed after the packed tensors' nodes: before the node's ops
        graph = cap.graph
        packed = cap.packed_proxies()[1].node
        with graph.inserting_after(packed):
            if derived.kind is INT:
                index = layout.derived_int(at_int[derived.index])
                return graph.call_function(operator.getitem, (cap.instance.scalars_proxy.node, index))
            return graph.call_function(torch.ops.aten.select.int, (packed, 0, layout.derived_float(at_float[derived.index])))

    rewrite_derived(plan, nodes, value_for)
    return tuple(ints), tuple(floats)


class NodesOfOps(TorchDispatchMode):
    """During the capture's trace of a node: the CA graph node each op it runs made
    (None if none), in the order the template lists the ops, so a Derived argument
    is found by its op and position, not by its value."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        super().__init__()
        self.graph = graph
        self.nodes: list[torch.fx.Node | None] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        before = len(self.graph.nodes)
        out = func(*args, **(kwargs or {}))
        made = [n for _, n in zip(range(len(self.graph.nodes) - before), reversed(self.graph.nodes))]
        self.nodes.append(next((n for n in made if n.op == "call_function" and n.target is func), None))
        return out


def unplaceable(plan_: sentinel.Plan, nodes: Sequence[torch.fx.Node | None]) -> str:
    """Why the capture's trace of a node (``nodes``, from ``NodesOfOps``) does not
    line up with its template, so its computed values cannot be placed, or ''."""
    if not plan_.derived:
        return ""
    if len(nodes) != len(plan_.template):
        return f"the capture traced {len(nodes)} ops where the sentinel traces ran {len(plan_.template)}"
    missing = next((i for i, _, _ in plan_.derived if nodes[i] is None), None)
    return "" if missing is None else f"op {missing} of its trace made no graph node"


def rewrite_derived(
    plan_: sentinel.Plan,
    nodes: Sequence[torch.fx.Node | None],
    value_for: Callable[[sentinel.Derived], torch.fx.Node],
) -> None:
    """Each Derived argument of the template, at its op's node (``nodes``, from
    ``NodesOfOps``, which ``unplaceable`` accepted), becomes ``value_for(derived)``:
    an int the graph's symbolic scalar, a double (an ``X.Scalar`` op's scalar, the op
    switched to ``X.Tensor``) a 0-dim float64 tensor."""
    for op_index, position, kind in plan_.derived:
        node = nodes[op_index]
        assert node is not None
        derived = plan_.template[op_index][1][position]
        value = value_for(derived)
        if kind is FLOAT:  # placement: argument 1 of an X.Scalar op
            node.target = REWRITES[node.target]
            node.args = (node.args[0], value, *node.args[2:])
        else:
            node.args, node.kwargs = _replace_leaf(node.args, node.kwargs, position, value)


def _replace_leaf(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, value: Any) -> tuple[Any, Any]:
    """``args``/``kwargs`` with leaf ``position`` (as ``recording`` counts leaves after
    the kwargs names) replaced by ``value``."""
    count = [0]

    def walk(v: Any) -> Any:
        count[0] += 1
        if isinstance(v, (list, tuple)) and not isinstance(v, torch.fx.Node):
            return type(v)(walk(x) for x in v)
        return value if count[0] == position else v

    # leaf 0 is the kwargs names; a list is one leaf (its length) and then its items
    new_args = tuple(walk(a) for a in args)
    new_kwargs = {k: walk(v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def rewrite(
    region: Sequence[torch.fx.Node],
    kinds: dict[str, str],
    tensor_for: Callable[[sentinel.Slot], torch.fx.Node],
    symint_for: Callable[[sentinel.Slot], torch.fx.Node],
) -> None:
    """Make the sentinels the capture traced with (set 0) the lifted values in the
    ``region`` of the CA graph the trace recorded: an ``X.Scalar`` op's double (or
    int cast to double) becomes ``X.Tensor`` of ``tensor_for(slot)`` (a 0-dim
    float64), an int anywhere becomes ``symint_for(slot)`` (the symbolic scalar)."""
    sentinels = sentinel.values(kinds, 0)

    def substitute(leaf: Any) -> Any:
        slot = None if isinstance(leaf, torch.fx.Node) else sentinel.match(leaf, sentinels, kinds)
        if slot is None:
            return leaf
        if slot.kind is INT and not slot.as_float:
            return symint_for(slot)
        raise RuntimeError(f"ca_dynsaved: saved '{slot.key}' at a place its plan refused")

    for node in region:
        if node.op != "call_function":
            continue
        args = list(node.args)
        if node.target in REWRITES and len(args) > 1:
            slot = sentinel.match(args[1], sentinels, kinds)
            if slot is not None and (slot.kind is FLOAT or slot.as_float):
                node.target = REWRITES[node.target]
                args[1] = tensor_for(slot)
        node.args = torch.fx.node.map_aggregate(tuple(args), substitute)
        node.kwargs = torch.fx.node.map_aggregate(dict(node.kwargs), substitute)


@dataclass
class Fallback:
    """A sentinel-traced node, called directly: for a step whose values its check
    refused. The C++ functional and its concrete call data, each saved number's
    (kind, index in the packed tensors), and the CA graph's nodes of its incoming
    grads, saved tensors, packed scalars, of what its trace recorded and returned.
    Its grads and saved tensors are kept alive in the capture's graph by a
    ``keep_alive`` node (CA's dead-code pass would drop one the traced ops do not
    use), which the graph that runs compiled does not have (``fallback_base``)."""

    fn: Callable[..., Any]
    call: CppCall  # detached: filled in by each run
    numbers: tuple[tuple[str | None, Any], ...]  # (kind, slot); (None, the value) if hashed
    grads: list[torch.fx.Node | None]
    saved: list[torch.fx.Node | None]
    packed: list[torch.fx.Node]
    region: list[torch.fx.Node]
    outputs: list[torch.fx.Node | None]
    # CA's validation of its outputs, the one reader of them outside the region (an
    # output may be an input as it is, which other nodes read too)
    validate: torch.fx.Node | None = None

    def run(self, grads: list[Any], saved: list[Any], ints: torch.Tensor, floats: torch.Tensor) -> list[Any]:
        """The backward with this run's saved numbers; the forward outputs' sizes
        (output_info) are the incoming grads' of this run."""
        numbers = [i if kind is None else (ints if kind is INT else floats)[i].item() for kind, i in self.numbers]
        call = self.call.with_output_sizes([None if g is None else g.shape for g in grads])
        return list(call.call(self.fn, grads, values=numbers, saved=saved))

    @property
    def name(self) -> str:
        return self.call.name

    def remapped(self, env: dict[torch.fx.Node, torch.fx.Node]) -> "Fallback":
        """The same node, its graph nodes those ``env`` maps them to (a graph's copy)."""
        def one(node: torch.fx.Node | None) -> torch.fx.Node | None:
            return None if node is None else env.get(node)

        return dataclasses.replace(
            self,
            grads=[one(g) for g in self.grads],
            saved=[one(t) for t in self.saved],
            packed=[env[p] for p in self.packed],
            region=[env[n] for n in self.region if n in env],
            outputs=[one(o) for o in self.outputs],
            validate=one(self.validate),
        )


def keep_alive(*nodes: Any) -> None:
    """A user of a sentinel-traced node's inputs in the capture's graph (never run:
    removed before the graph is compiled or run)."""


# Side-effectful to FX's dead-code pass, so CA's own pass keeps what it holds.
torch.fx.node.has_side_effect(keep_alive)


def without_keep_alive(graph: torch.fx.Graph) -> None:
    """Erase ``graph``'s ``keep_alive`` nodes."""
    for node in list(graph.find_nodes(op="call_function", target=keep_alive)):
        graph.erase_node(node)


def fallback_graph(base: torch.fx.GraphModule, fallbacks: Sequence[Fallback]) -> torch.fx.GraphModule:
    """A copy of ``base`` (the capture's graph with its ``keep_alive`` nodes, so every
    fallback's inputs are there) in which each fallback's node is called directly
    instead of its traced ops, for eager runs."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(base.graph, env))
    for fb in fallbacks:
        args = (
            [None if g is None else env[g] for g in fb.grads],
            [None if t is None else env[t] for t in fb.saved],
            *(env[p] for p in fb.packed),
        )
        with graph.inserting_before(env[fb.region[0]] if fb.region else None):
            call = graph.call_function(fb.run, args)
        # CA's validation takes the outputs as its first argument, by position (one
        # tensor may be two outputs, or an input as it is)
        assert fb.validate is not None, f"ca_dynsaved: no validation of {fb.name}'s outputs was captured"
        validate = env[fb.validate]
        outputs = list(validate.args[0])  # type: ignore[arg-type]
        assert len(outputs) == len(fb.outputs), f"ca_dynsaved: {fb.name}'s outputs and their validation differ"
        after = call
        for i, out in enumerate(fb.outputs):
            if out is not None:
                with graph.inserting_after(after):
                    after = outputs[i] = graph.call_function(operator.getitem, (call, i))
        validate.args = (outputs, *validate.args[1:])
        for node in reversed(fb.region):
            if not env[node].users:
                graph.erase_node(env[node])
    without_keep_alive(graph)
    after_inputs(graph)  # the call after its inputs (a grad the trace did not use may come later)
    return torch.fx.GraphModule(base, graph)
