"""The runtime wrapper of a plugin CA graph: what each run needs, and which code runs.

* Scalars: CA passes the lifted ``saved_data`` ints and doubles as a list of Python
  numbers (the ``scalars`` placeholder). Dynamo guards on a Python number it reads,
  so the opaque ops never read them: the wrapper appends two tensors (all lifted
  ints as int64, all lifted doubles as float64) that the ops read. Dynamo then
  guards only on their metadata, which is fixed for a CA graph.
* Bound data: CA's ``hooks`` (where the Python ctx objects are) and the capture's
  ``NodeCapture``s (hashed values, C++ functionals), for the ops to read.
* Which code: whether a backward leaves a gradient undefined cannot be seen at
  capture, so the first run of a capture is the captured graph run eagerly; it
  records those gradients, which then become part of the graph (``reuse.py``), and
  later runs use the compiled function of that graph, or of an equal one compiled
  for another capture. A backward with ``create_graph=True`` (grad mode on inside
  CA) must record the backward's own autograd history, which an opaque op without
  a derivative cuts; CA's cache does not tell such calls apart, so those calls run
  the captured graph eagerly with each opaque op replaced by a direct call.
"""

from __future__ import annotations

import array
import logging
from typing import Any, Callable, Sequence

import torch
from torch._dynamo.utils import counters

from . import _compat, opaque, reuse
from .report import CaptureRecord


log = logging.getLogger("ca_dynsaved")


def pack(values: Sequence[Any], kinds: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Split lifted scalar ``values`` by capture-time kind into int64 and float64 tensors."""
    ints = array.array("q")
    floats = array.array("d")
    for value, kind in zip(values, kinds):
        # An int64 slot would silently truncate a float.
        if type(value) is not (int if kind is opaque.INT else float):
            raise TypeError(
                f"ca_dynsaved: lifted saved value {value!r} was a {kind} at capture"
            )
        (ints if kind is opaque.INT else floats).append(value)
    # frombuffer over an array (the tensor keeps it alive) is 4x cheaper than
    # torch.tensor(list); it refuses an empty buffer.
    return (
        torch.frombuffer(ints, dtype=torch.int64) if ints else _EMPTY_INTS,
        torch.frombuffer(floats, dtype=torch.float64) if floats else _EMPTY_FLOATS,
    )


_EMPTY_INTS = torch.empty(0, dtype=torch.int64)
_EMPTY_FLOATS = torch.empty(0, dtype=torch.float64)


def make_runtime_wrapper(
    runtime_wrapper: Callable[..., Any],
    graph_module: torch.fx.GraphModule,
    kinds: Sequence[str] | None,
    nodes: list[opaque.NodeCapture],
    record: CaptureRecord,
    compiler_fn: Callable[..., Any],
    dynamic_sources: Sequence[str] = (),
) -> Callable[..., Any]:
    """Wrap CA's runtime wrapper for a captured graph with opaque ops for ``nodes``;
    ``kinds`` (one per lifted scalar) when C++ opaque ops read packed scalars;
    ``dynamic_sources``: the scalars Dynamo must treat as dynamic (traced Python
    ctx numbers), re-marked when the graph's code is regenerated."""
    kinds = None if kinds is None else tuple(kinds)
    compiled: list[Callable[..., Any]] = []  # set once every node has run

    @torch.compiler.disable
    def wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        record.observe(scalars, hooks)
        if kinds is not None:
            if len(scalars) != len(kinds):
                raise RuntimeError(
                    f"ca_dynsaved: CA graph captured with {len(kinds)} lifted scalars, "
                    f"called with {len(scalars)}"
                )
            scalars = [*scalars, *pack(scalars, kinds)]
        if not nodes:  # nothing opaque: the graph as captured (traced C++ nodes may
            # read the packed floats)
            return runtime_wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs)
        if not compiled and all(node.defined is not None for node in nodes):
            reuse.name_undefined_outputs(graph_module, nodes)  # new code: mark it again
            _compat.mark_dynamic_scalars(graph_module.forward.__code__, dynamic_sources)
            fn, record.compiled = reuse.compiled_for(graph_module, compiled_fn, compiler_fn)
            compiled.append(fn)
            log.info("capture !%d: first run done; %s code", record.ca_id, record.compiled)
        if torch.is_grad_enabled():
            counters["ca_dynsaved"]["create_graph_eager_runs"] += 1
            fn = _Differentiable(graph_module).run_to_list
        elif compiled:
            fn = compiled[0]
        else:
            counters["ca_dynsaved"]["first_eager_runs"] += 1
            fn = graph_module
        with opaque.bound_run(hooks, nodes):
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
