"""Every private torch symbol and C++ argument layout ca_dynsaved relies on.

Compiled autograd (CA) has no public extension API, so the plugin reads and
patches internals. They all live here so that a torch upgrade breaks one file, and
so the import-time version check can refuse a release nobody has tested.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import re
import textwrap
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

#: Releases (major.minor) the test suite passes on, CI runs it on each (README,
#: "Supported torch releases"). Where they differ in what the plugin touches, the
#: difference is detected below, next to the use, with the releases named.
TESTED_TORCH_RELEASES: tuple[str, ...] = ("2.11", "2.12", "2.13", "2.14", "2.15")

#: Set to 1 to try the plugin on a release not in TESTED_TORCH_RELEASES (a nightly):
#: the import then runs ``ca_dynsaved.selfcheck`` first, and the plugin switches on
#: only if it passes.
ALLOW_UNTESTED_ENV = "CA_DYNSAVED_ALLOW_UNTESTED_TORCH"


class UnsupportedTorchError(ImportError):
    """torch is a release whose compiled-autograd internals were never verified.

    Raised by ``import ca_dynsaved``, before anything is patched, when torch is not
    a tested release (2.11 to 2.15; a nightly or a pre-release is not) and
    ``CA_DYNSAVED_ALLOW_UNTESTED_TORCH=1`` is not set, or when torch lacks a
    compiled-autograd name the plugin uses. The message names the version (and the
    missing names). An ``ImportError``: the import fails, so catch it as that.
    Takes the message as its one argument.

    Example::

        try:
            import ca_dynsaved
        except ImportError as e:  # UnsupportedTorchError: run without the plugin
            ca_dynsaved = None
    """


class UntestedTorchWarning(UserWarning):
    """An untested release the user allowed: what the self-check found.

    Warned once by ``import ca_dynsaved`` on a torch that is not a tested release
    when ``CA_DYNSAVED_ALLOW_UNTESTED_TORCH=1`` is set: the import runs the
    self-check, and the plugin switches on if it passes; if not, it stays off
    (``enable()`` and the config flag give stock compiled autograd) and the message
    names what differed, as ``off_reason()`` does. Takes the message as its one
    argument.

    Example::

        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import ca_dynsaved
        untested = [w for w in caught if issubclass(w.category, ca_dynsaved.UntestedTorchWarning)]
    """


def _release(version: str) -> str | None:
    """``"2.15"`` for a final release ``2.15.x`` (a local tag such as ``+cu130``
    allowed); None for a pre-release (``2.16.0.dev20261130``, ``2.15.0a0+git...``,
    ``2.15.0rc1``), which is not the release it precedes."""
    found = re.fullmatch(r"(\d+)\.(\d+)\.\d+(\+[\w.]+)?", version)
    return f"{found.group(1)}.{found.group(2)}" if found else None


def is_tested_release(version: str | None = None) -> bool:
    version = torch.__version__ if version is None else version
    return _release(version) in TESTED_TORCH_RELEASES


def untested_allowed() -> bool:
    return os.environ.get(ALLOW_UNTESTED_ENV, "") == "1"


def check_torch_version(version: str | None = None) -> None:
    """Raise UnsupportedTorchError unless ``version`` is a tested release, or the
    user asked to try an untested one (then the import runs the self-check)."""
    version = torch.__version__ if version is None else version
    if not is_tested_release(version) and not untested_allowed():
        raise UnsupportedTorchError(
            f"ca_dynsaved supports torch {', '.join(TESTED_TORCH_RELEASES)}, "
            f"found torch {version}: its compiled-autograd internals are private "
            "and change between releases, so the plugin refuses to patch them. To try "
            f"it anyway, set {ALLOW_UNTESTED_ENV}=1: the import then runs a self-check "
            "(a real capture of a C++ and a Python function, compared with eager and "
            "with the expected compile counts) and leaves the plugin off if it fails."
        )


check_torch_version()
#: The running torch is not a tested release (the user allowed it: see above).
UNTESTED_TORCH = not is_tested_release()

# Imported only after the version check: on an untested release these may not exist.
import torch._dynamo.compiled_autograd as ca  # noqa: E402
from torch._dynamo.utils import ExactWeakKeyDictionary  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

#: What the plugin uses of torch._dynamo.compiled_autograd, and of the capture class
#: (C++ calls the hooks by name; compiler.py overrides and calls them).
REQUIRED_CA_NAMES = ("AutogradCompilerInstance", "_enable", "_disable", "ops", "active_disable_ctx")
REQUIRED_CAPTURE_METHODS = (
    "begin_capture", "bind_function", "apply_functional", "proxy_call_backward",
    "validate_outputs", "end_capture", "create_graph_module", "allocate_dummy",
    "to_proxy", "bind_objects_to_proxies",
)


def missing_internals() -> list[str]:
    """The names above that this torch lacks."""
    missing = [name for name in REQUIRED_CA_NAMES if not hasattr(ca, name)]
    capture = getattr(ca, "AutogradCompilerInstance", None)
    missing += [
        f"AutogradCompilerInstance.{name}"
        for name in REQUIRED_CAPTURE_METHODS
        if capture is not None and not callable(getattr(capture, name, None))
    ]
    return missing


_missing = missing_internals()
if _missing:
    raise UnsupportedTorchError(
        f"ca_dynsaved: torch {torch.__version__} lacks compiled-autograd internals the "
        f"plugin relies on: {', '.join(_missing)}; nothing was patched."
    )

#: The stock capture class; the plugin subclasses it.
StockCompilerInstance = ca.AutogradCompilerInstance
#: The stock ``_enable`` context manager, captured before the plugin wraps it.
stock_enable: Callable[..., Any] = ca._enable

_cpp = torch._C._dynamo.compiled_autograd


def clear_ca_cache() -> None:
    """Drop every cached CA graph (the C++ shadow graph), as ``ca.reset`` does."""
    _cpp.clear_cache()


def ca_cache_is_empty() -> bool:
    return bool(_cpp.is_cache_empty())


def swap_instance_class(cls: Callable[..., Any]) -> Callable[..., Any]:
    """Set the class ``ca._enable`` instantiates; returns the previous one."""
    prior = ca.AutogradCompilerInstance
    ca.AutogradCompilerInstance = cls
    return prior


def swap_enable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Set ``ca._enable`` (looked up by attribute by Dynamo's config path)."""
    prior = ca._enable
    ca._enable = fn
    return prior


def register_config_entry(name: str, default: Any, value_type: type) -> None:
    """Add ``torch._dynamo.config.<name>``: settable, patchable, saved by save_config.
    Compile-ignored: the forward graphs do not depend on it, so Dynamo's config
    hash stays unchanged."""
    from torch.utils._config_module import _Config, _ConfigEntry

    config = torch._dynamo.config
    if name not in config._config:
        # torch 2.12+: _ConfigEntry(config, name); 2.11: _ConfigEntry(config).
        named = "name" in inspect.signature(_ConfigEntry.__init__).parameters
        config._config[name] = _ConfigEntry(_Config(default=default, value_type=value_type), *([name] if named else []))
        config._compile_ignored_keys.add(name)
        _mark_config_dirty(config)


def unregister_config_entry(name: str) -> None:
    config = torch._dynamo.config
    if config._config.pop(name, None) is not None:
        config._compile_ignored_keys.discard(name)
        _mark_config_dirty(config)


def _mark_config_dirty(config: Any) -> None:
    # ConfigModule caches get_config_copy()/save_config()/get_hash(). torch 2.13+:
    # per context, in two ContextVars; 2.11 / 2.12: in two module attributes.
    if hasattr(config, "_hash_dirty_var"):
        config._hash_dirty_var.set(True)
        config._get_dict_dirty_keys_var.set(None)
    else:
        config._is_dirty = True
        config._hash_digest = None


def is_dynamo_config_compiler(compiler_fn: Any) -> bool:
    """Whether ``compiler_fn`` is the one Dynamo's config path passes to ``_enable``."""
    from torch._dynamo.eval_frame import OptimizeContext

    return isinstance(compiler_fn, OptimizeContext)


def compilation_metrics() -> list[Any]:
    """Dynamo's record of each compile (id, recompile reason, failure, start time)."""
    return torch._dynamo.utils.get_compilation_metrics()


from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402


def stock_ca(compiler_fn: Callable[..., Any]) -> Any:
    """Stock compiled autograd around a block (through the plugin's ``_enable`` hook,
    so the CA cache changes hands): the baseline of the demo and ``run --compare``."""
    return ca._enable(compiler_fn)


def no_ca() -> Any:
    """Plain autograd inside a block, even within a CA context: the eager reference."""
    return ca._disable()


def register_torch_log(name: str) -> None:
    """Let ``TORCH_LOGS="+<name>"`` (debug) / ``"<name>"`` (info) control the
    logger ``<name>``, as torch's own logs are controlled."""
    from torch._logging import _internal

    _internal.register_log(name, [name])
    if name in os.environ.get("TORCH_LOGS", ""):
        # torch parsed TORCH_LOGS at import, before this log existed.
        _internal._init_logs()


def call_backward(ctx: Any, saved_tensors: list[Any], *grads: Any) -> tuple[Any, ...]:
    """Run a Python custom function's backward exactly as a CA graph does."""
    from torch._dynamo.external_utils import call_backward

    return call_backward(ctx, saved_tensors, *grads)


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
        return TracedAlone(None, _failure(e.inner_exception))
    except Exception as e:  # noqa: BLE001 - Dynamo failed in some other way: the caller decides
        return TracedAlone(None, _failure(e))
    finally:
        counters.clear()
        counters.update(before)


def _failure(e: BaseException) -> str:
    """An exception's type and first line, without Dynamo's "from user code" trailer
    (torch 2.11's assertions in Dynamo carry no message of their own)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    first = lines[0][:200] if lines and lines[0] != "from user code:" else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _break_reason(e: Exception) -> str:
    """A graph break's kind and Dynamo's one-line explanation."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
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


#: Where ``register_autograd`` puts the autograd.Function it generates for a custom
#: op (2.11 to 2.15): torch's module, around the user's backward.
_GENERATED_AUTOGRAD_MODULE = "torch._library.autograd"


def is_torch_own_function(cls: type) -> bool:
    """A Python autograd.Function of torch itself (FSDP2's hooks, checkpointing), not
    one a custom op's ``register_autograd`` generated around the user's backward."""
    module = cls.__module__
    return module.partition(".")[0] == "torch" and module != _GENERATED_AUTOGRAD_MODULE


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


def capture_count() -> int:
    """CA captures so far in this process (a backward that added one missed CA's cache)."""
    return counters["compiled_autograd"]["captures"]


# --- CA's runtime wrapper of a graph -------------------------------------------------
#: sha1 of the source of stock CA's per-graph ``runtime_wrapper`` (a closure of
#: ``end_capture``), the same in every tested release: ``sizes_made_once`` stands in
#: for it only where it is that code.
_STOCK_RUNTIME_WRAPPER_SHA1 = "175bba2e81b9e24394729b7a51bd51b2963e9a17"
_STOCK_RUNTIME_WRAPPER_FREEVARS = ("runtime_inputs_to_move", "self", "used_sizes_idx")


@functools.cache
def _is_stock_runtime_wrapper(code: Any) -> bool:
    try:
        source = textwrap.dedent(inspect.getsource(code))
    except (OSError, TypeError):
        return False
    return (
        hashlib.sha1(source.encode()).hexdigest() == _STOCK_RUNTIME_WRAPPER_SHA1
        and code.co_freevars == _STOCK_RUNTIME_WRAPPER_FREEVARS
    )


def sizes_made_once(runtime_wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """Stock CA's runtime wrapper of one graph, except for the tensor standing for
    each used size (``(0, n)``, marked dynamic): made again only when that size
    changes, and with strides ``(1, 1)``. Why: stock makes one and calls
    ``maybe_mark_dynamic`` (a disabled function: two frame-callback swaps) for every
    used size on every run, about 2 us a size here, 42 sizes in a 20-node chain,
    while a training loop's sizes rarely change; and ``torch.empty(0, n)``'s stride
    ``n`` adds a Python guard per size (Dynamo's guards on a 20-node chain: 16.8 us
    a run, 11.6 with constant strides). Each size keeps an object of its own, so
    Dynamo sees no new aliasing between them. Returns ``runtime_wrapper`` itself
    where its code is not the one this copies (another torch)."""
    code = runtime_wrapper.__code__
    if not _is_stock_runtime_wrapper(code):
        return runtime_wrapper
    cells = dict(zip(code.co_freevars, runtime_wrapper.__closure__ or ()))
    instance, to_move = cells["self"].cell_contents, cells["runtime_inputs_to_move"].cell_contents
    used = sorted(cells["used_sizes_idx"].cell_contents)
    made: dict[int, tuple[int, torch.Tensor]] = {}  # used size index -> (size, its tensor)

    @without_dynamo
    def wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        # stock's steps, in stock's order
        try:
            ca.in_compiled_autograd_region = True
            nan_checker = instance.nan_checker
            if nan_checker:
                nan_checker.prep_with_inputs(inputs)
            filtered: list[Any] = []
            for idx in used:
                integer = sizes[idx]
                if integer > 0:  # (stock: "can't create negative size")
                    found = made.get(idx)
                    if found is None or found[0] != integer:
                        found = made[idx] = (integer, torch.empty_strided((0, integer), (1, 1)))
                        torch._dynamo.maybe_mark_dynamic(found[1], 1)
                    filtered.append(found[1])
                else:
                    filtered.append(integer)
            for i in to_move:
                inputs[i] = inputs[i].pin_memory().cuda(non_blocking=True)
            with ca._disable(), ca.make_compile_context(instance.id):
                out = compiled_fn(inputs, filtered, scalars, hooks, packed_inputs)
                if nan_checker:
                    nan_checker.check(out)
                return out
        finally:
            ca.in_compiled_autograd_region = False

    return wrapper


# --- What a capture allocates ----------------------------------------------------------
def grad_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype ``t.grad`` gets: ``t.grad_dtype`` (``t``'s unless set; None allows
    any, then ``t``'s)."""
    return t.grad_dtype or t.dtype


def no_proxy_modes() -> Any:
    """CA's context for making real tensors while a capture traces."""
    return ca.disable_proxy_modes_tracing()


#: Whether two tensors share storage (a view, a detach, the same tensor): one C++ call.
is_alias_of = torch._C._is_alias_of


def validate_outputs_fn() -> Callable[..., Any]:
    """The C++ ``validate_outputs`` functional, bound by the first CA capture."""
    return ca.ops.get("validate_outputs").fn


# --- Dynamo's automatic-dynamic state (torch._dynamo.pgo) ---------------------------
def mark_dynamic_scalars(code: Any, sources: Sequence[str]) -> None:
    """Make Dynamo treat the scalars named ``sources`` (``L['hooks'][0].k``) in
    frames of ``code``, and of the resume functions Dynamo makes from them at a
    graph break, as dynamic from their first compile.

    What automatic dynamic records once a value has changed (one recompile later);
    writing it before the first compile skips that recompile. Only these names
    change: tensor sizes and every other input keep their own dynamism. Cleared by
    ``torch._dynamo.reset()``."""
    if not sources:
        return
    from torch._dynamo import pgo

    # CodeId.make(code) on 2.11; 2.12+ add an optional closure (none here).
    state = pgo.get_code_state()[pgo.CodeId.make(code)]
    for name in sources:
        state.automatic_dynamic[name] = pgo.FrameStateSizeEntry.make_scalar(pgo.auto_dynamic)
    _dynamic_by_code[code] = tuple(sources)


def clear_dynamic_scalars() -> None:
    """Forget the marked codes (``ca_dynsaved.reset()``; pgo's own state goes with
    ``torch._dynamo.reset()``)."""
    _dynamic_by_code.clear()


#: CA graph code (and resume functions made from it) -> its dynamic scalars. By
#: identity: code objects compare equal by value, and a stock capture's graph can
#: have the same code as a plugin one.
_dynamic_by_code: Any = ExactWeakKeyDictionary()


def _marking_resume_functions(generate: Any) -> Any:
    """``ContinueExecutionCache.generate``, then the dynamic scalars of the frame it
    resumes marked on the new code. A resume function keeps the frame's local
    names (``hooks``, ``scalars``), so the sources are the same strings; without
    this, a CA graph broken by a disabled hook (FSDP2's) recompiles once per
    resume function that reads a ctx number."""

    @functools.wraps(generate)
    def wrapper(cls: Any, code: Any, *args: Any, **kwargs: Any) -> Any:
        new_code = generate(cls, code, *args, **kwargs)
        sources = _dynamic_by_code.get(code)
        if sources:
            mark_dynamic_scalars(new_code, sources)
        return new_code

    wrapper.__wrapped_generate__ = generate  # type: ignore[attr-defined]
    return wrapper


def patch_resume_functions(on: bool) -> None:
    """Install (``on``) or remove the resume-function marking; idempotent."""
    from torch._dynamo.resume_execution import ContinueExecutionCache as cache

    current = cache.__dict__["generate"].__func__
    original = getattr(current, "__wrapped_generate__", None)
    if on and original is None:
        cache.generate = classmethod(_marking_resume_functions(current))
    elif not on and original is not None:
        cache.generate = classmethod(original)


def dynamo_specializes_floats() -> bool:
    """Whether Dynamo specialises every float it reads (it does while inductor's
    global CUDA-graphs flag is on, or when asked to), whatever automatic dynamic says."""
    return bool(torch._dynamo.config.specialize_float or torch._inductor.config.triton.cudagraphs)


# --- a private symbolic world, for probing a backward (probe.py) --------------------
def symbolic_probe_mode() -> tuple[Any, Any]:
    """(ShapeEnv, FakeTensorMode over it), fresh: nothing shared with a capture."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    # A tensor kept as a ctx attribute is real: faked on first use.
    return shape_env, FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)


def new_symbol(shape_env: Any, name: str, hint: int | float) -> Any:
    """A fresh SymInt / SymFloat called ``name`` with ``hint``, never specialised
    on 0 or 1 (what Dynamo makes of a dynamic int or float it reads)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    source = ConstantSource(name)
    sym = shape_env.create_unspecified_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    create = shape_env.create_symintnode if type(hint) is int else shape_env.create_symfloatnode
    return create(sym, hint=hint, source=source)


def guards_on(shape_env: Any, names: dict[Any, str]) -> list[tuple[str, str]]:
    """(name, guard text) for each guard or specialisation of ``shape_env`` that
    names one of the symbols in ``names`` (symbol -> name), the guard written with
    those names."""
    found = [(guard.expr, str(guard.expr)) for guard in shape_env.guards]
    found += [(sym, f"{sym} specialized to {value}") for sym, value in shape_env.replacements.items()]
    result = []
    for expr, text in found:
        named = [names[sym] for sym in expr.free_symbols if sym in names]
        if named:
            for sym, name in names.items():
                text = re.sub(rf"\b{sym}\b", name, text)
            result.append((named[0], text))
    return result


def holds_for_sizes_above_one(shape_env: Any, names: dict[Any, str]) -> bool:
    """Whether every guard and specialisation ``shape_env`` recorded holds whatever
    sizes >= 2 its symbols (``names``) take: what fake tensors ask of any size (not
    0 or 1, non-negative), not a branch on one value or on two sizes' order. Checked
    on assignments of small, large, equal, increasing and decreasing sizes."""
    import sympy

    exprs = [guard.expr for guard in shape_env.guards]
    exprs += [sympy.Eq(sym, value) for sym, value in shape_env.replacements.items()]
    symbols = sorted(names, key=str)
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]
    assignments = [
        [2] * len(symbols),
        [1_000_003] * len(symbols),
        [primes[i % len(primes)] for i in range(len(symbols))],
        [primes[-1 - i % len(primes)] for i in range(len(symbols))],
        [10 ** (1 + i % 6) for i in range(len(symbols))],
        [10 ** (6 - i % 6) for i in range(len(symbols))],
    ]
    for values in assignments:
        mapping = dict(zip(symbols, values))
        for expr in exprs:
            if expr.free_symbols - set(mapping) or expr.xreplace(mapping) != sympy.true:
                return False
    return True


from torch.fx.experimental import symbolic_shapes as _symbolic_shapes  # noqa: E402

#: The concrete value of a SymInt (an int as is), read without guarding. torch
#: 2.12+: optimization_hint; 2.11: size_hint (the same read, for a backed symbol).
optimization_hint: Callable[[Any], int] = (
    getattr(_symbolic_shapes, "optimization_hint", None) or _symbolic_shapes.size_hint
)


def size_hints(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Concrete sizes and strides of a (possibly symbolic) capture tensor, read
    without guarding."""
    return [optimization_hint(s) for s in t.shape], [optimization_hint(s) for s in t.stride()]


def incoming_grad_metadata(ctx: Any) -> list[tuple[torch.Size, torch.dtype, torch.device]]:
    """(shape, dtype, device) of each gradient a Python node's backward receives.
    At capture, CA hands ``proxy_call_backward`` placeholders in their place."""
    return [(m.shape, m.dtype, m.device) for m in ctx._input_metadata]


# c10::ScalarType order: the dtype codes of CA's metadata tuples.
_SCALAR_TYPES = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
    torch.bool, torch.qint8, torch.quint8, torch.qint32, torch.bfloat16,
)


def tensor_from_variable_info(info: Sequence[Any], concrete: bool = False) -> torch.Tensor:
    """An empty tensor as a C++ node's ``output_info`` entry describes a forward
    output: ``(layout, device, dtype_code, sizes, requires_grad, is_empty)``, the
    metadata of the gradient its backward receives. ``concrete``: the sizes'
    hints instead of the capture's symbols (for a probe in another ShapeEnv)."""
    layout, device, dtype, sizes = info[0], info[1], info[2], info[3]
    if layout != 0 or not 0 <= dtype < len(_SCALAR_TYPES):
        raise LayoutError(f"unsupported output layout {layout} / dtype code {dtype}")
    sizes = [optimization_hint(s) for s in sizes] if concrete else list(sizes)
    return torch.empty(sizes, dtype=_SCALAR_TYPES[dtype], device=device)


def concrete(value: Any) -> Any:
    """``value`` with every SymInt / SymFloat in it replaced by its hint, read without
    guarding: capture data a private fake-tensor run may use."""
    def hint(v: Any) -> Any:
        if isinstance(v, torch.SymInt):
            return optimization_hint(v)
        return float(v.node.hint) if isinstance(v, torch.SymFloat) else v

    return pytree.tree_map(hint, value)


def outside_capture() -> Any:
    """Leave the capture's fake and proxy modes for a block (the probe's own fake
    tensors must not be traced into the CA graph), and its suppression of guards,
    which is thread-wide: the probe's ShapeEnv must record every guard."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    stack = contextlib.ExitStack()
    stack.enter_context(disable_proxy_modes_tracing())
    stack.enter_context(unset_fake_temporarily())
    stack.enter_context(_guards_recorded())
    return stack


@contextlib.contextmanager
def _guards_recorded() -> Iterator[None]:
    from torch.fx.experimental import symbolic_shapes

    prior = getattr(symbolic_shapes.TLS, "suppress_guards", False)
    symbolic_shapes.TLS.suppress_guards = False
    try:
        yield
    finally:
        symbolic_shapes.TLS.suppress_guards = prior


@functools.cache
def tensorifiable_ops() -> frozenset[Any]:
    """The ops whose float arguments the backends' tensorify pass turns into tensor
    arguments; a symbolic float reaching any other op gets specialised there
    (``torch/fx/passes/_tensorify_python_scalars.py``)."""
    from torch.fx.passes._tensorify_python_scalars import SUPPORTED_OPS

    return frozenset(SUPPORTED_OPS)


def tensorifies_python_arithmetic() -> bool:
    """Whether the tensorify pass takes a float through Python arithmetic on it
    (``ctx.k * ctx.scale``, a Dynamo graph node ``operator.mul``): torch 2.13+ lists
    the Python operators among its ops; 2.11 and 2.12 only ATen ops, so there a
    float that went through Python arithmetic is specialised (measured: one compile
    per value of ``ctx.scale`` in ``g * (ctx.k * ctx.scale)``)."""
    import operator

    return operator.mul in tensorifiable_ops()


# --- C++ argument layouts ---------------------------------------------------
# CppNode<T>::apply_with_saved packs its call as
#   (keys, *values, saved_variables, materialize_grads, has_freed_buffers,
#    needs_input_grad, output_info, is_variable_input, name)
# with one value per key, in the same order (torch/csrc/autograd/custom_function.h),
# and the functional is called as fn(grads, *those args).
CPP_NODE_TRAILING_ARGS = 7
_TAIL_OUTPUT_INFO = 3  # output_info's place after saved_variables
_INFO_SIZES = 3  # sizes' place in an output_info entry (tensor_from_variable_info)


class LayoutError(NotImplementedError):
    """A C++ call whose arguments are not laid out as this module expects."""


@dataclass(frozen=True)
class CppCall:
    """One C++ custom function's CA call arguments, parsed once where the capture
    receives them (``apply_functional``); every consumer reads these fields, and only
    this module knows how they are laid out.

    ``values``: the ``saved_data`` value of each key (a lifted SymInt/SymFloat, or a
    value CA hashed); ``saved``: the saved tensors; ``output_info``: one entry per
    forward output, the metadata of the gradient its backward receives; ``tail``:
    every argument after the saved tensors, output_info and the name among them."""

    name: str
    keys: tuple[str, ...]
    values: tuple[Any, ...]
    saved: tuple[Any, ...]
    output_info: tuple[Any, ...]
    tail: tuple[Any, ...]

    @staticmethod
    def parse(args: Sequence[Any]) -> "CppCall":
        keys = tuple(args[0])
        rest = args[1 + len(keys) :]
        if len(rest) != CPP_NODE_TRAILING_ARGS or not all(isinstance(k, str) for k in keys):
            raise LayoutError(
                f"unexpected CppNode argument layout ({len(keys)} keys, {len(rest)} trailing)"
            )
        tail = tuple(rest[1:])
        return CppCall(
            str(args[-1]), keys, tuple(args[1 : 1 + len(keys)]), tuple(rest[0]), tuple(tail[_TAIL_OUTPUT_INFO]), tail
        )

    def args(self, values: Sequence[Any] | None = None, saved: Sequence[Any] | None = None) -> tuple[Any, ...]:
        """The call's arguments in CA's layout, the saved values or tensors replaced."""
        return (
            list(self.keys),
            *(self.values if values is None else values),
            list(self.saved if saved is None else saved),
            *self.tail,
        )

    def call(self, fn: Callable[..., Any], grads: Sequence[Any], **parts: Any) -> Any:
        """The functional on ``grads`` with this call's arguments (``parts`` as for
        ``args``): what CA's graph runs for the node."""
        return fn(list(grads), *self.args(**parts))

    def detached(self) -> "CppCall":
        """The call without its saved values and tensors, every symbol in it replaced
        by its hint: what a call outside the capture fills in (``values=``,
        ``saved=``)."""
        return CppCall(self.name, self.keys, (), (), tuple(concrete(self.output_info)), tuple(concrete(self.tail)))

    def with_output_sizes(self, sizes: Sequence[Sequence[int] | None]) -> "CppCall":
        """The call with each output_info entry's sizes replaced (None keeps an
        entry's): an undefined incoming grad is made of those sizes."""
        tail = list(self.tail)
        tail[_TAIL_OUTPUT_INFO] = [
            info if s is None else (*info[:_INFO_SIZES], list(s), *info[_INFO_SIZES + 1 :])
            for info, s in zip(self.output_info, sizes)
        ]
        return CppCall(self.name, self.keys, self.values, self.saved, tuple(tail[_TAIL_OUTPUT_INFO]), tuple(tail))


def cpp_node_name(args: Sequence[Any]) -> str:
    """The node's name (``torch::autograd::CppNode<T>``), the call's last argument:
    readable even when the rest of the layout is not."""
    return str(args[-1])


# Input metadata of the next edges, as given to validate_outputs:
#   ((requires_grad, memory_format, device, dtype_code, layout, pinned),
#    sizes, is_subclass, grad_dtype)            or None for an invalid edge.
def metadata_sizes(meta: Any) -> tuple[Any, ...]:
    return tuple(meta[1])


def metadata_device(meta: Any) -> torch.device:
    return meta[0][2]


__all__ = [
    "TESTED_TORCH_RELEASES",
    "UnsupportedTorchError",
    "StockCompilerInstance",
    "ca",
    "counters",
    "check_torch_version",
]
