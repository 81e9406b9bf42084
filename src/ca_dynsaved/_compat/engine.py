"""The autograd engine a backward runs on, and the caller's state it runs under.

Touches: ``torch.autograd.variable.Variable._execution_engine`` (swapped for a
subclass of ``torch._C._ImperativeEngine`` while a plugin context is open),
``torch._C._dispatch_tls_local_include_set`` / ``_exclude_set``,
``torch._C._ForceDispatchKeyGuard``, ``torch._C._is_any_autocast_enabled``. Releases:
the same on 2.11 to 2.15.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

from .dynamo import without_dynamo


def dispatch_keys() -> tuple[Any, Any]:
    """The calling thread's local dispatch key sets: (included, excluded)."""
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


#: Sets a thread's local dispatch key sets for a block (to ``dispatch_keys()``'s).
ForceDispatchKeys = torch._C._ForceDispatchKeyGuard


# Device types autocast can be enabled for (a privateuse1 backend under its own name).
_AUTOCAST_DEVICES = tuple(
    device
    for device in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", torch._C._get_privateuse1_backend_name())
    if torch.amp.autocast_mode.is_autocast_available(device)
)

#: The autocast state of the calling thread: ((device type, dtype), ...) for every
#: device type autocast is enabled for, and whether its cast cache is on.
AutocastState = tuple[tuple[tuple[str, torch.dtype], ...], bool]


def autocast_state() -> AutocastState | None:
    """The caller's autocast state, None when autocast is off (the common case)."""
    if not torch._C._is_any_autocast_enabled():
        return None
    enabled = tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )
    return enabled, torch.is_autocast_cache_enabled()


# --- The autograd engine (Variable._execution_engine) ---------------------------------
class _PluginEngine(torch._C._ImperativeEngine):  # type: ignore[misc]
    """The autograd engine, with two additions on a thread that asked for them:

    * ``queue_callback`` while a compiled backward runs appends to that run's list.
      Why: the C++ engine puts such a callback on the graph task of the
      ``backward()`` that CA took over, and CA returns from that task without its
      post-processing, so the callback is dropped (FSDP2's post-backward:
      reduce-scatter and reshard).
    * ``run_backward`` (every ``backward()`` / ``autograd.grad``) goes through the
      gate of an open plugin context, which may run it without CA (``payoff.py``).

    A subclass, so that Dynamo, tracing a CA graph, still sees the engine
    (ID_MATCH on this one instance) and keeps its own traced ``queue_callback``."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    def _stack(self, name: str) -> list[Any]:
        """This thread's stack ``name``: "frames" (per running backward, its
        callback list or None) or "gates" (per open plugin context, its gate)."""
        stack = getattr(self._local, name, None)
        if stack is None:
            stack = []
            setattr(self._local, name, stack)
        return stack

    def _frames(self) -> list[list[Callable[[], None]] | None]:
        return self._stack("frames")

    def _gates(self) -> list[Callable[..., Any]]:
        return self._stack("gates")

    # Called with Dynamo's frame callback on (Dynamo's config path): never a frame
    # for Dynamo to compile.
    @without_dynamo
    def queue_callback(self, callback: Callable[[], None]) -> None:
        frames = self._frames()
        if frames and frames[-1] is not None:
            frames[-1].append(callback)
        else:
            super().queue_callback(callback)

    @without_dynamo
    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        # A backward started inside the compiled one (a checkpoint's recompute, a
        # torch.autograd.grad in a hook) has its own graph task: its callbacks are
        # the engine's, run when it ends, as in eager; no gate decides about it.
        frames = self._frames()
        gates = self._gates()
        outermost = not frames
        frames.append(None)
        try:
            if outermost and gates:
                return gates[-1](super().run_backward, args, kwargs)
            return super().run_backward(*args, **kwargs)
        finally:
            frames.pop()


_ORIGINAL_ENGINE = torch.autograd.variable.Variable._execution_engine
_PLUGIN_ENGINE = _PluginEngine()
_engine_lock = threading.Lock()
_engine_users = 0  # open blocks below, all threads: the plugin's engine is in while > 0


@contextlib.contextmanager
def _plugin_engine() -> Iterator[_PluginEngine]:
    """``torch.autograd.Variable._execution_engine`` (read by every caller at call
    time) is the plugin's engine while any thread is in such a block, the original
    again after the last one leaves."""
    global _engine_users
    variable = torch.autograd.variable.Variable
    with _engine_lock:
        if _engine_users == 0:
            variable._execution_engine = _PLUGIN_ENGINE
        _engine_users += 1
    try:
        yield _PLUGIN_ENGINE
    finally:
        with _engine_lock:
            _engine_users -= 1
            if _engine_users == 0:
                variable._execution_engine = _ORIGINAL_ENGINE


@contextlib.contextmanager
def collecting_final_callbacks() -> Iterator[list[Callable[[], None]]]:
    """While the block runs, callbacks queued on this thread go to the yielded list
    instead of the engine."""
    queued: list[Callable[[], None]] = []
    with _plugin_engine() as engine:
        frames = engine._frames()
        frames.append(queued)
        try:
            yield queued
        finally:
            frames.pop()


@contextlib.contextmanager
def gating_backwards(gate: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]) -> Iterator[None]:
    """While the block runs, an outermost ``run_backward`` on this thread is
    ``gate(run_backward, args, kwargs)``."""
    with _plugin_engine() as engine:
        gates = engine._gates()
        gates.append(gate)
        try:
            yield
        finally:
            gates.pop()
