"""What Dynamo (and inductor) do with the plugin's frames, ops and probes.

Touches: ``torch._dynamo.eval_frame.set_code_exec_strategy`` and
``torch._dynamo.types`` (a frame Dynamo skips), ``torch._dynamo.exc`` (``Unsupported``,
``BackendCompilerFailed``, a break's ``real_stack``), ``error_on_graph_break``,
``torch._dynamo.utils.get_compilation_metrics`` / ``counters``, ``torch.compile``,
``torch._dynamo.external_utils.call_backward``, ``torch.Tag.cudagraph_unsafe``.
Releases: the same on 2.11 to 2.15 (2.11's assertions inside Dynamo carry no message:
``exception_line`` then gives the type alone).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._dynamo.utils import counters


def compilation_metrics() -> list[Any]:
    """Dynamo's record of each compile (id, recompile reason, failure, start time)."""
    return torch._dynamo.utils.get_compilation_metrics()


#: The op tag that makes inductor keep an op out of CUDA graphs: with graph
#: partitioning it splits the graph around the op (``Scheduler.should_partition``),
#: without it skips CUDA graphs for the graph (``get_first_incompatible_cudagraph_node``).
CUDAGRAPH_UNSAFE = torch.Tag.cudagraph_unsafe


def without_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that Dynamo never traces, nor any frame it calls, as under
    ``torch.compiler.disable``; but marked on its code object, so a call costs
    nothing (``disable``'s wrapper swaps Dynamo's frame callback out and back on
    every call: several microseconds for an op run once per node per backward)."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return fn


@dataclass(frozen=True)
class TracedAlone:
    """What Dynamo made of a Python backward traced on its own (``trace_backward_alone``)."""

    breaks: bool | None  # True: a graph break; False: one graph; None: Dynamo failed otherwise
    reason: str  # the break's kind and Dynamo's explanation, or the failure
    where: str = ""  # "file:line in function" of the user frame the break is in


class _OneGraph(Exception):
    """Raised by the refusing backend: Dynamo traced the backward in one graph."""


def _refuse(gm: Any, example_inputs: Any) -> Any:
    raise _OneGraph


_ALONE_SOURCE = "def backward_alone(ctx, saved, *grads):\n    return call_backward(ctx, saved, *grads)\n"


def trace_backward_alone(ctx: Any, saved: list[Any], grads: list[Any]) -> TracedAlone:
    """Trace ``call_backward(ctx, saved, *grads)`` with Dynamo as a CA graph traces its
    call of it (graph breaks allowed, so ``.item()`` breaks there as here, where
    ``fullgraph=True`` would capture it; sizes dynamic), but stop at the first break
    (``error_on_graph_break``) and never run it: the backend refuses the one graph.
    A fresh code object each time leaves Dynamo no cache entry or frame state to
    reuse; the counters are restored, so they keep counting what the user compiles."""
    from torch._dynamo import exc
    from torch._dynamo.external_utils import call_backward

    scope: dict[str, Any] = {"call_backward": call_backward}
    exec(compile(_ALONE_SOURCE, "<ca_dynsaved: a backward traced alone>", "exec"), scope)
    before = {name: counter.copy() for name, counter in counters.items()}
    # Dynamo's event spans: a trace that fails can pop the enclosing ones (torch
    # 2.11), whose end then logs a WARNING in the user's log; restored as they were.
    events = torch._dynamo.utils.get_chromium_event_logger()
    stacks = [(stack, list(stack)) for stack in (events.get_stack(), events.get_pt2_compile_substack())]
    try:
        with torch._dynamo.error_on_graph_break(True):
            torch.compile(scope["backward_alone"], backend=_refuse, dynamic=True)(ctx, saved, *grads)
        # No graph to compile (it returns its inputs as they are, or constants):
        # Dynamo called no backend, and the code it ran does nothing else.
        return TracedAlone(False, "no op to compile")
    except exc.Unsupported as e:
        return TracedAlone(True, _break_reason(e), _break_frame(e))
    except exc.BackendCompilerFailed as e:
        if isinstance(e.inner_exception, _OneGraph):
            return TracedAlone(False, "one graph")
        return TracedAlone(None, exception_line(e.inner_exception))
    except Exception as e:  # noqa: BLE001 - Dynamo failed in some other way: the caller decides
        return TracedAlone(None, exception_line(e))
    finally:
        counters.clear()
        counters.update(before)
        for stack, kept in stacks:
            stack[:] = kept


def _lines(e: BaseException) -> list[str]:
    return [line.strip() for line in str(e).splitlines() if line.strip()]


def exception_line(e: BaseException) -> str:
    """An exception as one line, for a reason the report gives: its type and its
    message's first line (at most 200 characters), without Dynamo's "from user
    code:" trailer; the type alone where there is no message (torch 2.11's
    assertions inside Dynamo carry none)."""
    lines = _lines(e)
    first = lines[0][:200] if lines and lines[0] != "from user code:" else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _break_reason(e: Exception) -> str:
    """A graph break's kind and Dynamo's one-line explanation."""
    lines = _lines(e)
    kind = lines[0] if lines else type(e).__name__
    explanation = next((line[len("Explanation:"):].strip() for line in lines if line.startswith("Explanation:")), "")
    explanation = re.split(r"(?<=[.)`])\s+(?=[A-Z])", explanation)[0].rstrip(".")  # its first sentence
    return f"{kind} ({explanation})" if explanation else kind


def _break_frame(e: Exception) -> str:
    """The innermost user frame of a graph break (Dynamo's ``real_stack``)."""
    stack = getattr(e, "real_stack", None) or []
    if not stack:
        return ""
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"
