"""Capture-time hooks: the AutogradCompilerInstance subclass that hands each
custom-function node to the way it runs.

C++ calls ``begin_capture``, ``bind_function``, ``apply_functional``,
``proxy_call_backward``, ``validate_outputs`` and ``end_capture`` on the instance
by name, so overriding them (each ``@override``: a hook torch renames fails
``tests/test_compat.py``) changes how custom functions enter the CA graph.
``decision.py`` decides each node (traced, opaque or stock, and why); this module
only dispatches it to the module of its way, which holds what it emits into the
graph at capture and what it binds each run:

==========================  ==========================================================
``ways/traced.py``          a C++ node traced (``CppTrace``; ``SentinelTrace`` through
                            ``ways/sentinel_traced.py``, verified by ``ways/verify.py``)
``ways/python_traced.py``   a Python node stock traces, its ctx numbers dynamic
``ways/opaque_op.py``       one opaque op (emitted at ``validate_outputs``, which gives
                            the outputs' symbolic metadata)
``ways/tiered.py``          both of these, the runtime choosing between two graphs
``ways/checkpointed.py``    checkpoint unpacks as ops, as the graph is made
stock                       CA's own hook, unchanged
==========================  ==========================================================

The capture's state is one ``state.Capture``; ``end_capture`` hands the runtime one
``runtime.RunSpec``. The graph never hands a Python number to an op, so Dynamo
guards none. Every override is excluded from Dynamo: capture runs inside
``.backward()``, which may run inside a compiled frame (DESIGN-NOTES pitfall 1).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from typing_extensions import override

from ._compat.capture import StockCompilerInstance, grad_dtype, no_proxy_modes
from ._compat.dynamic_state import mark_dynamic_scalars
from ._compat.runtime_wrapper import sizes_made_once
from . import report, sentinel
from .decision import OPAQUE, CppTrace, Options, PythonTrace, SentinelTrace, Tiered, decide_cpp, decide_python, opaque_cpp
from .runtime import RunSpec, make_runtime_wrapper, running_final_callbacks
from .scalars import Packer
from .state import Capture, Deferred
from .ways import checkpointed, opaque_op, python_traced, sentinel_traced, tiered, traced

_disable = torch.compiler.disable


class DynSavedCompilerInstance(StockCompilerInstance):
    """A CA capture that handles custom-function nodes as ``decision.py`` decides,
    with the user's ``options`` (``decision.Options``: exclude, python_policy,
    trace_cpp, verify)."""

    def __init__(self, compiler_fn: Callable[..., Any], options: Options = Options()) -> None:
        super().__init__(compiler_fn)
        self.options = options

    @override
    @_disable
    def begin_capture(self, inputs, sizes, scalars, origins, accumulate_grad, check_nans):  # type: ignore[no-untyped-def,override]
        values = list(scalars)  # super() swaps them for symbols in place
        out = super().begin_capture(inputs, sizes, scalars, origins, accumulate_grad, check_nans)
        self._cap = Capture.begin(self, self.options, values, out[3])
        return out

    @override
    @_disable
    def allocate_dummy_like(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Stock calls this once, for the gradient its capture assigns to a leaf
        # (accumulate_grad), in the leaf's dtype; a leaf whose gradient has another
        # dtype (``Tensor.grad_dtype``: torch 2.15's FSDP2 mixed precision gives bf16
        # unsharded parameters fp32 gradients) refuses it. In the gradient's dtype.
        with no_proxy_modes():
            return torch.empty_like(x, dtype=grad_dtype(x))

    @override
    @_disable
    def unpack_hook(self, hook_id: int, data_id: int) -> torch.Tensor:  # type: ignore[override]
        # Stock's call_hook node, which create_graph_module swaps for the unpack op
        # (ways/checkpointed.py) and keeps in the stock twin: which hook it is, CA
        # tells only the run.
        out = super().unpack_hook(hook_id, data_id)
        self._cap.unpack_calls.append((self.to_proxy(out).node, hook_id, data_id))
        return out

    @override
    @_disable
    def bind_function(self, fn_name, fn, is_custom_function, is_traceable):  # type: ignore[no-untyped-def,override]
        name = super().bind_function(fn_name, fn, is_custom_function, is_traceable)
        if is_custom_function:
            self._cap.custom_fns[name] = fn
            if is_traceable:
                self._cap.traceable.add(name)
        return name

    @override
    @_disable
    def apply_functional(self, fn_name, grads, args, output_metadata):  # type: ignore[no-untyped-def,override]
        def stock() -> Sequence[Any]:
            return super(DynSavedCompilerInstance, self).apply_functional(fn_name, grads, args, output_metadata)

        cap = self._cap
        fn = cap.custom_fns.get(fn_name)
        if fn is None:
            return stock()
        undefined = tuple(g is None for g in grads)
        decision, call = decide_cpp(args, fn, fn_name in cap.traceable, self.options, cap.lifted, undefined, self.id)
        plan = decision.plan
        if isinstance(plan, Tiered) and plan.traced is None:  # no saved numbers: stock's trace is its own graph's
            out = cap.traced_region(stock)
            tiered.also_opaque(cap, decision, grads, fn=fn, call=call)
            return out
        if isinstance(plan, (CppTrace, SentinelTrace, Tiered)):
            assert call is not None
            inner = plan.traced if isinstance(plan, Tiered) else plan
            outs = traced.trace_cpp(cap, fn, grads, call, inner, undefined)  # type: ignore[arg-type]
            if not isinstance(outs, str):
                if isinstance(plan, Tiered):
                    tiered.also_opaque(cap, decision, grads, fn=fn, call=call)
                else:
                    cap.record_node(decision)
                return outs
            if isinstance(inner, SentinelTrace) and inner.optin:  # the differential check refused the trace
                sentinel.refused(call.name, outs)
            decision = opaque_cpp(decision, call, f"{decision.reason}; but {outs}")
        if decision.handling == OPAQUE:
            return opaque_op.defer(cap, decision, grads, output_metadata, stock, fn=fn, call=call)
        cap.record_node(decision)
        return stock()

    @override
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
        cap, plan = self._cap, decision.plan
        if isinstance(plan, Tiered):
            # stock's call (its pieces' graph, or its trace with the numbers dynamic);
            # its opaque op too, emitted at its validation
            if plan.guarded is not None:
                python_traced.trace_python(cap, plan.guarded, backward_idx, decision.name, saved_tensors, output_metadatas, ctx)
            out = cap.traced_region(stock)
            tiered.also_opaque(cap, decision, inputs, hook=backward_idx, saved=saved_tensors)
            return out
        if decision.handling != OPAQUE:
            cap.record_node(decision, backward_idx)
            if isinstance(plan, PythonTrace):
                python_traced.trace_python(cap, plan, backward_idx, decision.name, saved_tensors, output_metadatas, ctx)
            return stock()
        return tuple(opaque_op.defer(cap, decision, inputs, output_metadatas, stock, hook=backward_idx, saved=saved_tensors))

    @override
    @_disable
    def validate_outputs(self, _, outputs, args, output_metadata):  # type: ignore[no-untyped-def,override]
        def stock() -> Any:
            return super(DynSavedCompilerInstance, self).validate_outputs(_, outputs, args, output_metadata)

        cap = self._cap
        pending, cap.pending = cap.pending, None
        if isinstance(pending, Deferred):
            return opaque_op.validated(cap, pending, outputs, args[0], stock)
        last = next(iter(reversed(self.fx_tracer.graph.nodes)))
        out = stock()
        if pending is not None and pending.fallback is not None:  # the first node stock's validation made
            pending.fallback.validate = last.next
        if pending is not None and pending.tier is not None:
            tiered.validated(cap, pending.tier, outputs, args[0])
        return out

    @override
    def create_graph_module(self, id: str) -> torch.fx.GraphModule:  # type: ignore[override]
        cap = self._cap
        traced.rewrite_floats(cap)
        if cap.tiers:
            cap.specialised = tiered.graphs(cap, id)
        if cap.unpack_calls:
            cap.unpacks = checkpointed.unpack_ops(cap, id)
        if cap.checks:
            cap.fallback_base = sentinel_traced.fallback_base(cap, id)
        for copy in (cap.specialised, cap.unpacks.stock_twin if cap.unpacks else None):
            if copy is not None:
                sentinel_traced.without_keep_alive(copy.graph)
                copy.recompile()
        self._graph_module = super().create_graph_module(id)
        return self._graph_module

    @override
    @_disable
    def end_capture(self, outputs):  # type: ignore[no-untyped-def,override]
        runtime_wrapper, compiled_fn = super().end_capture(outputs)
        # The capture's state ends here: CA's cache may keep this instance as long as
        # the graph, and the runs need only what the RunSpec below takes from it.
        cap, graph_module, self._cap = self._cap, self._graph_module, None
        runtime_wrapper = running_final_callbacks(sizes_made_once(runtime_wrapper), cap.record)
        report.log_capture(cap.record, graph_module)
        # Before Dynamo's first compile of the graph, which its first call makes.
        mark_dynamic_scalars(graph_module.forward.__code__, cap.dynamic_sources)
        # The combinations past the cap run the capture's opaque graph, whose compile
        # is then one of the cap's (python_traced.Combinations), or the graph uncompiled.
        shared = bool(cap.guarded) and not cap.guarded_untiered
        combinations = python_traced.Combinations(cap.guarded, cap.record, shared) if cap.guarded else None
        if not cap.nodes and not cap.record.observes and not cap.checks and cap.unpacks is None and not combinations:
            return runtime_wrapper, compiled_fn
        if cap.unpacks is not None:
            cap.unpacks.stock_twin.meta.update(graph_module.meta)  # CA's locals to steal
        packer = None
        if cap.packed is not None or cap.opaque_reads_scalars:
            packer = Packer(cap.layout.kinds, tensors=cap.packed is not None, owners=cap.owners)
        spec = RunSpec(
            runtime_wrapper, cap.record, self.compiler_fn, cap.nodes, packer, tuple(cap.dynamic_sources),
            (cap.layout.derived_ints, cap.layout.derived_floats), cap.unpacks, cap.fallback_base,
        )
        way = tiered.tier_way([t.way for t in cap.tiers])
        hold = tiered.Hold(way == tiered.HELD) if cap.tiers else None
        checks = tuple(cap.checks)
        # shared: the guarded nodes are opaque in this graph
        wrapper = make_runtime_wrapper(spec, graph_module, checks, hold=hold, combinations=None if shared else combinations)
        if not cap.tiers:
            return wrapper, compiled_fn
        special = cap.specialised
        assert special is not None and hold is not None
        special.meta.update(graph_module.meta)  # CA's locals to steal
        checks = (*checks, *(t.check for t in cap.tiers if t.check is not None))

        def specialised(refused: Callable[..., Any]) -> Callable[..., Any]:
            return make_runtime_wrapper(spec, special, checks, refused=refused, combinations=combinations)

        functions = tuple(dict.fromkeys(t.function for t in cap.tiers))  # each once
        wrapper = tiered.wrap(wrapper, hold, specialised, special, self.compiler_fn, functions, cap.record, way)
        return wrapper, compiled_fn
