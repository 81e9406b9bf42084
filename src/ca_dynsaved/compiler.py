"""Capture-time hooks: the AutogradCompilerInstance subclass.

C++ calls ``begin_capture``, ``bind_function``, ``apply_functional``,
``proxy_call_backward``, ``validate_outputs`` and ``end_capture`` on the instance
by name, so overriding them is enough to change how custom functions enter the CA
graph:

* ``begin_capture`` remembers which symbolic scalars are lifted ``saved_data``
  values (the ``scalars`` placeholder);
* ``apply_functional`` (a C++ custom function) and ``proxy_call_backward`` (a
  Python one) record the call instead of tracing it; ``validate_outputs``, which
  C++ calls right after with the symbolic output sizes, emits one opaque op that
  runs the backward and validates its outputs (``opaque.py``);
* ``end_capture`` wraps the runtime wrapper (``runtime.py``) so it packs the lifted
  scalars into two tensors the C++ ops read and binds the hooks the Python ops
  read; the graph no longer uses the Python scalars, so Dynamo guards none.

A node the ops cannot express keeps stock tracing; the report says why. Every
override is excluded from Dynamo: capture runs inside ``.backward()``, which may
run inside a compiled frame (DESIGN-NOTES pitfall 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from . import _compat, cpptrace, opaque, pyctx, report, runtime, sentinel

_disable = torch.compiler.disable
#: TORCH_LOGS="ca_dynsaved" shows what the plugin did with each capture; "+ca_dynsaved"
#: adds the captured graph.
log = logging.getLogger("ca_dynsaved")


@dataclass
class _PendingCall:
    """A custom-function call waiting for validate_outputs' symbolic metadata."""

    name: str
    grads: list[Any]
    dummies: list[torch.Tensor | None]  # what C++ got back as the call's outputs
    emit_stock: Callable[[], Sequence[Any]]  # trace it as stock CA does instead
    fn: Callable[..., Any] | None = None  # C++: the functional; Python: None
    call: _compat.CppCall | None = None  # C++: its call arguments
    inputs: tuple[int, ...] = ()  # Python: positions of the tensor inputs
    hook: int = -1  # Python: index of the ctx in CA's hooks
    saved: tuple[Any, ...] = ()  # Python: saved tensors
    ctx: Any = None  # Python: the real ctx, for the report
    reason: str = ""  # Python: why it runs opaque (python_policy="auto")


_EXCLUDED = "excluded by enable(exclude=...)"


class _Unsupported(Exception):
    """This node cannot be made opaque; it keeps stock behaviour."""


@dataclass(frozen=True)
class _Captured:
    """Stands, while flattening, for the capture's ``index``-th hashed saved value."""

    index: int


def _is_hashed_constant(value: Any) -> bool:
    return not any(
        isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))
        for leaf in _compat.pytree.tree_leaves(value)
    )


class DynSavedCompilerInstance(_compat.StockCompilerInstance):
    """A CA capture that runs custom-function backwards through opaque ops.

    ``exclude``: substrings of node names (``"MyFunction"``) that keep stock
    behaviour; ``python_policy``: see ``pyctx``; ``trace_cpp``: substrings of names
    of C++ functions whose ``toInt()``/``toDouble()`` reads may be traced
    (``sentinel``); ``verify``: check each new value of those before use.
    """

    def __init__(
        self,
        compiler_fn: Callable[..., Any],
        exclude: frozenset[str] = frozenset(),
        python_policy: str = pyctx.AUTO,
        trace_cpp: frozenset[str] = frozenset(),
        verify: bool = True,
    ) -> None:
        super().__init__(compiler_fn)
        self.exclude = exclude
        self.python_policy = pyctx.check_policy(python_policy)
        self.trace_cpp = trace_cpp
        self.verify = verify

    @_disable
    def begin_capture(self, inputs, sizes, scalars, origins, accumulate_grad, check_nans):  # type: ignore[no-untyped-def,override]
        values = list(scalars)  # super() swaps them for symbols in place
        out = super().begin_capture(inputs, sizes, scalars, origins, accumulate_grad, check_nans)
        # symnode of each lifted scalar -> (kind, index among lifted scalars of that kind)
        self._lifted: dict[Any, tuple[str, int]] = {}
        # symnode -> (index among all lifted scalars, value at capture), for the report
        self._lifted_at: dict[Any, tuple[int, Any]] = {}
        self._scalar_kinds: list[str] = []
        for index, sym in enumerate(out[3]):
            kind = opaque.INT if isinstance(sym, torch.SymInt) else opaque.FLOAT
            self._lifted[sym.node] = (kind, self._scalar_kinds.count(kind))
            self._lifted_at[sym.node] = (index, values[index])
            self._scalar_kinds.append(kind)
        self._packed_proxies: tuple[Any, Any] | None = None
        self._custom_fns: dict[str, Callable[..., Any]] = {}
        self._traceable: set[str] = set()  # custom functions declaring is_traceable
        self._pending: _PendingCall | None = None
        self._capture = report.begin_capture(self.id)
        self._nodes: list[opaque.NodeCapture] = []  # per opaque op, in slot order
        self._dynamic_sources: list[str] = []  # numbers of traced nodes, as Dynamo names them
        self._traced_floats = False  # a traced C++ node reads a lifted float
        self._opaque_reads_scalars = False  # an opaque C++ node has a lifted number
        # Opted-in traced C++ nodes: (graph nodes their trace recorded, saved key ->
        # kind, saved key -> its symbol), rewritten in create_graph_module.
        self._optin: list[tuple[list[torch.fx.Node], dict[str, str], dict[str, Any]]] = []
        self._verifying: tuple[Any, ...] | None = None  # an opted-in node awaiting validate_outputs
        self._checks: list[runtime.Check] = []  # verify: one per opted-in node
        return out

    @_disable
    def allocate_dummy_like(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Stock calls this once, for the gradient its capture assigns to a leaf
        # (accumulate_grad), in the leaf's dtype; a leaf whose gradient has another
        # dtype (``Tensor.grad_dtype``: torch 2.15's FSDP2 mixed precision gives bf16
        # unsharded parameters fp32 gradients) refuses it. In the gradient's dtype.
        with _compat.no_proxy_modes():
            return torch.empty_like(x, dtype=_compat.grad_dtype(x))

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
            return super(DynSavedCompilerInstance, self).apply_functional(
                fn_name, grads, args, output_metadata
            )

        if fn_name not in self._custom_fns:
            return stock()
        name = _compat.cpp_node_name(args)
        try:
            call = _compat.CppCall.parse(args)  # the one parse of CA's layout
        except _compat.LayoutError as e:
            self._report_cpp(name, report.STOCK, str(e), None)
            return stock()
        if self._excluded(name):
            self._report_cpp(name, report.STOCK, _EXCLUDED, call)
            return stock()
        fn = self._custom_fns[fn_name]
        if fn_name not in self._traceable:
            verdict = cpptrace.Verdict(False, "not is_traceable: its backward is not traced")
        else:
            verdict = cpptrace.verdict(fn, call, self._lifted)
        if verdict.traced:
            sizes = cpptrace.size_dependence(fn, call)
            if not sizes:
                return self._trace_cpp(fn, grads, call, verdict.reason)
            verdict = cpptrace.Verdict(False, sizes)
        elif fn_name in self._traceable and any(p in name for p in self.trace_cpp):
            optin = self._optin_plan(fn, call)
            if optin is not None:
                plan, inputs = optin
                sizes = cpptrace.size_dependence(fn, call) if plan.traced else ""
                if plan.traced and not sizes:
                    return self._trace_optin(fn, grads, call, plan, inputs)
                if sizes:
                    sentinel.refused(name, sizes)
                verdict = cpptrace.Verdict(False, f"trace_cpp refused: {sizes or plan.reason}")
        with _compat.disable_proxy_modes_tracing():
            dummies = [self.allocate_dummy() for _ in output_metadata]
        self._pending = _PendingCall(
            name=name,
            grads=list(grads),
            dummies=dummies,
            emit_stock=stock,
            fn=fn,
            call=call,
            reason=verdict.reason,
        )
        return dummies

    def _trace_cpp(self, fn: Callable[..., Any], grads: Any, call: _compat.CppCall, reason: str) -> list[Any]:
        """Record the C++ backward's ATen ops (see cpptrace); its lifted ints become
        dynamic graph inputs, its floats are read from the packed float64 tensor."""
        self._report_cpp(call.name, report.TRACED, reason, call)
        _compat.counters["ca_dynsaved"]["traced_cpp_nodes"] += 1
        for value in call.values:
            index, _ = self._lifted_at[value.node]
            # Dynamic from the first compile: an int, and a double that reaches an op
            # the backend tensorifies (one the rewrite feeds from the packed tensor is
            # never read by Dynamo at all).
            self._dynamic_sources.append(f"L['scalars'][{index}]")
            self._traced_floats |= self._lifted[value.node][0] is opaque.FLOAT
        if self._traced_floats:
            self._packed_scalar_proxies()  # the packed tensors' nodes, before the ops
        return cpptrace.trace(self, fn, grads, call)

    def _optin_plan(self, fn: Callable[..., Any], call: _compat.CppCall) -> tuple[sentinel.Plan, sentinel.Inputs] | None:
        """The sentinel plan of an opted-in node, or None when some saved value is
        not a lifted number (a hashed value keeps it opaque: see cpptrace)."""
        try:
            kinds = {key: self._lifted[value.node][0] for key, value in zip(call.keys, call.values)}
        except (AttributeError, KeyError):
            return None
        if not kinds:
            return None
        inputs = sentinel.Inputs.of(fn, call)
        return sentinel.plan(call.name, inputs, kinds), inputs

    def _trace_optin(
        self, fn: Callable[..., Any], grads: Any, call: _compat.CppCall, plan: sentinel.Plan, inputs: sentinel.Inputs
    ) -> list[Any]:
        """Trace an opted-in plain reader with the sentinels in place of its saved
        numbers; create_graph_module swaps them for the lifted values."""
        checked = "; each new value verified" if self.verify else ""
        self._report_cpp(call.name, report.TRACED, f"opt-in (trace_cpp): {plan.reason}{checked}", call)
        counters = _compat.counters["ca_dynsaved"]
        counters["traced_cpp_nodes"] += 1
        counters["optin_cpp_nodes"] += 1
        for value in call.values:
            self._dynamic_sources.append(f"L['scalars'][{self._lifted_at[value.node][0]}]")
        self._packed_scalar_proxies()  # the packed tensors' nodes, before the ops
        graph = self.fx_tracer.graph
        before = len(graph.nodes)
        sentinels = sentinel.values(plan.kinds, 0)
        outs = cpptrace.trace(self, fn, grads, call, values=[sentinels[k] for k in call.keys])
        region = list(graph.nodes)[before:]
        self._optin.append((region, plan.kinds, dict(zip(call.keys, call.values))))
        if self.verify:
            self._verifying = (fn, grads, call, plan, inputs, region)
        return outs

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

        if hasattr(ctx._forward_cls, "_aot_id"):
            return stock()  # torch's own compiled backward, not a user function
        name = ctx._forward_cls.__name__
        if self._excluded(name):
            handling, reason = pyctx.STOCK, _EXCLUDED
        else:
            handling, reason = pyctx.decide(
                ctx, self.python_policy, maybe_backward_state_idx, opaque_object_indices,
                saved_tensors, tuple(m is not None for m in output_metadatas),
            )
        if handling != pyctx.OPAQUE:
            report.python_node(self._capture, name, handling, reason, ctx, backward_idx)
            if handling == pyctx.TRACED:
                # Stock tracing, with the ctx numbers dynamic from the first compile.
                self._dynamic_sources.extend(pyctx.dynamic_sources(ctx, backward_idx))
                _compat.counters["ca_dynsaved"]["traced_python_nodes"] += 1
            else:
                _compat.counters["ca_dynsaved"]["stock_nodes"] += 1
            return stock()
        # One metadata per forward input, None where the input was not a tensor;
        # C++ keeps the backward's outputs at the tensor positions only.
        with _compat.disable_proxy_modes_tracing():
            dummies = [None if m is None else self.allocate_dummy() for m in output_metadatas]
        self._pending = _PendingCall(
            name=name,
            grads=list(inputs),
            dummies=dummies,
            emit_stock=stock,
            inputs=tuple(i for i, m in enumerate(output_metadatas) if m is not None),
            hook=backward_idx,
            saved=tuple(saved_tensors),
            ctx=ctx,
            reason=reason,
        )
        return tuple(dummies)

    @_disable
    def validate_outputs(self, _, outputs, args, output_metadata):  # type: ignore[no-untyped-def,override]
        pending, self._pending = self._pending, None
        if pending is None:
            if self._verifying is not None:
                self._add_check(outputs)
            return super().validate_outputs(_, outputs, args, output_metadata)
        expected = [d for d in pending.dummies if d is not None]
        if len(outputs) != len(expected) or any(o is not d for o, d in zip(outputs, expected)):
            raise RuntimeError(
                f"ca_dynsaved: validate_outputs after {pending.name} got other tensors "
                "than its outputs; this torch's CA capture order is not supported"
            )
        try:
            proxy_out = self._emit_opaque(pending, args[0])
        except _Unsupported as e:
            if pending.call is not None:
                self._report_cpp(pending.name, report.STOCK, str(e), pending.call)
            else:
                report.python_node(self._capture, pending.name, pyctx.STOCK, str(e), pending.ctx, pending.hook)
                _compat.counters["ca_dynsaved"]["stock_nodes"] += 1
            traced = [t for t in pending.emit_stock() if t is not None]
            self.bind_objects_to_proxies(outputs, [self.to_proxy(t) for t in traced])
            return super().validate_outputs(_, outputs, args, output_metadata)
        self.bind_objects_to_proxies(outputs, [proxy_out[i] for i in range(len(outputs))])
        return outputs

    def _emit_opaque(self, pending: _PendingCall, meta: Any) -> Any:
        """Put one opaque op for ``pending`` in the graph; return its output proxy."""
        call_args: tuple[Any, ...] = (pending.inputs,)
        captured: list[Any] = []
        if pending.call is not None:
            # A saved value CA hashed (bool, str, None, a list or dict of them) is a
            # value of this capture, not structure: it reaches the op at run time.
            slots = []
            for value in pending.call.values:
                if _is_hashed_constant(value):
                    slots.append(_Captured(len(captured)))
                    captured.append(value)
                else:
                    slots.append(value)
            call_args = pending.call.args(values=slots)
        leaves, treedef = _compat.pytree.tree_flatten((call_args, meta))
        specs: list[tuple[str, Any]] = []
        tensors: list[Any] = []
        symints: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, _Captured):
                specs.append((opaque.CAPTURED, leaf.index))
            elif isinstance(leaf, torch.Tensor):
                specs.append((opaque.TENSOR, len(tensors)))
                tensors.append(self.to_proxy(leaf))
            elif isinstance(leaf, (torch.SymInt, torch.SymFloat)):
                lifted = self._lifted.get(leaf.node)
                if lifted is not None:
                    specs.append(lifted)
                elif isinstance(leaf, torch.SymInt):
                    specs.append((opaque.SYMINT, len(symints)))
                    symints.append(self.to_proxy(leaf))
                else:
                    raise _Unsupported(f"a symbolic {type(leaf).__name__} that is not a lifted saved value")
            elif isinstance(leaf, torch.SymBool):
                raise _Unsupported("a symbolic bool")
            else:
                specs.append((opaque.CONST, leaf))
        out_defined = tuple(m is not None for m in meta)  # None: invalid next edge
        key = opaque.register(opaque.NodeSpec(pending.name, treedef, tuple(specs), out_defined))
        slot = len(self._nodes)
        self._nodes.append(opaque.NodeCapture(pending.fn, tuple(captured)))
        counters = _compat.counters["ca_dynsaved"]
        grads = self.to_proxy(pending.grads)
        if pending.call is not None:
            self._report_cpp(pending.name, report.OPAQUE, pending.reason, pending.call)
            # Its lifted numbers reach the op through the run (opaque.bound_run).
            self._opaque_reads_scalars |= any(kind in (opaque.INT, opaque.FLOAT) for kind, _ in specs)
            op_args = (grads, tensors, symints, key, slot)
            op = opaque.CPP_OP
        else:
            report.python_node(self._capture, pending.name, pyctx.OPAQUE, pending.reason, pending.ctx, pending.hook)
            op_args = (grads, self.to_proxy(list(pending.saved)), symints, key, slot, pending.hook)
            op = opaque.PY_OP
        counters["opaque_nodes"] += 1
        return self.fx_tracer.create_proxy("call_function", op, op_args, {})

    def _add_check(self, outputs: Sequence[Any]) -> None:
        """verify: what running the opted-in node just traced directly takes, for the
        steps whose new values its check refuses (runtime.Check)."""
        fn, grads, call, plan, inputs, region = self._verifying  # type: ignore[misc]
        self._verifying = None

        def node(t: Any) -> torch.fx.Node | None:
            return None if t is None else self.to_proxy(t).node

        fallback = runtime.Fallback(
            fn,
            call.detached(),
            tuple(self._lifted[v.node] for v in call.values),
            [node(g) for g in grads],
            [node(t) for t in call.saved],
            [p.node for p in self._packed_scalar_proxies()],
            region,
            [node(o) for o in outputs],
        )
        indices = tuple(self._lifted_at[v.node][0] for v in call.values)
        self._checks.append(runtime.Check(call.name, plan, inputs, call.keys, indices, fallback))

    def _packed_scalar_proxies(self) -> tuple[Any, Any]:
        if self._packed_proxies is None:
            n = len(self._scalar_kinds)
            self._packed_proxies = (self.scalars_proxy[n], self.scalars_proxy[n + 1])
        return self._packed_proxies

    def _excluded(self, name: str) -> bool:
        return any(pattern in name for pattern in self.exclude)

    def _report_cpp(self, name: str, handling: str, reason: str, call: _compat.CppCall | None) -> None:
        """Describe a C++ node to the report: ``handling`` (opaque, traced or stock)
        and why; ``call`` None when its arguments could not be parsed."""
        saved = {}
        for key, value in zip(call.keys, call.values) if call is not None else ():
            if _is_symbolic(value) and value.node in self._lifted_at:
                index, concrete = self._lifted_at[value.node]
                saved[key] = (self._lifted[value.node][0], concrete, index)
            elif _is_hashed_constant(value):
                saved[key] = (type(value).__name__, value, None)
        report.cpp_node(self._capture, name, handling, reason, saved)
        counters = _compat.counters["ca_dynsaved"]
        if handling == report.STOCK:
            counters["stock_nodes"] += 1
            return
        for type_, _, lifted in saved.values():
            if lifted is not None:
                counters["lifted_ints" if type_ == opaque.INT else "lifted_floats"] += 1
            else:
                counters["hashed_values"] += 1

    def create_graph_module(self, id: str) -> torch.fx.GraphModule:  # type: ignore[override]
        selects: dict[tuple[Any, bool], torch.fx.Node] = {}
        for region, kinds, symbols in self._optin:
            sentinel.rewrite(
                region,
                kinds,
                lambda slot, s=symbols: self._packed_value_node(s[slot.key].node, slot.as_float, selects),
                lambda slot, s=symbols: self.to_proxy(s[slot.key]).node,
            )
        if self._traced_floats:
            floats = {
                index: symnode
                for symnode, (index, _) in self._lifted_at.items()
                if self._lifted[symnode][0] is opaque.FLOAT
            }
            cpptrace.rewrite_float_scalars(
                self.fx_tracer.graph,
                cpptrace.float_getitems(self.scalars_proxy.node, floats),
                lambda symnode: self._packed_value_node(symnode, False, selects),
            )
        self._graph_module = super().create_graph_module(id)
        return self._graph_module

    def _packed_value_node(self, symnode: Any, as_float: bool, selects: dict[tuple[Any, bool], torch.fx.Node]) -> torch.fx.Node:
        """A 0-dim tensor node of the lifted scalar ``symnode``'s packed value (an int
        cast to float64 when ``as_float``), placed right after the packed tensors'
        nodes; one per (scalar, as_float) in ``selects``."""
        found = selects.get((symnode, as_float))
        if found is not None:
            return found
        kind, index = self._lifted[symnode]
        graph = self.fx_tracer.graph
        packed = self._packed_scalar_proxies()[0 if kind is opaque.INT else 1].node
        with graph.inserting_after(packed):
            node = graph.call_function(torch.ops.aten.select.int, (packed, 0, index))
        if as_float:
            with graph.inserting_after(node):
                node = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float64})
        selects[(symnode, as_float)] = node
        return node

    @_disable
    def end_capture(self, outputs):  # type: ignore[no-untyped-def,override]
        runtime_wrapper, compiled_fn = super().end_capture(outputs)
        runtime_wrapper = runtime.running_final_callbacks(_compat.sizes_made_once(runtime_wrapper), self._capture)
        if log.isEnabledFor(logging.INFO):
            for node in self._capture.nodes:
                what = f"{node.handling} ({node.reason})" if node.reason else node.handling
                keys = ", ".join(f"{k}: {t}" for k, t in zip(node.keys, node.kinds))
                log.info("capture !%d: %s %s; saved %s", self.id, node.name, what, keys or "nothing")
            log.debug("capture !%d graph:\n%s", self.id, self._graph_module.code)
        # Before Dynamo's first compile of the graph, which its first call makes.
        _compat.mark_dynamic_scalars(self._graph_module.forward.__code__, self._dynamic_sources)
        if not self._nodes and not self._capture.observes and not self._checks:
            return runtime_wrapper, compiled_fn
        packer = None
        if self._packed_proxies is not None or self._opaque_reads_scalars:
            packer = runtime.Packer(self._scalar_kinds, tensors=self._packed_proxies is not None)
        wrapper = runtime.make_runtime_wrapper(
            runtime_wrapper, self._graph_module, packer, self._nodes, self._capture,
            self.compiler_fn, tuple(self._dynamic_sources), tuple(self._checks),
        )
        return wrapper, compiled_fn


def _is_symbolic(value: Any) -> bool:
    return isinstance(value, (torch.SymInt, torch.SymFloat))
