"""Patch and unpatch: the config flag, the ``_enable`` hook, the CA cache owner.

Compiled autograd is switched on by ``torch._dynamo.compiled_autograd._enable``:
called directly, by ``ca_dynsaved.enable``, or by Dynamo when a frame compiled with
``torch._dynamo.config.compiled_autograd = True`` runs. ``_enable`` instantiates the
module global ``AutogradCompilerInstance`` at entry, so the plugin swaps that global
for the duration of ``_enable.__enter__`` only and nothing stays patched inside.

Two things must outlive a context, and are installed once on import:

* the config flag ``torch._dynamo.config.compiled_autograd_dynamic_saved_data``;
* a wrapper around ``_enable`` (a pass-through while the flag is off and no plugin
  context is open) that picks the plugin for Dynamo's config path, and keeps the C++
  CA cache owned by one mode: stock and plugin captures share that cache, so a
  switch of mode clears it, or a stock entry would run inside the plugin (or the
  reverse) and the switch would change nothing.

Each of them, and the marking of resume functions, is one ``Patch`` in ``PATCHES``,
which ``install()`` applies in order and ``uninstall()`` removes in reverse; both
are idempotent. What a plugin context changes (the instance class while ``_enable``
enters, the engine's gate on backwards) is a context manager that restores what it
found (``_instance_class``, ``_compat.engine.gating_backwards``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .counting import count
from ._compat.capture import (
    ca,
    ca_cache_is_empty,
    clear_ca_cache,
    stock_enable,
    swap_enable,
    swap_instance_class,
)
from ._compat.config import is_config_entry, register_config_entry, register_torch_log, unregister_config_entry
from ._compat.dynamic_state import patch_resume_functions, resume_functions_patched
from ._compat.engine import gating_backwards
from . import gate, policies
from .compiler import DynSavedCompilerInstance
from .decision import Options

# The names of the config entries registered on ``torch._dynamo.config``: a str
# carries no docstring, so each entry is documented in ``enable``'s docstring and the
# package's ("Config entries").
#: ``torch._dynamo.config.compiled_autograd_dynamic_saved_data`` (bool, default
#: False): the plugin for CA contexts opened without ``enable`` (the config path).
CONFIG_FLAG = "compiled_autograd_dynamic_saved_data"
#: ``..._python_policy`` (str, default "auto"): the Python-function policy
#: (``policies``, ``pyctx``) of the config path and of ``enable(python_policy=None)``.
CONFIG_PYTHON_POLICY = "compiled_autograd_dynamic_saved_data_python_policy"
#: ``..._trace_cpp`` (tuple of str, default ()): C++ names opted into tracing
#: (``sentinel``), for the config path and ``enable(trace_cpp=None)``.
CONFIG_TRACE_CPP = "compiled_autograd_dynamic_saved_data_trace_cpp"
#: ``..._verify`` (bool, default True): for the config path and ``enable(verify=None)``.
CONFIG_VERIFY = "compiled_autograd_dynamic_saved_data_verify"
#: ``..._cpp_policy`` (str, default "auto"): the C++-function policy (``decision``)
#: of the config path and of ``enable(cpp_policy=None)``.
CONFIG_CPP_POLICY = "compiled_autograd_dynamic_saved_data_cpp_policy"
_CONFIG_ENTRIES = {
    CONFIG_FLAG: (False, bool),
    CONFIG_PYTHON_POLICY: (policies.AUTO, str),
    CONFIG_TRACE_CPP: ((), tuple),
    CONFIG_VERIFY: (True, bool),
    CONFIG_CPP_POLICY: (policies.AUTO, str),
}



@dataclass(frozen=True)
class Mode:
    """How CA captures: stock, or the plugin with its options."""

    plugin: bool
    options: Options = Options()


STOCK = Mode(plugin=False)


def plugin_mode(
    exclude: frozenset[str] = frozenset(),
    python_policy: str | None = None,
    trace_cpp: frozenset[str] | None = None,
    verify: bool | None = None,
    cpp_policy: str | None = None,
) -> Mode:
    """The plugin with these options; an option given as None reads its config entry
    (gone after uninstall(): then its default). Stock CA while the plugin is off
    (an untested torch that failed the self-check)."""
    if _off:
        return STOCK
    config = torch._dynamo.config
    if python_policy is None:
        python_policy = getattr(config, CONFIG_PYTHON_POLICY, policies.AUTO)
    if trace_cpp is None:
        trace_cpp = frozenset(_names(getattr(config, CONFIG_TRACE_CPP, ()), CONFIG_TRACE_CPP))
    if verify is None:
        verify = bool(getattr(config, CONFIG_VERIFY, True))
    if cpp_policy is None:
        cpp_policy = getattr(config, CONFIG_CPP_POLICY, policies.AUTO)
    options = Options(
        frozenset(exclude), policies.check(python_policy), frozenset(trace_cpp), verify,
        policies.check(cpp_policy, "cpp_policy"),
    )
    return Mode(True, options)


def _names(value: Any, what: str) -> tuple[str, ...]:
    """Function-name substrings (``exclude``, ``trace_cpp``): a str is one name, not
    its letters."""
    names = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"ca_dynsaved: {what} takes non-empty function-name substrings, got {value!r}")
    return names


#: Why the plugin is off (one line), or empty: set by switch_off().
_off: list[str] = []

_lock = threading.RLock()  # held by the thread with open CA contexts (ca_context)
_modes: list[Mode] = []  # one per open CA context; CA's compiler is process-global
_cache_mode: list[Mode | None] = [None]  # the mode whose captures fill the C++ CA cache


def _flag_on() -> bool:
    return bool(getattr(torch._dynamo.config, CONFIG_FLAG, False))


def _own_cache(mode: Mode) -> None:
    """Clear the CA cache if it holds graphs captured in another mode."""
    if _cache_mode[0] not in (None, mode) and not ca_cache_is_empty():
        clear_ca_cache()
        count("cache_clears")
    _cache_mode[0] = mode


@contextlib.contextmanager
def _instance_class(cls: Callable[..., Any]) -> Iterator[None]:
    prior = swap_instance_class(cls)
    try:
        yield
    finally:
        swap_instance_class(prior)


@contextlib.contextmanager
def ca_context(
    compiler_fn: Callable[..., Any],
    dynamic: bool = True,
    ignore_active_disable_ctx: bool = True,
    *,
    mode: Mode | None = None,
) -> Iterator[None]:
    """``_enable`` with the plugin's capture class when ``mode.plugin``.

    ``mode=None`` (Dynamo's config path, direct ``_enable`` calls) means: the mode
    of an enclosing plugin context, else the plugin if the config flag is on, else
    stock.
    """
    if not ignore_active_disable_ctx and ca.active_disable_ctx:
        # _enable is a no-op here: CA stays off, no mode changes hands.
        with stock_enable(compiler_fn, dynamic, ignore_active_disable_ctx):
            yield
        return
    # CA's compiler is process-global and ``_enable`` restores it last-in first-out:
    # two threads whose contexts interleave would leave the wrong one installed (stock
    # CA fails there with "Nested Compiled Autograd Contexts must return before their
    # parent context"). So a CA context holds this re-entrant lock until it exits: the
    # contexts of two threads run one after the other (the same thread re-enters).
    with _lock:
        if mode is None:
            if _modes and _modes[-1].plugin:
                mode = _modes[-1]
            else:
                mode = plugin_mode() if _flag_on() else STOCK
        _own_cache(mode)
        _modes.append(mode)
        try:
            with contextlib.ExitStack() as stack:
                cm = stock_enable(compiler_fn, dynamic, ignore_active_disable_ctx)
                if mode.plugin:
                    factory = functools.partial(DynSavedCompilerInstance, options=mode.options)
                    with _instance_class(factory):  # type: ignore[arg-type]
                        stack.enter_context(cm)
                    stack.enter_context(gating_backwards(gate.gate))
                else:
                    stack.enter_context(cm)
                yield
        finally:
            _modes.pop()
            if _modes:
                _own_cache(_modes[-1])


@functools.wraps(stock_enable)
def _enable_hook(
    compiler_fn: Callable[..., Any],
    dynamic: bool = True,
    ignore_active_disable_ctx: bool = True,
) -> contextlib.AbstractContextManager[None]:
    return ca_context(compiler_fn, dynamic, ignore_active_disable_ctx)


def _register_config() -> None:
    for name, (default, value_type) in _CONFIG_ENTRIES.items():
        register_config_entry(name, default, value_type)


def _unregister_config() -> None:
    for name in _CONFIG_ENTRIES:
        unregister_config_entry(name)


@dataclass(frozen=True)
class Patch:
    """One change to torch that outlives a plugin context: what ``install()`` does
    (``apply``), what ``uninstall()`` undoes (``remove``), and whether it is in
    place (``applied``). ``apply`` and ``remove`` are idempotent."""

    what: str
    apply: Callable[[], None]
    remove: Callable[[], None]
    applied: Callable[[], bool]


def _hook_enable() -> None:
    if ca._enable is not _enable_hook:
        swap_enable(_enable_hook)


def _unhook_enable() -> None:
    if ca._enable is _enable_hook:
        swap_enable(stock_enable)


#: Every change ``install()`` makes to torch, in order (``uninstall()``: in reverse).
PATCHES = (
    Patch(
        "torch._dynamo.config.compiled_autograd_dynamic_saved_data* (the config entries)",
        _register_config, _unregister_config, lambda: all(map(is_config_entry, _CONFIG_ENTRIES)),
    ),
    Patch(
        "torch._dynamo.compiled_autograd._enable (the plugin's hook)",
        _hook_enable, _unhook_enable, lambda: ca._enable is _enable_hook,
    ),
    Patch(
        "ContinueExecutionCache.generate (resume functions marked)",
        functools.partial(patch_resume_functions, True), functools.partial(patch_resume_functions, False),
        resume_functions_patched,
    ),
)


def install() -> None:
    """Register the config entries (``CONFIG_*``, at their defaults), the log
    ``TORCH_LOGS="ca_dynsaved"``, the ``_enable`` hook that gives Dynamo's config
    path the plugin while ``CONFIG_FLAG`` is on, and the marking of resume functions.

    Done on import, so only needed after ``uninstall()``. Takes no arguments and
    returns None; idempotent; a no-op once the plugin is off (``off_reason()``).

    Example::

        ca_dynsaved.uninstall()
        ...  # stock torch: no hook, no config entries
        ca_dynsaved.install()
    """
    with _lock:
        if _off:
            return
        register_torch_log("ca_dynsaved")  # a log name: nothing of torch's behaviour
        for patch in PATCHES:
            patch.apply()


def switch_off(reason: str) -> None:
    """Leave torch unpatched for good in this process: ``enable()`` and the config
    flag then give stock compiled autograd (the config entries stay, inert, so a
    script that sets them still runs)."""
    with _lock:
        uninstall()
        _register_config()
        _off[:] = [reason]


def off_reason() -> str:
    """Why the plugin is off in this process, or '' when it is on.

    It is off only on an untested torch allowed with
    ``CA_DYNSAVED_ALLOW_UNTESTED_TORCH=1`` whose self-check failed at import: the
    reason is that check's one-line verdict. Off, ``enable()`` and the config flag
    give stock compiled autograd, ``install()`` does nothing and ``self_check()``
    raises. Takes no arguments; returns a str.

    Example::

        if ca_dynsaved.off_reason():
            print("stock compiled autograd:", ca_dynsaved.off_reason())
    """
    return _off[0] if _off else ""


def uninstall() -> None:
    """Undo ``install()``: stock ``_enable`` (the config path gives stock CA), no
    config entries (setting one then raises ``AttributeError``), no resume-function
    marking, and no plugin graph left in the CA cache.

    An explicit ``enable()`` still works after it (its None options take their
    defaults). Takes no arguments and returns None; idempotent.

    Raises:
        RuntimeError: called inside an open compiled-autograd context.

    Example::

        ca_dynsaved.uninstall()
        try:
            run_stock_baseline()
        finally:
            ca_dynsaved.install()
    """
    with _lock:
        if _modes:
            raise RuntimeError("ca_dynsaved.uninstall() inside an open compiled-autograd context")
        for patch in reversed(PATCHES):
            patch.remove()
        _own_cache(STOCK)
