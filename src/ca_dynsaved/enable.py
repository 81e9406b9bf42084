"""``ca_dynsaved.enable``: context manager and decorator."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from . import pyctx
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
    """Raise as ``torch.compile`` does for these arguments. About 1.5 ms (it copies
    inductor's config), so once per distinct set: a training step may build its
    ``enable`` at every step."""
    torch.compile(_never_called, **compile_.kwargs())


class enable(contextlib.ContextDecorator):
    """Compiled autograd with saved ints/floats of custom functions as dynamic inputs.

    ``compiler_fn`` is used as is (like ``torch._dynamo.compiled_autograd._enable``);
    without it, each CA graph is compiled with ``torch.compile(graph,
    backend=backend, mode=mode, options=options, dynamic=dynamic,
    fullgraph=fullgraph)``, arguments that mean what they mean to ``torch.compile``
    and are checked by it here, so a misspelt mode or option fails at ``enable()``
    rather than in the first backward. ``mode="reduce-overhead"`` gives CUDA graphs:
    the plugin's ops are tagged so that inductor never records them into one (README,
    "GPU and CUDA graphs").

    ``dynamic``: None (the default) captures sizes symbolically, as
    ``compiled_autograd._enable`` does, and lets ``torch.compile`` choose (automatic
    dynamic); True or False is passed both to compiled autograd's capture and to
    ``torch.compile``, as ``torch.compile(dynamic=...)`` passes it when
    ``torch._dynamo.config.compiled_autograd`` is on. With ``compiler_fn``, only the
    capture gets it.

    Usable as a context manager around ``.backward()`` or as a decorator on a
    training step; the same object may be re-entered and nested.

    ``exclude``: substrings of custom-function names (``"MyFunction"`` matches
    ``torch::autograd::CppNode<MyFunction>`` and a Python ``MyFunction``) whose
    nodes keep stock behaviour. ``python_policy``: ``"auto"``, ``"opaque"`` or ``"stock"`` for
    Python ``autograd.Function`` nodes (see ``ca_dynsaved.pyctx``); None reads
    ``torch._dynamo.config.compiled_autograd_dynamic_saved_data_python_policy``.

    ``trace_cpp``: substrings of C++ function names whose backward, you assert, uses
    its saved ints/doubles read with ``toInt()``/``toDouble()`` only as ATen op
    arguments: such nodes are traced and fused instead of run opaque, after a
    two-sentinel check that refuses (with a warning) what it can see
    (``ca_dynsaved.sentinel``). ``verify`` (on by default) re-checks each new
    value of those nodes on small tensors before the compiled graph uses it, and runs
    the step with the node called directly when the check refuses: what the
    sentinels cannot see (a branch both take the same way) never gives a wrong
    gradient. ``verify=False`` trusts the assertion and skips that cost. None reads
    the config entries ``..._trace_cpp`` / ``..._verify``.
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
        self.python_policy = None if python_policy is None else pyctx.check_policy(python_policy)
        self.trace_cpp = None if trace_cpp is None else frozenset(_names(trace_cpp, "trace_cpp"))
        self.verify = verify
        self._open: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> "enable":
        mode = plugin_mode(self.exclude, self.python_policy, self.trace_cpp, self.verify)
        cm = ca_context(self.compiler_fn, self.dynamic, mode=mode)
        cm.__enter__()
        self._open.append(cm)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._open.pop().__exit__(*exc)
