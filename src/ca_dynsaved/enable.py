"""``ca_dynsaved.enable``: context manager and decorator."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import torch

from ._install import PLUGIN, ca_context


class enable(contextlib.ContextDecorator):
    """Compiled autograd with saved ints/floats of custom functions as dynamic inputs.

    ``compiler_fn`` is used as is (like ``torch._dynamo.compiled_autograd._enable``);
    without it, each CA graph is compiled with
    ``torch.compile(graph, backend=backend, fullgraph=fullgraph)``. Usable as a
    context manager around ``.backward()`` or as a decorator on a training step;
    the same object may be re-entered and nested.

    ``exclude``: substrings of C++ custom-function names (``"MyFunction"`` matches
    ``torch::autograd::CppNode<MyFunction>``) whose nodes keep stock behaviour.
    """

    def __init__(
        self,
        compiler_fn: Callable[[torch.fx.GraphModule], Callable[..., Any]] | None = None,
        *,
        backend: str | Callable[..., Any] = "inductor",
        fullgraph: bool = False,
        dynamic: bool = True,
        exclude: Iterable[str] = (),
    ) -> None:
        if compiler_fn is None:

            def compiler_fn(gm: torch.fx.GraphModule) -> Callable[..., Any]:
                return torch.compile(gm, backend=backend, fullgraph=fullgraph)

        self.compiler_fn = compiler_fn
        self.dynamic = dynamic
        self.exclude = frozenset(exclude)
        self._open: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> "enable":
        cm = ca_context(self.compiler_fn, self.dynamic, mode=PLUGIN, exclude=self.exclude)
        cm.__enter__()
        self._open.append(cm)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._open.pop().__exit__(*exc)
