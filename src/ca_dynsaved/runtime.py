"""The runtime wrapper of a plugin CA graph: scalar packing, hooks, first runs.

CA passes the lifted ``saved_data`` ints and doubles as a list of Python numbers
(the ``scalars`` placeholder). Dynamo guards on a Python number it reads, so the
opaque ops never read them: the wrapper appends two tensors (all lifted ints as
int64, all lifted doubles as float64) and the ops read those. Dynamo then guards
only on the tensors' metadata, which is fixed for a CA graph. The wrapper also
binds CA's ``hooks`` (the Python ctx objects) for ``py_function``.

Whether a backward leaves a gradient undefined cannot be seen at capture, so until
every opaque node of the graph has run once, the wrapper runs the captured graph
eagerly; the compiled graph is then traced knowing which outputs are None.

A backward with ``create_graph=True`` (grad mode on inside CA) must record the
backward's own autograd history, which an opaque op without a derivative cuts;
CA's cache does not tell such calls apart, so the wrapper runs those calls through
the captured graph eagerly with each opaque op replaced by a direct call.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch._dynamo.utils import counters

from . import opaque


def pack(values: Sequence[Any], kinds: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Split lifted scalar ``values`` by capture-time kind into int64 and float64 tensors."""
    ints: list[int] = []
    floats: list[float] = []
    for value, kind in zip(values, kinds):
        # torch.tensor would silently truncate a float into an int64 slot.
        if type(value) is not (int if kind is opaque.INT else float):
            raise TypeError(
                f"ca_dynsaved: lifted saved value {value!r} was a {kind} at capture"
            )
        (ints if kind is opaque.INT else floats).append(value)
    return (
        torch.tensor(ints, dtype=torch.int64),
        torch.tensor(floats, dtype=torch.float64),
    )


def make_runtime_wrapper(
    runtime_wrapper: Callable[..., Any],
    graph_module: torch.fx.GraphModule,
    kinds: Sequence[str] | None,
    keys: Sequence[str],
) -> Callable[..., Any]:
    """Wrap CA's runtime wrapper for a graph holding opaque ops with ``keys``;
    ``kinds`` (one per lifted scalar) when C++ opaque ops read packed scalars."""
    kinds = None if kinds is None else tuple(kinds)
    pending = set(keys)

    @torch._dynamo.disable
    def wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        if kinds is not None:
            if len(scalars) != len(kinds):
                raise RuntimeError(
                    f"ca_dynsaved: CA graph captured with {len(kinds)} lifted scalars, "
                    f"called with {len(scalars)}"
                )
            scalars = [*scalars, *pack(scalars, kinds)]
        if torch.is_grad_enabled():
            counters["ca_dynsaved"]["create_graph_eager_runs"] += 1
            fn = _Differentiable(graph_module).run_to_list
        else:
            if pending:
                pending.difference_update([k for k in pending if opaque.is_learned(k)])
            if pending:
                counters["ca_dynsaved"]["first_eager_runs"] += 1
                fn = graph_module
            else:
                fn = compiled_fn
        with opaque.bound_hooks(hooks):
            return runtime_wrapper(fn, inputs, sizes, scalars, hooks, packed_inputs)

    return wrapper


class _Differentiable(torch.fx.Interpreter):
    """Runs a CA graph calling the backwards directly, so autograd records them."""

    def run_to_list(self, *args: Any) -> list[Any]:
        # C++ wants a plain list; the interpreter returns FX's immutable_list.
        return list(self.run(*args))

    def call_function(self, target, args, kwargs):  # type: ignore[no-untyped-def,override]
        runner = opaque.RUNNERS.get(target)
        if runner is not None:
            return runner(*args, **kwargs)
        return super().call_function(target, args, kwargs)
