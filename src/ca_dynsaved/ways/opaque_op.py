"""The opaque way: one op runs the node's backward with this step's values
(``decision.OpaqueCall``; the ops themselves, and what they bind each run, are
``opaque.py`` and ``binding.py``; ``fuse.py`` fuses chains of them).

At the node's hook (``defer``) C++ gets dummy outputs, and the op waits for
``validate_outputs``, which C++ calls right after with the outputs' symbolic
metadata (``validated``): then one op goes into the graph, its lifted numbers read
from the run, its hashed values data of the capture (``binding.NodeCapture``). A
call the op cannot express (``opaque.Unexpressible``) is traced as stock traces it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from .._compat.capture import no_proxy_modes
from .._compat.layout import CppCall
from .. import binding, opaque
from ..decision import Decision, OpaqueCall
from ..state import Capture, Deferred


def defer(
    cap: Capture, decision: Decision, grads: Sequence[Any], metadatas: Sequence[Any], stock: Callable[[], Sequence[Any]],
    fn: Callable[..., Any] | None = None, call: CppCall | None = None, hook: int = -1, saved: Sequence[Any] = (),
) -> list[Any]:
    """The dummy outputs C++ gets for an opaque node (C++: one per output; Python:
    one per forward input, None where the input was not a tensor, as C++ keeps the
    backward's outputs at the tensor positions only); its op waits in ``pending``."""
    with no_proxy_modes():
        if fn is not None:
            dummies = [cap.instance.allocate_dummy() for _ in metadatas]
        else:
            dummies = [None if m is None else cap.instance.allocate_dummy() for m in metadatas]
    cap.pending = Deferred(decision, list(grads), dummies, stock, fn=fn, call=call, hook=hook, saved=tuple(saved))
    return dummies


def validated(
    cap: Capture, deferred: Deferred, outputs: Sequence[Any], meta: Any, stock_validate: Callable[[], Any]
) -> Any:
    """validate_outputs of an opaque node: its op, bound to the dummies C++ holds;
    or, where the op cannot express the call, stock's trace and validation."""
    expected = [d for d in deferred.dummies if d is not None]
    if len(outputs) != len(expected) or any(o is not d for o, d in zip(outputs, expected)):
        raise RuntimeError(
            f"ca_dynsaved: validate_outputs after {deferred.decision.name} got other tensors "
            "than its outputs; this torch's CA capture order is not supported"
        )
    instance = cap.instance
    try:
        proxy_out = emit(cap, deferred, meta)
    except opaque.Unexpressible as e:
        cap.record_node(deferred.decision.demoted(str(e)), deferred.hook)
        traced = [t for t in deferred.emit_stock() if t is not None]
        instance.bind_objects_to_proxies(outputs, [cap.to_proxy(t) for t in traced])
        return stock_validate()
    instance.bind_objects_to_proxies(outputs, [proxy_out[i] for i in range(len(outputs))])
    return outputs


def emit(cap: Capture, deferred: Deferred, meta: Any) -> Any:
    """Put one opaque op for ``deferred`` in the graph; return its output proxy."""
    plan: OpaqueCall = deferred.decision.plan  # type: ignore[assignment]
    if deferred.call is not None:
        # A saved value CA hashed is a value of this capture, not structure: it
        # reaches the op at run time (binding.NodeCapture).
        values = [v if s is None else opaque.Captured(s) for v, s in zip(deferred.call.values, plan.slots)]
        call_args: Any = deferred.call.args(values=values)
    else:
        call_args = (plan.inputs,)
    key, tensors, symints, reads_scalars = opaque.node_spec(deferred.decision.name, call_args, meta, cap.lifted)
    slot = len(cap.nodes)
    cap.nodes.append(binding.NodeCapture(deferred.fn, plan.captured))
    guarded = deferred.tier.guarded if deferred.tier is not None else None
    # a guarded Python node: recorded as what runs first, its trace
    cap.record_node(deferred.decision if guarded is None else dataclasses.replace(deferred.decision, plan=guarded), deferred.hook)
    grads, tensors, symints = cap.to_proxy(deferred.grads), cap.to_proxy(tensors), cap.to_proxy(symints)
    if deferred.call is not None:
        # Its lifted numbers reach the op through the run (binding.bound_run).
        cap.opaque_reads_scalars |= reads_scalars
        op, op_args = opaque.CPP_OP, (grads, tensors, symints, key, slot)
    else:
        saved = cap.to_proxy(list(deferred.saved))
        op, op_args = opaque.PY_OP, (grads, saved, symints, key, slot, deferred.hook)
    return cap.instance.fx_tracer.create_proxy("call_function", op, op_args, {})
