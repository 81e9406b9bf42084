"""``ca_dynsaved.enable``: context manager and decorator."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from . import policies
from ._install import _names, ca_context, plugin_mode


@dataclass(frozen=True)
class TorchCompile:
    """``torch.compile(graph, backend=..., mode=..., options=..., dynamic=...,
    fullgraph=...)`` for each CA graph.

    Equal by value, so that code compiled under one ``enable`` object is reused under
    another (reuse.py); ``options`` is kept as sorted items and hashed by ``repr``
    because an inductor option's value may be a list."""

    backend: str | Callable[..., Any] = "inductor"
    fullgraph: bool = False
    dynamic: bool | None = None
    mode: str | None = None
    options: tuple[tuple[str, Any], ...] | None = None

    def __hash__(self) -> int:
        return hash((self.backend, self.fullgraph, self.dynamic, self.mode, repr(self.options)))

    def kwargs(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
            "mode": self.mode,
            "options": None if self.options is None else dict(self.options),
        }

    def __call__(self, gm: torch.fx.GraphModule) -> Callable[..., Any]:
        return torch.compile(gm, **self.kwargs())


def _never_called() -> None:
    """What ``enable`` hands ``torch.compile`` to have it check its arguments."""


@functools.lru_cache(maxsize=64)
def _check(compile_: TorchCompile) -> None:
    """Raise as ``torch.compile`` does for these arguments. It copies inductor's
    config (docs/benchmarks.md, "Component costs"), so once per distinct set: a
    training step may build its ``enable`` at every step."""
    torch.compile(_never_called, **compile_.kwargs())


class enable(contextlib.ContextDecorator):
    """Compiled autograd with saved ints/floats of custom functions as dynamic inputs.

    A context manager around ``.backward()`` or a decorator on a training step:
    inside, backwards run under compiled autograd (CA) with the plugin, so new values
    of a custom function's saved ints/floats (C++ ``ctx->saved_data``, Python
    ``ctx.k``) never recompile the backward. ``with ... as e`` gives the object; it
    may be re-entered and nested (a context holds a lock: two threads' contexts run
    one after the other). Leaving the outermost one restores stock behaviour: CA's
    global state is as before, and backwards run as they did (eager, or stock CA).
    While the plugin is off (``off_reason()``) it gives stock compiled autograd.

    Args:
        compiler_fn: ``fn(torch.fx.GraphModule) -> callable``, used as is for each CA
            graph (like ``torch._dynamo.compiled_autograd._enable``'s). Default None:
            ``torch.compile(graph, backend=, mode=, options=, dynamic=, fullgraph=)``
            with the arguments below, which mean what they mean to ``torch.compile``.
        backend: ``torch.compile``'s backend, a name or callable. Default "inductor".
        mode: ``torch.compile``'s mode. Default None. ``"reduce-overhead"`` gives CUDA
            graphs; the plugin's ops are tagged so inductor never records them into one.
        options: ``torch.compile``'s options (inductor config dict). Default None.
        dynamic: None (default) captures sizes symbolically, as ``_enable`` does, and
            lets ``torch.compile`` choose; True or False goes to both the capture and
            ``torch.compile``, as ``torch.compile(dynamic=...)`` passes it on the
            config path (with ``compiler_fn``, to the capture only).
        fullgraph: ``torch.compile``'s fullgraph. Default False.
        exclude: substrings of custom-function names whose nodes keep stock
            behaviour (``"MyFunction"`` matches ``torch::autograd::CppNode<MyFunction>``
            and a Python ``MyFunction``); a str is one name. Default ().
        python_policy: for Python ``autograd.Function`` nodes: ``"auto"`` traces a
            function whose ctx numbers only reach tensor math, numbers dynamic, and
            runs one that would specialise on them opaque; ``"opaque"`` runs every
            function with an int/float ctx attribute opaque (no fusion); under both,
            a backward Dynamo cannot trace runs opaque too; ``"stock"`` leaves all
            to stock CA. Default None: the config entry (itself "auto" by default).
        cpp_policy: for C++ ``torch::autograd::Function`` nodes: ``"auto"`` traces a
            traceable function whose saved ints/doubles reach only ATen op arguments
            (read with ``toSymInt()``/``toSymFloat()``, or with ``toInt()``/
            ``toDouble()`` through two sentinel traces, each new value verified on
            small tensors before the compiled graph uses it) and runs the rest
            opaque; ``"opaque"`` runs every traceable one opaque (no fusion);
            ``"stock"`` leaves all to stock CA. ``trace_cpp`` names are traced under
            any policy. Default None: the config entry (itself "auto").
        trace_cpp: substrings of C++ function names whose backward, you assert, uses
            its saved ints/doubles only as ATen op arguments: traced under any
            ``cpp_policy``, a refusal of the two-sentinel check warns, and
            ``verify=False`` may skip the per-value check.
            Default None: the config entry (itself () by default).
        verify: for ``trace_cpp`` nodes, re-check each new tuple of saved values on
            small tensors before the compiled graph uses it; a refused step runs the
            node directly, eagerly. False trusts the assertion (a wrong one then
            gives wrong gradients). Nodes ``"auto"`` traces without being named are
            always verified. Default None: the config entry (itself True).

    Raises:
        TypeError: ``compiler_fn`` with a non-default ``backend``, ``mode``,
            ``options`` or ``fullgraph`` (it replaces ``torch.compile``); an
            ``exclude``/``trace_cpp`` entry that is not a non-empty str.
        ValueError: an unknown ``python_policy`` or ``cpp_policy``.
        torch.compile's errors, at ``enable()`` rather than in the first backward:
        ``RuntimeError`` for a misspelt mode or option, ``InvalidBackend``.

    Config entries (registered on import; the ``CONFIG_*`` constants hold the names;
    read each time a context is entered):
        ``torch._dynamo.config.compiled_autograd_dynamic_saved_data`` (bool, default
            False): on, a CA context opened without ``enable`` (Dynamo's config path,
            ``torch._dynamo.config.compiled_autograd = True``, or a direct
            ``compiled_autograd._enable``) captures with the plugin; off: stock CA.
        ``torch._dynamo.config.compiled_autograd_dynamic_saved_data_python_policy``
            (str, default "auto"): the ``python_policy`` of the config path and of
            ``enable(python_policy=None)``.
        ``torch._dynamo.config.compiled_autograd_dynamic_saved_data_trace_cpp``
            (tuple of str, default (); a str is one name): the ``trace_cpp`` of the
            config path and of ``enable(trace_cpp=None)``.
        ``torch._dynamo.config.compiled_autograd_dynamic_saved_data_verify``
            (bool, default True): the ``verify`` of the config path and of
            ``enable(verify=None)``.
        ``torch._dynamo.config.compiled_autograd_dynamic_saved_data_cpp_policy``
            (str, default "auto"): the ``cpp_policy`` of the config path and of
            ``enable(cpp_policy=None)``.

    Example::

        with ca_dynsaved.enable(backend="inductor", exclude=["MyFunction"]):
            loss.backward()

        @ca_dynsaved.enable(backend="aot_eager", trace_cpp=["ScaleFn"], verify=True)
        def train_step(batch):
            model(batch).sum().backward()

        # the config path: torch.compile'd steps, no enable()
        torch._dynamo.config.compiled_autograd = True
        torch._dynamo.config.compiled_autograd_dynamic_saved_data = True
    """

    def __init__(
        self,
        compiler_fn: Callable[[torch.fx.GraphModule], Callable[..., Any]] | None = None,
        *,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
        dynamic: bool | None = None,
        fullgraph: bool = False,
        exclude: Iterable[str] = (),
        python_policy: str | None = None,
        trace_cpp: Iterable[str] | None = None,
        verify: bool | None = None,
        cpp_policy: str | None = None,
    ) -> None:
        if compiler_fn is not None:
            given = [
                name
                for name, value, default in (
                    ("backend", backend, "inductor"),
                    ("mode", mode, None),
                    ("options", options, None),
                    ("fullgraph", fullgraph, False),
                )
                if value != default
            ]
            if given:
                raise TypeError(
                    f"ca_dynsaved.enable: {', '.join(given)} {'is' if len(given) == 1 else 'are'}"
                    " torch.compile's, and a given compiler_fn replaces torch.compile; pass "
                    "one or the other"
                )
            self.compiler_fn = compiler_fn
        else:
            compile_ = TorchCompile(
                backend,
                fullgraph,
                dynamic,
                mode,
                None if options is None else tuple(sorted(options.items())),
            )
            _check(compile_)
            self.compiler_fn = compile_
        # The capture's own `dynamic` (symbolic sizes): compiled_autograd._enable's
        # default unless asked.
        self.dynamic = True if dynamic is None else dynamic
        self.exclude = frozenset(_names(exclude, "exclude"))
        self.python_policy = None if python_policy is None else policies.check(python_policy)
        self.trace_cpp = None if trace_cpp is None else frozenset(_names(trace_cpp, "trace_cpp"))
        self.verify = verify
        self.cpp_policy = None if cpp_policy is None else policies.check(cpp_policy, "cpp_policy")
        self._open: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> "enable":
        mode = plugin_mode(self.exclude, self.python_policy, self.trace_cpp, self.verify, self.cpp_policy)
        cm = ca_context(self.compiler_fn, self.dynamic, mode=mode)
        cm.__enter__()
        self._open.append(cm)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._open.pop().__exit__(*exc)
