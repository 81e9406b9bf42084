"""Capture-time hooks: the AutogradCompilerInstance subclass that carries out decisions.

C++ calls ``begin_capture``, ``bind_function``, ``apply_functional``,
``proxy_call_backward``, ``validate_outputs`` and ``end_capture`` on the instance
by name, so overriding them is enough to change how custom functions enter the CA
graph. Per custom-function node, ``decision.py`` decides (traced, opaque or stock,
and why) and this module carries the decision out:

* ``begin_capture`` records which symbolic scalars are lifted ``saved_data`` values
  (``decision.Lifted``, the ``scalars`` placeholder);
* ``apply_functional`` (a C++ function) and ``proxy_call_backward`` (a Python one)
  trace a ``TRACED`` node (``cpptrace``, ``sentinel``; Python: stock tracing with its
  ctx numbers dynamic), leave a ``STOCK`` one to stock CA, and defer an ``OPAQUE``
  one: ``validate_outputs``, which C++ calls right after with the outputs' symbolic
  metadata, emits one opaque op that runs the backward and validates its outputs
  (``opaque.py``);
* ``create_graph_module`` swaps the traced nodes' sentinels and lifted doubles for
  the packed values; ``end_capture`` wraps the runtime wrapper (``runtime.py``) so it
  binds each run's numbers and hooks for the ops. The graph never hands a Python
  number to an op, so Dynamo guards none.

Every decision reaches the report as it is (``_record``). Every override is excluded
from Dynamo: capture runs inside ``.backward()``, which may run inside a compiled
frame (DESIGN-NOTES pitfall 1).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ._compat.capture import StockCompilerInstance, counters, grad_dtype, no_proxy_modes
from ._compat.dynamic_state import mark_dynamic_scalars
from ._compat.layout import CppCall, grads_of
from ._compat.runtime_wrapper import sizes_made_once
from ._compat.symbolic import size_hints
from . import binding, checkpoint, cpptrace, differential, opaque, recording, report, runtime, sentinel
from .decision import (
    HASHED_ONLY, OPAQUE, STOCK, TRACED, CppTrace, Decision, Lifted, OpaqueCall, Options, PythonTrace, SentinelTrace,
    Tiered, decide_cpp, decide_python, opaque_cpp,
)

_disable = torch.compiler.disable
#: TORCH_LOGS="ca_dynsaved" shows what the plugin did with each capture; "+ca_dynsaved"
#: adds the captured graph.
log = logging.getLogger("ca_dynsaved")


@dataclass
class _Deferred:
    """An opaque node waiting for validate_outputs' symbolic metadata."""

    decision: Decision
    grads: list[Any]
    dummies: list[torch.Tensor | None]  # what C++ got back as the call's outputs
    emit_stock: Callable[[], Sequence[Any]]  # trace it as stock CA does instead
    fn: Callable[..., Any] | None = None  # C++: the functional; Python: None
    call: CppCall | None = None  # C++: its call arguments
    hook: int = -1  # Python: index of the ctx in CA's hooks
    saved: tuple[Any, ...] = ()  # Python: saved tensors
    tier: Tiered | None = None  # a later combination's node: also traced


@dataclass
class _Tier:
    """A later combination's node (``decision.Tiered``), traced and also emitted as
    an opaque op: create_graph_module makes the capture's graph of each way."""

    op: torch.fx.Node  # the opaque op
    keep: torch.fx.Node  # its one user until then, so CA's dead-code pass keeps it
    validated: list[torch.fx.Node | None]  # the traced outputs, as CA validated them
    traced: list[torch.fx.Node]  # what its trace recorded (in-place ops included)
    check: "runtime.Check | None"  # verify's, for the specialised graph only
    function: tuple[str, tuple[str, ...]]  # (name, saved keys): COMBINATIONS' count
    way: str  # how the capture chooses between its graphs (runtime.tiered)


def _keep(*args: Any) -> None:
    """A user of a tiered node's opaque op during capture (never run: removed before
    either graph is made)."""


# Side-effectful to FX's dead-code pass, so CA's own pass keeps the op it holds.
torch.fx.node.has_side_effect(_keep)


def _unpacked_inputs_end(graph: torch.fx.Graph) -> torch.fx.Node:
    """The last node of the graph's head: its placeholders and the items CA reads
    from them at begin_capture (``inputs[i]``, ``sizes[i]``, ``scalars[i]``), which
    CA's backends expect first, in that order."""
    last = None
    for node in graph.nodes:
        head = node.op == "placeholder" or (
            node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "placeholder"
        )
        if not head:
            break
        last = node
    assert last is not None
    return last


class DynSavedCompilerInstance(StockCompilerInstance):
    """A CA capture that handles custom-function nodes as ``decision.py`` decides,
    with the user's ``options`` (``decision.Options``: exclude, python_policy,
    trace_cpp, verify)."""

    def __init__(self, compiler_fn: Callable[..., Any], options: Options = Options()) -> None:
        super().__init__(compiler_fn)
        self.options = options

    @_disable
    def begin_capture(self, inputs, sizes, scalars, origins, accumulate_grad, check_nans):  # type: ignore[no-untyped-def,override]
        values = list(scalars)  # super() swaps them for symbols in place
        out = super().begin_capture(inputs, sizes, scalars, origins, accumulate_grad, check_nans)
        self._lifted: dict[Any, Lifted] = {}  # symnode of each lifted scalar -> its record
        self._scalar_kinds: list[str] = []
        for index, sym in enumerate(out[3]):
            kind = opaque.INT if isinstance(sym, torch.SymInt) else opaque.FLOAT
            self._lifted[sym.node] = Lifted(kind, self._scalar_kinds.count(kind), index, values[index])
            self._scalar_kinds.append(kind)
        self._packed_proxies: tuple[Any, Any] | None = None
        self._custom_fns: dict[str, Callable[..., Any]] = {}
        self._traceable: set[str] = set()  # custom functions declaring is_traceable
        self._deferred: _Deferred | None = None
        self._capture = report.begin_capture(self.id)
        self._nodes: list[binding.NodeCapture] = []  # per opaque op, in slot order
        self._dynamic_sources: list[str] = []  # numbers of traced nodes, as Dynamo names them
        self._traced_floats = False  # a traced C++ node reads a lifted double
        self._opaque_reads_scalars = False  # an opaque C++ node has a lifted number
        self._scalar_values = values  # the lifted scalars' values at capture
        # the 0-dim reads of the packed scalars (_packed_value_node), by (symnode, as_float)
        self._selects: dict[tuple[Any, bool], torch.fx.Node] = {}
        self._last_region: list[torch.fx.Node] = []  # the newest sentinel-traced node's
        self._fallback_base: torch.fx.GraphModule | None = None  # runtime.fallback_graph's
        self._owners: dict[int, str] = {}  # lifted scalar index -> "Fn's saved 'k'" (runtime.Packer)
        self._awaiting_validation: runtime.Fallback | None = None  # the verified node just traced
        self._checks: list[runtime.Check] = []  # verify: one per verified node
        self._tiers: list[_Tier] = []  # later combinations' nodes (decision.Tiered)
        self._tier_pending: _Deferred | None = None  # one awaiting validate_outputs
        self._specialised: torch.fx.GraphModule | None = None  # their traced graph
        self._derived = [0, 0]  # ints and doubles sentinel-traced nodes compute from their numbers
        # checkpointed saved tensors: (stock's call_hook node, hooks index, packed_data index)
        self._unpack_calls: list[tuple[torch.fx.Node, int, int]] = []
        self._unpacks: checkpoint.Unpacks | None = None
        self._guarded: list[runtime.GuardedNode] = []  # traced Python nodes that read bools / strs
        self._guarded_untiered = False  # one of them has no opaque op (opaque.Unexpressible)
        return out

    @_disable
    def allocate_dummy_like(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Stock calls this once, for the gradient its capture assigns to a leaf
        # (accumulate_grad), in the leaf's dtype; a leaf whose gradient has another
        # dtype (``Tensor.grad_dtype``: torch 2.15's FSDP2 mixed precision gives bf16
        # unsharded parameters fp32 gradients) refuses it. In the gradient's dtype.
        with no_proxy_modes():
            return torch.empty_like(x, dtype=grad_dtype(x))

    @_disable
    def unpack_hook(self, hook_id: int, data_id: int) -> torch.Tensor:  # type: ignore[override]
        # Stock's call_hook node, which create_graph_module swaps for the unpack op
        # (checkpoint.py) and keeps in the stock twin: which hook it is, CA tells only
        # the run.
        out = super().unpack_hook(hook_id, data_id)
        self._unpack_calls.append((self.to_proxy(out).node, hook_id, data_id))
        return out

    @_disable
    def bind_function(self, fn_name, fn, is_custom_function, is_traceable):  # type: ignore[no-untyped-def,override]
        name = super().bind_function(fn_name, fn, is_custom_function, is_traceable)
        if is_custom_function:
            self._custom_fns[name] = fn
            if is_traceable:
                self._traceable.add(name)
        return name

    @_disable
    def apply_functional(self, fn_name, grads, args, output_metadata):  # type: ignore[no-untyped-def,override]
        def stock() -> Sequence[Any]:
            return super(DynSavedCompilerInstance, self).apply_functional(fn_name, grads, args, output_metadata)

        if fn_name not in self._custom_fns:
            return stock()
        fn = self._custom_fns[fn_name]
        undefined = tuple(g is None for g in grads)
        decision, call = decide_cpp(
            args, fn, fn_name in self._traceable, self.options, self._lifted, undefined, self.id
        )
        if isinstance(decision.plan, Tiered) and decision.plan.traced is None:
            # no saved numbers: stock's trace is its own graph's
            graph = self.fx_tracer.graph
            before = len(graph.nodes)
            out = stock()
            self._last_region = list(graph.nodes)[before:]
            opaque_ = dataclasses.replace(decision, plan=decision.plan.opaque)
            self._tier_pending = _Deferred(opaque_, list(grads), [], lambda: (), fn=fn, call=call, tier=decision.plan)
            return out
        if isinstance(decision.plan, (CppTrace, SentinelTrace, Tiered)):
            assert call is not None
            plan = decision.plan.traced if isinstance(decision.plan, Tiered) else decision.plan
            traced = self._trace_checked(fn, grads, call, plan, undefined)
            if isinstance(traced, str):  # the differential check refused the trace
                if isinstance(plan, SentinelTrace) and plan.optin:
                    sentinel.refused(call.name, traced)
                decision = opaque_cpp(decision, call, f"{decision.reason}; but {traced}")
            elif isinstance(decision.plan, Tiered):
                # its opaque op too, emitted in validate_outputs (_emit_tier)
                opaque_ = dataclasses.replace(decision, plan=decision.plan.opaque)
                self._tier_pending = _Deferred(opaque_, list(grads), [], lambda: (), fn=fn, call=call, tier=decision.plan)
                return traced[0]
            else:
                self._record(decision)
                return traced[0]
        if decision.handling == OPAQUE:
            with no_proxy_modes():
                dummies = [self.allocate_dummy() for _ in output_metadata]
            self._deferred = _Deferred(decision, list(grads), dummies, stock, fn=fn, call=call)
            return dummies
        self._record(decision)
        return stock()

    def _trace_checked(
        self, fn: Callable[..., Any], grads: Any, call: CppCall, plan: CppTrace | SentinelTrace, undefined: tuple[bool, ...]
    ) -> tuple[list[Any], list[torch.fx.Node]] | str:
        """Record the C++ backward's ATen ops (``cpptrace.trace``: ``CppTrace`` reads its
        numbers symbolically; ``_trace_sentinels``), then the differential check
        (``differential.py``). Returns (the outputs CA gets, the region), or why the
        node cannot run traced: then the region is gone and the node runs opaque."""
        graph = self.fx_tracer.graph
        if isinstance(plan, SentinelTrace) or plan.floats:
            self._packed_scalar_proxies()  # the packed tensors' nodes, before the ops
        if isinstance(plan, SentinelTrace):
            outs, out_nodes, region, check, refusal = self._trace_sentinels(fn, grads, call, plan)
        else:
            before = len(graph.nodes)
            outs, out_nodes = cpptrace.trace(self, fn, grads, call)
            region, check, refusal = list(graph.nodes)[before:], None, ""
        refusal = refusal or self._differential(fn, call, plan, check, undefined, region, out_nodes, grads)
        if refusal:
            for node in reversed(region):
                graph.erase_node(node)
            return refusal
        # Dynamic from the first compile: an int, and a double that reaches an op the
        # backend tensorifies (one the rewrite feeds from the packed tensor is never
        # read by Dynamo at all).
        self._dynamic_sources.extend(f"L['scalars'][{index}]" for index in plan.scalars)
        if isinstance(plan, CppTrace):
            self._traced_floats |= plan.floats
            return outs, region
        self._last_region = region
        if check is not None:
            self._checks.append(check)
            # its inputs stay in the graph for its fallback (runtime.Fallback), which
            # also needs the validation of its outputs (validate_outputs)
            fb = self._awaiting_validation = check.fallback
            graph.call_function(runtime.keep_alive, (*fb.grads, *fb.saved))
        return outs, region

    def _trace_sentinels(
        self, fn: Callable[..., Any], grads: Any, call: CppCall, plan: SentinelTrace
    ) -> tuple[list[Any], list[Any], list[torch.fx.Node], "runtime.Check | None", str]:
        """Trace a plain reader with the sentinels in place of its saved numbers, then
        swap them, and the values it computes from them, for the lifted ones (read at
        the graph's head). Returns (the outputs CA gets, the output nodes, the
        region, verify's check or None, why the trace and its template do not line
        up, or '')."""
        numbers = sentinel.values(plan.plan.kinds, 0)
        graph = self.fx_tracer.graph
        ops = sentinel.NodesOfOps(graph) if plan.plan.derived else None
        before = len(graph.nodes)
        outs, out_nodes = cpptrace.trace(self, fn, grads, call, values=plan.inputs.values(numbers), around=ops)
        region = list(graph.nodes)[before:]  # before the rewrite adds reads at the head
        symbols = dict(zip(call.keys, call.values))
        sentinel.rewrite(
            region,
            plan.plan.kinds,
            lambda slot: self._packed_value_node(symbols[slot.key].node, slot.as_float),
            lambda slot: self.to_proxy(symbols[slot.key]).node,
        )
        nodes = ops.nodes if ops is not None else []
        refusal = sentinel.unplaceable(plan.plan, nodes)
        if refusal:
            return outs, out_nodes, region, None, refusal
        slots = self._place_derived(plan.plan, nodes)
        check = self._check(fn, grads, call, plan, region, out_nodes, slots) if plan.verify else None
        return outs, out_nodes, region, check, ""

    def _check(
        self, fn: Callable[..., Any], grads: Any, call: CppCall, plan: SentinelTrace, region: list[torch.fx.Node],
        out_nodes: list[Any], slots: tuple[tuple[tuple[int, int], ...], ...],
    ) -> "runtime.Check":
        """verify's check of a sentinel-traced node, run before each step with new
        values, and what runs the node directly for a step it refuses."""

        def node(t: Any) -> torch.fx.Node | None:
            return self.to_proxy(t).node if isinstance(t, torch.Tensor) else None

        fallback = runtime.Fallback(
            fn,
            call.detached(),
            # (kind, slot) of each lifted number; (None, value) of each hashed value
            tuple(
                (self._lifted[v.node].kind, self._lifted[v.node].slot) if k in plan.plan.kinds else (None, v)
                for k, v in zip(call.keys, call.values)
            ),
            [node(g) for g in grads],
            [node(t) for t in call.saved],
            [p.node for p in self._packed_scalar_proxies()],
            region,
            out_nodes,
        )
        keys = tuple(k for k in call.keys if k in plan.plan.kinds)  # the numbers, as plan.scalars
        return runtime.Check(call.name, plan.plan, plan.inputs, keys, plan.scalars, fallback, *slots)

    def _differential(
        self, fn: Callable[..., Any], call: CppCall, plan: CppTrace | SentinelTrace, check: "runtime.Check | None",
        undefined: tuple[bool, ...], region: list[torch.fx.Node], out_nodes: list[Any], grads: Any,
    ) -> str:
        """The differential check of a node just traced: its region against its own
        backward, with the capture's values (a sentinel-traced node's, where verify
        refuses them: sentinel set 0's, which its graph holds as they are)."""
        scalars = list(self._scalar_values)
        derived_ints, derived_floats = [0] * self._derived[0], [0.0] * self._derived[1]
        if isinstance(plan, SentinelTrace):
            inputs = plan.inputs
            index = {k: self._lifted[v.node].index for k, v in zip(call.keys, call.values) if k in plan.plan.kinds}
            numbers = {k: scalars[i] for k, i in index.items()}
            if check is not None:
                if check.refusal(scalars):
                    numbers = sentinel.values(plan.plan.kinds, 0)
                    check.derived = sentinel.check(plan.plan, inputs, numbers)[1]
                check.place(derived_ints, derived_floats)
                for key, number in numbers.items():
                    scalars[index[key]] = number
            values = inputs.values(numbers)
        else:
            inputs = recording.Inputs.of(fn, call, undefined)
            values = [scalars[self._lifted[v.node].index] for v in call.values]
        packed = runtime.Packer(self._scalar_kinds, tensors=self._packed_proxies is not None)
        _, _, scalar_values = packed(scalars, derived_ints, derived_floats)
        with no_proxy_modes():
            capture_sizes = (
                [(size_hints(t)[0], t.dtype, t.device) if isinstance(t, torch.Tensor) else t for t in call.saved],
                [None if u else (list(t.shape), t.dtype, t.device) for t, u in zip(call.incoming_grads(), undefined)],
            )

        def node(t: Any) -> torch.fx.Node | None:
            return self.to_proxy(t).node if isinstance(t, torch.Tensor) else None

        refusal = differential.differs(
            inputs, values, region, out_nodes, [node(g) for g in grads], [node(t) for t in call.saved],
            (self.scalars_proxy.node, scalar_values), capture_sizes,
        )
        counters["ca_dynsaved"]["differential_checks"] += 1
        if refusal:
            counters["ca_dynsaved"]["differential_refusals"] += 1
            log.info("capture !%d: %s runs opaque: %s", self.id, call.name, refusal)
        return refusal and f"its traced graph and its own backward differ at the capture's values: {refusal}"

    def _emit_tier(self, outputs: Sequence[Any], meta: Any) -> None:
        pending, self._tier_pending = self._tier_pending, None
        assert pending is not None
        tier = pending.tier
        assert tier is not None
        check = self._checks.pop() if tier.traced is not None and tier.traced.verify else None
        try:
            proxy_out = self._emit_opaque(pending, meta)
        except opaque.Unexpressible as e:
            # No opaque op for it: the capture's graph is the traced one, as for a
            # combination of the function's first capture (a Python node: stock's).
            if tier.guarded is not None:  # its combinations past the cap run the graph uncompiled
                traced_ = dataclasses.replace(pending.decision, plan=tier.guarded)
                self._guarded_untiered = True
            elif pending.call is None:
                traced_ = pending.decision.demoted(str(e))
            elif tier.traced is None:
                traced_ = pending.decision.demoted(f"{HASHED_ONLY} ({e})")
            else:
                traced_ = dataclasses.replace(
                    pending.decision, handling=TRACED, reason=f"traced with sentinels: {tier.traced.plan.reason} ({e})",
                    plan=tier.traced,
                )
            self._record(traced_, pending.hook)
            if check is not None:
                self._checks.append(check)
            return
        keep = self.fx_tracer.create_proxy("call_function", _keep, (proxy_out,), {})
        validated = [None if o is None else self.to_proxy(o).node for o in outputs]
        if pending.call is not None:
            function, way = (pending.call.name, pending.call.keys), runtime.HELD
        else:  # Python: its opaque graph compiled when it runs
            function = (pending.decision.name, tuple(key for key, *_ in pending.decision.saved))
            way = runtime.MEASURED if tier.guarded is None else runtime.GUARDED
        self._tiers.append(_Tier(proxy_out.node, keep.node, validated, self._last_region, check, function, way))

    def _place_derived(self, plan: sentinel.Plan, nodes: list[Any]) -> tuple[tuple[tuple[int, int], ...], ...]:
        """The graph reads each value the node computes from its numbers (a
        ``sentinel.Derived``) from the run: an int from the scalars list after the
        packed tensors (dynamic from the first compile), a double from the float64
        packed tensor after the lifted doubles. Returns (int slots, float slots) as
        ``runtime.Check`` places them: (Derived.index, index among the graph's)."""
        if not plan.derived:
            return ((), ())
        ints, floats = [], []
        for index in plan.derived_of(opaque.INT):
            ints.append((index, self._derived[0]))
            self._dynamic_sources.append(f"L['scalars'][{len(self._scalar_kinds) + 2 + self._derived[0]}]")
            self._derived[0] += 1
        for index in plan.derived_of(opaque.FLOAT):
            floats.append((index, self._derived[1]))
            self._derived[1] += 1
        at_int, at_float = dict(ints), dict(floats)
        n_floats = self._scalar_kinds.count(opaque.FLOAT)

        def value_for(derived: sentinel.Derived) -> torch.fx.Node:
            # placed after the packed tensors' nodes: before the node's ops
            graph = self.fx_tracer.graph
            packed = self._packed_scalar_proxies()[1].node
            with graph.inserting_after(packed):
                if derived.kind is opaque.INT:
                    index = len(self._scalar_kinds) + 2 + at_int[derived.index]
                    return graph.call_function(operator.getitem, (self.scalars_proxy.node, index))
                return graph.call_function(torch.ops.aten.select.int, (packed, 0, n_floats + at_float[derived.index]))

        sentinel.rewrite_derived(plan, nodes, value_for)
        return tuple(ints), tuple(floats)

    @_disable
    def proxy_call_backward(  # type: ignore[override]
        self, inputs, output_metadatas, saved_tensors, backward_idx, ctx,
        maybe_backward_state_idx, opaque_object_indices,
    ):  # type: ignore[no-untyped-def]
        def stock() -> Sequence[Any]:
            return super(DynSavedCompilerInstance, self).proxy_call_backward(
                inputs, output_metadatas, saved_tensors, backward_idx, ctx,
                maybe_backward_state_idx, opaque_object_indices,
            )

        decision = decide_python(
            ctx, backward_idx, self.options, maybe_backward_state_idx, opaque_object_indices,
            saved_tensors, tuple(m is not None for m in output_metadatas),
        )
        if decision is None:
            return stock()  # torch's own compiled backward, not a user function
        if isinstance(decision.plan, Tiered):
            # stock's call (its pieces' graph, or its trace with the numbers dynamic);
            # its opaque op too, emitted in validate_outputs (_emit_tier)
            if decision.plan.guarded is not None:
                self._traced_python(decision.plan.guarded, backward_idx, decision.name, saved_tensors, output_metadatas, ctx)
            graph = self.fx_tracer.graph
            before = len(graph.nodes)
            out = stock()
            self._last_region = list(graph.nodes)[before:]
            opaque_ = dataclasses.replace(decision, plan=decision.plan.opaque)
            self._tier_pending = _Deferred(
                opaque_, list(inputs), [], lambda: (), hook=backward_idx, saved=tuple(saved_tensors), tier=decision.plan
            )
            return out
        if decision.handling != OPAQUE:
            self._record(decision, backward_idx)
            if isinstance(decision.plan, PythonTrace):
                self._traced_python(decision.plan, backward_idx, decision.name, saved_tensors, output_metadatas, ctx)
            return stock()
        # One metadata per forward input, None where the input was not a tensor;
        # C++ keeps the backward's outputs at the tensor positions only.
        with no_proxy_modes():
            dummies = [None if m is None else self.allocate_dummy() for m in output_metadatas]
        self._deferred = _Deferred(
            decision, list(inputs), dummies, stock, hook=backward_idx, saved=tuple(saved_tensors)
        )
        return tuple(dummies)

    def _traced_python(
        self, plan: PythonTrace, hook: int, name: str, saved: Sequence[Any], metadatas: Sequence[Any], ctx: Any
    ) -> None:
        """Stock tracing, with the ctx numbers dynamic from the first compile; each
        new combination of its guarded values probed before it compiles."""
        self._dynamic_sources.extend(plan.sources)
        if plan.guarded:
            self._guarded.append(runtime.GuardedNode(
                name, hook, plan.guarded, tuple(saved), tuple(m is not None for m in metadatas), grads_of(ctx)
            ))

    @_disable
    def validate_outputs(self, _, outputs, args, output_metadata):  # type: ignore[no-untyped-def,override]
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            fallback, self._awaiting_validation = self._awaiting_validation, None
            last = next(iter(reversed(self.fx_tracer.graph.nodes)))
            out = super().validate_outputs(_, outputs, args, output_metadata)
            if fallback is not None:  # the first node stock's validation made
                fallback.validate = last.next
            if self._tier_pending is not None:
                self._emit_tier(outputs, args[0])
            return out
        expected = [d for d in deferred.dummies if d is not None]
        if len(outputs) != len(expected) or any(o is not d for o, d in zip(outputs, expected)):
            raise RuntimeError(
                f"ca_dynsaved: validate_outputs after {deferred.decision.name} got other tensors "
                "than its outputs; this torch's CA capture order is not supported"
            )
        try:
            proxy_out = self._emit_opaque(deferred, args[0])
        except opaque.Unexpressible as e:
            self._record(deferred.decision.demoted(str(e)), deferred.hook)
            traced = [t for t in deferred.emit_stock() if t is not None]
            self.bind_objects_to_proxies(outputs, [self.to_proxy(t) for t in traced])
            return super().validate_outputs(_, outputs, args, output_metadata)
        self.bind_objects_to_proxies(outputs, [proxy_out[i] for i in range(len(outputs))])
        return outputs

    def _emit_opaque(self, deferred: _Deferred, meta: Any) -> Any:
        """Put one opaque op for ``deferred`` in the graph; return its output proxy."""
        plan: OpaqueCall = deferred.decision.plan  # type: ignore[assignment]
        if deferred.call is not None:
            # A saved value CA hashed is a value of this capture, not structure: it
            # reaches the op at run time (binding.NodeCapture).
            values = [v if s is None else opaque.Captured(s) for v, s in zip(deferred.call.values, plan.slots)]
            call_args: Any = deferred.call.args(values=values)
        else:
            call_args = (plan.inputs,)
        key, tensors, symints, reads_scalars = opaque.node_spec(deferred.decision.name, call_args, meta, self._lifted)
        slot = len(self._nodes)
        self._nodes.append(binding.NodeCapture(deferred.fn, plan.captured))
        guarded = deferred.tier.guarded if deferred.tier is not None else None
        # a guarded Python node: recorded as what runs first, its trace
        self._record(deferred.decision if guarded is None else dataclasses.replace(deferred.decision, plan=guarded), deferred.hook)
        grads, tensors, symints = self.to_proxy(deferred.grads), self.to_proxy(tensors), self.to_proxy(symints)
        if deferred.call is not None:
            # Its lifted numbers reach the op through the run (binding.bound_run).
            self._opaque_reads_scalars |= reads_scalars
            op, op_args = opaque.CPP_OP, (grads, tensors, symints, key, slot)
        else:
            saved = self.to_proxy(list(deferred.saved))
            op, op_args = opaque.PY_OP, (grads, saved, symints, key, slot, deferred.hook)
        return self.fx_tracer.create_proxy("call_function", op, op_args, {})

    def _record(self, decision: Decision, hook: int = -1) -> None:
        """A node's decision, to the report (as it is) and the plugin's counters."""
        report.node(self._capture, decision, hook)
        for key, _, _, lifted in decision.saved if decision.kind == "C++" else ():
            if lifted is not None:
                self._owners[lifted] = f"{decision.name}'s saved '{key}'"
        ours = counters["ca_dynsaved"]
        if decision.handling == STOCK:
            ours["stock_nodes"] += 1
            return
        if decision.kind == "C++":
            for _, type_, _, lifted in decision.saved:
                what = "hashed_values" if lifted is None else "lifted_ints" if type_ == opaque.INT else "lifted_floats"
                ours[what] += 1
        if decision.handling == OPAQUE:
            ours["opaque_nodes"] += 1
        elif decision.kind == "Python":
            ours["traced_python_nodes"] += 1
        else:
            ours["traced_cpp_nodes"] += 1
            if isinstance(decision.plan, SentinelTrace):
                ours["sentinel_cpp_nodes"] += 1
                ours["optin_cpp_nodes"] += decision.plan.optin

    def _packed_scalar_proxies(self) -> tuple[Any, Any]:
        """The packed int64 and float64 tensors' nodes, read at the top of the graph:
        there the scalars list dies, so it is never live across a graph break, where
        Dynamo would rebuild it for the resume function with each number it does not
        treat as dynamic (an opaque node's) as a constant, guarded (a recompile when
        it changes; FSDP2's disabled hooks break every CA graph)."""
        if self._packed_proxies is None:
            n = len(self._scalar_kinds)
            graph = self.fx_tracer.graph
            with graph.inserting_after(_unpacked_inputs_end(graph)):
                ints = self.scalars_proxy[n]
            with graph.inserting_after(ints.node):
                floats = self.scalars_proxy[n + 1]
            self._packed_proxies = (ints, floats)
        return self._packed_proxies

    def create_graph_module(self, id: str) -> torch.fx.GraphModule:  # type: ignore[override]
        if self._traced_floats:
            floats = {scalar.index: symnode for symnode, scalar in self._lifted.items() if scalar.kind is opaque.FLOAT}
            cpptrace.rewrite_float_scalars(
                self.fx_tracer.graph,
                cpptrace.float_getitems(self.scalars_proxy.node, floats),
                lambda symnode: self._packed_value_node(symnode, False),
            )
        if self._tiers:
            self._specialised = torch.fx.GraphModule(self.fx_tracer.root, self._specialised_graph(), f"{id}Specialised")
            self._opaque_graph()
        if self._unpack_calls:
            self._unpack_ops(id)
        if self._checks:
            # The graph as it is, its verified nodes' inputs kept (runtime.keep_alive):
            # what a refused step's fallback graph is made from; the graph that runs
            # compiled has no keep_alive, nor what only it kept.
            base = torch.fx.Graph()
            env: dict[torch.fx.Node, torch.fx.Node] = {}
            base.output(base.graph_copy(self.fx_tracer.graph, env))
            self._fallback_base = torch.fx.GraphModule(self.fx_tracer.root, base, f"{id}Fallback")
            for check in self._checks:
                check.fallback = check.fallback.remapped(env)
            runtime.without_keep_alive(self.fx_tracer.graph)
            self.dce()
        for copy in (self._specialised, self._unpacks.stock_twin if self._unpacks else None):
            if copy is not None:
                runtime.without_keep_alive(copy.graph)
                copy.recompile()
        self._graph_module = super().create_graph_module(id)
        return self._graph_module

    def _unpack_ops(self, id: str) -> None:
        """Keep a copy of the graph as stock made it (the stock twin, for a run whose
        hooks are not all checkpoint's), then swap each checkpoint unpack's
        ``call_hook`` for the unpack op, reading its ``like`` from the scalars list
        after what the runtime wrapper puts there (the lifted scalars, then the packed
        tensors and derived ints where there are): at the graph's head, as the packed
        tensors (see _packed_scalar_proxies)."""
        graph = self.fx_tracer.graph
        twin = torch.fx.Graph()
        twin.output(twin.graph_copy(graph, {}))
        base = len(self._scalar_kinds)
        if self._packed_proxies is not None:
            base += 2 + self._derived[0]
        head = _unpacked_inputs_end(graph)
        slots = []
        for node, hook, data in self._unpack_calls:
            if node._erased or not node.users:  # CA's dead-code pass took it
                continue
            slot = len(slots)
            slots.append((hook, data))
            with graph.inserting_after(head):
                like = graph.call_function(operator.getitem, (self.scalars_proxy.node, base + slot))
            with graph.inserting_before(node):
                op = graph.call_function(checkpoint.UNPACK_OP, (like, hook, data, slot))
            op.meta.update(node.meta)
            node.replace_all_uses_with(op)
            inputs = node.all_input_nodes
            graph.erase_node(node)
            for read in inputs:  # hooks[i], packed_data[j]: Dynamo need not see them
                if not read.users and read.op != "placeholder":
                    graph.erase_node(read)
        if slots:
            runtime.after_inputs(graph)
            stock = torch.fx.GraphModule(self.fx_tracer.root, twin, f"{id}Stock")
            self._unpacks = checkpoint.Unpacks(slots, stock)
            self._capture.unpacks = len(slots)

    def _specialised_graph(self) -> torch.fx.Graph:
        """A copy of the capture's graph with its tiered nodes traced: their opaque
        ops dropped."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        graph.output(graph.graph_copy(self.fx_tracer.graph, env))
        for tier in self._tiers:
            graph.erase_node(env[tier.keep])
            graph.erase_node(env[tier.op])
        return graph

    def _opaque_graph(self) -> None:
        """The capture's graph, in place, with its tiered nodes opaque: each op's
        outputs take the traced ones' users; the trace (whose in-place ops no
        dead-code pass removes) and CA's validation of it go, then CA's dead-code
        pass takes what only they read; a user that CA's reordering had pulled up
        to right after a traced output moves after the op."""
        graph = self.fx_tracer.graph
        alive = set(graph.nodes)  # CA's dead-code pass may have erased some already

        def erase(node: torch.fx.Node) -> None:
            graph.erase_node(node)
            alive.discard(node)

        for tier in self._tiers:
            erase(tier.keep)
            after = tier.op
            validation = set()
            for i, validated in enumerate(tier.validated):
                if validated not in alive:
                    continue
                with graph.inserting_after(after):
                    after = graph.call_function(operator.getitem, (tier.op, i))
                validated.replace_all_uses_with(after)
                validation.add(validated.args[0])
                erase(validated)
            for node in [*validation, *reversed(tier.traced)]:
                if node in alive and not node.users:
                    erase(node)
        runtime.after_inputs(graph)  # before the dead-code pass, whose lint checks the order
        self.dce()

    def _packed_value_node(self, symnode: Any, as_float: bool) -> torch.fx.Node:
        """A 0-dim tensor node of the lifted scalar ``symnode``'s packed value (an int
        cast to float64 when ``as_float``), placed right after the packed tensors'
        nodes; one per (scalar, as_float)."""
        selects = self._selects
        found = selects.get((symnode, as_float))
        if found is not None:
            return found
        scalar = self._lifted[symnode]
        graph = self.fx_tracer.graph
        packed = self._packed_scalar_proxies()[0 if scalar.kind is opaque.INT else 1].node
        with graph.inserting_after(packed):
            node = graph.call_function(torch.ops.aten.select.int, (packed, 0, scalar.slot))
        if as_float:
            with graph.inserting_after(node):
                node = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float64})
        selects[(symnode, as_float)] = node
        return node

    @_disable
    def end_capture(self, outputs):  # type: ignore[no-untyped-def,override]
        runtime_wrapper, compiled_fn = super().end_capture(outputs)
        runtime_wrapper = runtime.running_final_callbacks(sizes_made_once(runtime_wrapper), self._capture)
        if log.isEnabledFor(logging.INFO):
            for node in self._capture.nodes:
                what = f"{node.handling} ({node.reason})" if node.reason else node.handling
                keys = ", ".join(f"{k}: {t}" for k, t in zip(node.keys, node.kinds))
                log.info("capture !%d: %s %s; saved %s", self.id, node.name, what, keys or "nothing")
            log.debug("capture !%d graph:\n%s", self.id, self._graph_module.code)
        # Before Dynamo's first compile of the graph, which its first call makes.
        mark_dynamic_scalars(self._graph_module.forward.__code__, self._dynamic_sources)
        # The combinations past the cap run the capture's opaque graph, whose compile
        # is then one of the cap's (runtime.Combinations), or the graph uncompiled.
        shared = bool(self._guarded) and not self._guarded_untiered
        combinations = runtime.Combinations(self._guarded, self._capture, shared) if self._guarded else None
        if not self._nodes and not self._capture.observes and not self._checks and self._unpacks is None and not combinations:
            return runtime_wrapper, compiled_fn
        if self._unpacks is not None:
            self._unpacks.stock_twin.meta.update(self._graph_module.meta)  # CA's locals to steal
        packer = None
        if self._packed_proxies is not None or self._opaque_reads_scalars:
            packer = runtime.Packer(self._scalar_kinds, tensors=self._packed_proxies is not None, owners=self._owners)
        derived = (self._derived[0], self._derived[1])
        common = (packer, self._nodes, self._capture, self.compiler_fn, tuple(self._dynamic_sources))
        way = runtime.tier_way([t.way for t in self._tiers])
        hold = runtime.Hold(way == runtime.HELD) if self._tiers else None
        wrapper = runtime.make_runtime_wrapper(
            runtime_wrapper, self._graph_module, *common, tuple(self._checks), derived, hold=hold,
            unpacks=self._unpacks, fallback_base=self._fallback_base,
            combinations=None if shared else combinations,  # shared: the guarded nodes are opaque there
        )
        if self._tiers:
            special = self._specialised
            assert special is not None
            special.meta.update(self._graph_module.meta)  # CA's locals to steal
            checks = (*self._checks, *(t.check for t in self._tiers if t.check is not None))

            def specialised(refused: Callable[..., Any]) -> Callable[..., Any]:
                return runtime.make_runtime_wrapper(
                    runtime_wrapper, special, *common, checks, derived, refused=refused, combinations=combinations
                )

            functions = tuple(dict.fromkeys(t.function for t in self._tiers))  # each once
            wrapper = runtime.tiered(
                wrapper, hold, specialised, special, self.compiler_fn, functions, self._capture, way
            )
        return wrapper, compiled_fn
