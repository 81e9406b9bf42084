"""``ca_dynsaved.enable``: context manager and decorator."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from . import pyctx
from ._install import ca_context, plugin_mode


@dataclass(frozen=True)
class TorchCompile:
    """``torch.compile(graph, backend=..., fullgraph=...)``, equal by value so that
    code compiled under one ``enable`` object is reused under another (reuse.py)."""

    backend: str | Callable[..., Any]
    fullgraph: bool

    def __call__(self, gm: torch.fx.GraphModule) -> Callable[..., Any]:
        return torch.compile(gm, backend=self.backend, fullgraph=self.fullgraph)


class enable(contextlib.ContextDecorator):
    """Compiled autograd with saved ints/floats of custom functions as dynamic inputs.

    ``compiler_fn`` is used as is (like ``torch._dynamo.compiled_autograd._enable``);
    without it, each CA graph is compiled with
    ``torch.compile(graph, backend=backend, fullgraph=fullgraph)``. Usable as a
    context manager around ``.backward()`` or as a decorator on a training step;
    the same object may be re-entered and nested.

    ``exclude``: substrings of custom-function names (``"MyFunction"`` matches
    ``torch::autograd::CppNode<MyFunction>`` and a Python ``MyFunction``) whose
    nodes keep stock behaviour. ``python_policy``: ``"opaque"`` or ``"stock"`` for
    Python ``autograd.Function`` nodes (see ``ca_dynsaved.pyctx``); None reads
    ``torch._dynamo.config.compiled_autograd_dynamic_saved_data_python_policy``.
    """

    def __init__(
        self,
        compiler_fn: Callable[[torch.fx.GraphModule], Callable[..., Any]] | None = None,
        *,
        backend: str | Callable[..., Any] = "inductor",
        fullgraph: bool = False,
        dynamic: bool = True,
        exclude: Iterable[str] = (),
        python_policy: str | None = None,
    ) -> None:
        self.compiler_fn = compiler_fn or TorchCompile(backend, fullgraph)
        self.dynamic = dynamic
        self.exclude = frozenset(exclude)
        self.python_policy = None if python_policy is None else pyctx.check_policy(python_policy)
        self._open: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> "enable":
        mode = plugin_mode(self.exclude, self.python_policy)
        cm = ca_context(self.compiler_fn, self.dynamic, mode=mode)
        cm.__enter__()
        self._open.append(cm)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._open.pop().__exit__(*exc)
