"""One capture's state: what the hooks learn about it, typed, in one object.

``compiler.begin_capture`` makes a ``Capture``; each way a node runs (``ways/``) adds
to it at capture (the opaque ops' ``NodeCapture``s, verify's checks, the tiered
nodes, the graph's dynamic scalars); ``end_capture`` hands what it holds to the
runtime (``runtime.RunSpec``). Work C++ completes in the next hook
(``validate_outputs``, which gives a node's outputs' symbolic metadata) waits in
``pending`` as a typed record, never in loose attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .counting import count
from ._compat.layout import CppCall
from . import binding, report
from .graphs import head_end
from .decision import OPAQUE, STOCK, Decision, Lifted, Options, SentinelTrace, Tiered
from .opaque import FLOAT, INT
from .records import CaptureRecord
from .scalars import Layout


@dataclass
class Deferred:
    """A node whose opaque op waits for validate_outputs' symbolic metadata: an
    opaque node (``dummies``: what C++ got back as its outputs; ``emit_stock``:
    trace it as stock CA does instead), or a tiered node's second way (``tier``)."""

    decision: Decision
    grads: list[Any]
    dummies: list[torch.Tensor | None] = field(default_factory=list)
    emit_stock: Callable[[], Sequence[Any]] = lambda: ()
    fn: Callable[..., Any] | None = None  # C++: the functional; Python: None
    call: CppCall | None = None  # C++: its call arguments
    hook: int = -1  # Python: index of the ctx in CA's hooks
    saved: tuple[Any, ...] = ()  # Python: saved tensors
    tier: Tiered | None = None  # a later combination's node: also traced


@dataclass
class Traced:
    """A traced node that validate_outputs completes: a verified node's fallback
    (``ways.sentinel_traced.Fallback``), which needs the node CA's validation of its
    outputs begins with, and a tiered node's opaque op (``tier``)."""

    fallback: Any = None
    tier: Deferred | None = None


@dataclass
class Capture:
    """What one CA capture has gathered, by the hooks in capture order."""

    instance: Any  # the compiler instance: its tracer, to_proxy, scalars proxy
    id: int
    options: Options
    record: CaptureRecord
    layout: Layout
    values: list[Any]  # the lifted scalars' values at capture
    lifted: dict[Any, Lifted]  # symnode of each lifted scalar -> its record
    custom_fns: dict[str, Callable[..., Any]] = field(default_factory=dict)
    traceable: set[str] = field(default_factory=set)  # custom functions declaring is_traceable
    pending: Deferred | Traced | None = None
    nodes: list[binding.NodeCapture] = field(default_factory=list)  # per opaque op, in slot order
    dynamic_sources: list[str] = field(default_factory=list)  # traced nodes' numbers, as Dynamo names them
    traced_floats: bool = False  # a traced C++ node reads a lifted double
    opaque_reads_scalars: bool = False  # an opaque C++ node has a lifted number
    owners: dict[int, str] = field(default_factory=dict)  # lifted index -> "Fn's saved 'k'" (Packer)
    checks: list[Any] = field(default_factory=list)  # verify: a ways.verify.Check per verified node
    tiers: list[Any] = field(default_factory=list)  # later combinations' nodes (ways.tiered.Tier)
    guarded: list[Any] = field(default_factory=list)  # ways.python_traced.GuardedNode
    guarded_untiered: bool = False  # a guarded node has no opaque op (opaque.Unexpressible)
    # checkpointed saved tensors: (stock's call_hook node, hooks index, packed_data index)
    unpack_calls: list[tuple[torch.fx.Node, int, int]] = field(default_factory=list)
    last_region: list[torch.fx.Node] = field(default_factory=list)  # the newest traced node's
    packed: tuple[Any, Any] | None = None  # the packed tensors' proxies (packed_proxies)
    # the 0-dim reads of the packed scalars (packed_value), by (symnode, as_float)
    selects: dict[tuple[Any, bool], torch.fx.Node] = field(default_factory=dict)
    # made with the graph (create_graph_module): the tiered nodes' traced graph, the
    # checkpoint unpacks (their stock twin), verify's fallback graphs' base
    specialised: torch.fx.GraphModule | None = None
    unpacks: Any = None  # checkpoint.Unpacks
    fallback_base: torch.fx.GraphModule | None = None

    @classmethod
    def begin(cls, instance: Any, options: Options, values: list[Any], symbols: Sequence[Any]) -> "Capture":
        """The capture's state from CA's scalars: their ``values`` and the ``symbols``
        begin_capture made of them."""
        lifted, kinds = {}, []
        for index, sym in enumerate(symbols):
            kind = INT if isinstance(sym, torch.SymInt) else FLOAT
            lifted[sym.node] = Lifted(kind, kinds.count(kind), index, values[index])
            kinds.append(kind)
        record = report.begin_capture(instance.id)
        return cls(instance, instance.id, options, record, Layout(tuple(kinds)), values, lifted)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.instance.fx_tracer.graph

    def to_proxy(self, value: Any) -> Any:
        return self.instance.to_proxy(value)

    def node_of(self, t: Any) -> torch.fx.Node | None:
        """The graph node of tensor ``t`` (None for anything else)."""
        return self.to_proxy(t).node if isinstance(t, torch.Tensor) else None

    def await_tier(self, deferred: Deferred) -> None:
        """A tiered node's opaque op, emitted at its validation (after a verified
        node's fallback, if it has one, waiting there too)."""
        fallback = self.pending.fallback if isinstance(self.pending, Traced) else None
        self.pending = Traced(fallback, deferred)

    def recorded(self, trace: Callable[[], Any]) -> tuple[Any, list[torch.fx.Node]]:
        """``trace()``'s result and the nodes it added to the graph (its region)."""
        before = len(self.graph.nodes)
        out = trace()
        return out, list(self.graph.nodes)[before:]

    def traced_region(self, trace: Callable[[], Any]) -> Any:
        """``trace()``, keeping what it adds to the graph as ``last_region``."""
        out, self.last_region = self.recorded(trace)
        return out

    def record_node(self, decision: Decision, hook: int = -1) -> None:
        """A node's decision, to the report (as it is) and the plugin's counters."""
        report.node(self.record, decision, hook)
        for key, _, _, lifted in decision.saved if decision.kind == "C++" else ():
            if lifted is not None:
                self.owners[lifted] = f"{decision.name}'s saved '{key}'"
        if decision.handling == STOCK:
            count("stock_nodes")
            return
        if decision.kind == "C++":
            for _, type_, _, lifted in decision.saved:
                what = "hashed_values" if lifted is None else "lifted_ints" if type_ == INT else "lifted_floats"
                count(what)
        if decision.handling == OPAQUE:
            count("opaque_nodes")
        elif decision.kind == "Python":
            count("traced_python_nodes")
        else:
            count("traced_cpp_nodes")
            if isinstance(decision.plan, SentinelTrace):
                count("sentinel_cpp_nodes")
                count("optin_cpp_nodes", decision.plan.optin)

    def packed_proxies(self) -> tuple[Any, Any]:
        """The packed int64 and float64 tensors' nodes, read at the top of the graph:
        there the scalars list dies, so it is never live across a graph break, where
        Dynamo would rebuild it for the resume function with each number it does not
        treat as dynamic (an opaque node's) as a constant, guarded (a recompile when
        it changes; FSDP2's disabled hooks break every CA graph)."""
        if self.packed is None:
            scalars, graph = self.instance.scalars_proxy, self.graph
            with graph.inserting_after(head_end(graph)):
                ints = scalars[self.layout.packed_tensor(INT)]
            with graph.inserting_after(ints.node):
                floats = scalars[self.layout.packed_tensor(FLOAT)]
            self.packed = (ints, floats)
            self.layout.packed = True
        return self.packed

    def packed_value(self, symnode: Any, as_float: bool) -> torch.fx.Node:
        """A 0-dim tensor node of the lifted scalar ``symnode``'s packed value (an int
        cast to float64 when ``as_float``), placed right after the packed tensors'
        nodes; one per (scalar, as_float)."""
        found = self.selects.get((symnode, as_float))
        if found is not None:
            return found
        scalar = self.lifted[symnode]
        graph = self.graph
        packed = self.packed_proxies()[0 if scalar.kind is INT else 1].node
        with graph.inserting_after(packed):
            node = graph.call_function(torch.ops.aten.select.int, (packed, 0, scalar.slot))
        if as_float:
            with graph.inserting_after(node):
                node = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float64})
        self.selects[(symnode, as_float)] = node
        return node
