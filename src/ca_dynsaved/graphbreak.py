"""Would Dynamo break the CA graph at a Python backward? Its backward traced alone.

Stock CA puts a Python backward in its graph as ``call_backward(hooks[i], saved,
*grads)`` and Dynamo inlines it when it compiles the graph. A backward that calls
something Dynamo refuses (a C extension's helper, numpy it cannot map to torch,
``.item()``, ``.tolist()``) breaks the graph there, at every such node, and each
break is a new frame that recompiles as sizes change. Run opaque instead
(``ca_dynsaved::py_function``, as ``pyctx`` runs a function that would specialise
on a ctx number), such a node costs no break and no compile of its own.

The symbolic probe (``probe.py``) cannot tell: a plain Python helper Dynamo refuses
runs fine on fake tensors. So the backward is traced by Dynamo itself, alone, as the
CA graph would trace it (``trace_backward_alone``): real empty tensors with
the capture's sizes, sizes dynamic, the real ctx, stopping at the first break, the
graph never run. A Dynamo trace is costly (docs/benchmarks.md, "Component costs"),
so it runs once per function and ctx layout (attribute names and types), as the
probe. A value that takes an untraced branch only on some steps is not seen: that
node then breaks the graph as under stock, never worse. Dynamo failing on it in any
other way (an internal error: stock CA's compile would raise it) runs it opaque too.
"""

from __future__ import annotations

from typing import Any, Sequence


from .counting import count
from ._compat.capture import is_torch_own_function
from ._compat.dynamo import trace_backward_alone
from ._compat.layout import incoming_grads
from ._compat.symbolic import outside_capture
from .caches import on_reset
from . import probe

_CACHE: dict[tuple[Any, ...], str | None] = {}
#: How a reason starts where Dynamo fails on the backward (not a break): stock's
#: compile would raise, so the node never gets stock's graph (``decision.Tiered``).
TRACING_FAILED = "backward not traceable by Dynamo: tracing it failed"


@on_reset
def clear() -> None:
    _CACHE.clear()


def break_reason(ctx: Any, saved: Sequence[Any]) -> str | None:
    """Why Dynamo would break the graph at (or fail on) this node's backward, None
    if it traces in one graph. torch's own
    functions (FSDP2's pre- and post-backward hooks, activation checkpointing) are
    written for CA, some with a path of their own under it: they keep stock (a custom
    op's ``register_autograd`` backward is the user's, in a class torch generates)."""
    if is_torch_own_function(ctx._forward_cls):
        return None
    key = probe.ctx_layout(ctx)
    if key not in _CACHE:
        count("dynamo_probes")
        _CACHE[key] = _trace(ctx, saved)
    return _CACHE[key]


@probe.quietly  # Dynamo tracing a backward alone may log a failure at WARNING or ERROR
def _trace(ctx: Any, saved: Sequence[Any]) -> str | None:
    with outside_capture():
        try:
            real_saved = [probe.empty_like(t) for t in saved]
            grads = incoming_grads(ctx)
        except Exception:  # noqa: BLE001 - a layout empty_strided cannot copy (sparse, nested)
            return None  # not traced alone: today's handling
        traced = trace_backward_alone(ctx, real_saved, grads)
    if traced.breaks is False:
        return None
    if traced.breaks is None:  # CA's compile of it would fail the same way
        return f"{TRACING_FAILED} ({traced.reason})"
    at = f" at {traced.where}" if traced.where else ""
    return f"backward not traceable by Dynamo: {traced.reason}{at}"

