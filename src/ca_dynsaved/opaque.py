"""The opaque custom ops that run a custom-function backward inside a CA graph.

Dynamo traces a custom function's backward while compiling the CA graph, and the
backward's ``toInt()`` / ``ctx.k`` then guard on every saved value. Calling the
backward through an opaque ``torch.library`` op instead means Dynamo only sees the
op's fake impl (outputs built from the next edges' metadata): it installs no guard
on saved values and breaks no graph for non-traceable C++ functions.

* ``ca_dynsaved::cpp_function`` runs a C++ ``torch::autograd::Function``; its
  lifted ints and doubles arrive packed in two tensors (see ``runtime.py``).
* ``ca_dynsaved::py_function`` runs a Python ``autograd.Function`` backward with
  its real ctx, taken from CA's ``hooks`` list of this run (``bound_hooks``).

Per-node data that is not a graph value (constants, argument structure, the C++
functional) lives in a process-local registry keyed by a content hash; the graph
carries only that key. Every fresh process refills the registry from the CA
capture it has to do first.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from . import _compat

# Leaf kinds of a node's flattened (call args, output metadata).
CONST, TENSOR, INT, FLOAT, SYMINT = "const", "tensor", "int", "float", "symint"


@dataclass(frozen=True)
class NodeSpec:
    """Everything about one custom-function call that is fixed for a CA graph."""

    name: str  # node name, for messages
    fn: Callable[..., Any] | None  # C++: CppNode_apply_functional_ivalue<T>; Python: None
    treedef: pytree.TreeSpec  # structure of (call args, output metadata)
    leaves: tuple[tuple[str, Any], ...]  # (kind, constant or slot index)
    out_defined: tuple[bool, ...]  # False where the next edge is invalid (no grad needed)


_REGISTRY: dict[str, NodeSpec] = {}

# key -> which outputs the compiled graph treats as defined. Learned from the first
# (eager) run of a CA graph, or fixed by the fake impl if Dynamo traces first; the
# real impl then checks every later call against it.
_DEFINED: dict[str, tuple[bool, ...]] = {}


def register(spec: NodeSpec) -> str:
    """Store ``spec`` under a key derived from its content; return the key."""
    text = repr((spec.name, spec.fn is None, str(spec.treedef), spec.leaves, spec.out_defined))
    key = hashlib.sha1(text.encode()).hexdigest()[:20]
    _REGISTRY[key] = spec
    return key


def is_learned(key: str) -> bool:
    return key in _DEFINED


def registry_size() -> int:
    return len(_REGISTRY)


def clear() -> None:
    """Forget every node spec (only safe when no plugin CA graph is cached)."""
    _REGISTRY.clear()
    _DEFINED.clear()


def _rebuild(spec: NodeSpec, tensors, ints, floats, symints) -> tuple[Any, Any]:  # type: ignore[no-untyped-def]
    """(call args, output metadata) of ``spec`` with this call's values filled in."""
    slots = {TENSOR: tensors, INT: ints, FLOAT: floats, SYMINT: symints}
    values = [payload if kind is CONST else slots[kind][payload] for kind, payload in spec.leaves]
    return pytree.tree_unflatten(values, spec.treedef)


# --- the hooks of the CA graph being run -------------------------------------------
_local = threading.local()


@contextlib.contextmanager
def bound_hooks(hooks: Sequence[Any]) -> Iterator[None]:
    """Make this run's CA ``hooks`` (which hold the Python ctx objects) visible to
    ``py_function``: a custom op cannot take a Python object as an argument."""
    prior = getattr(_local, "hooks", None)
    _local.hooks = hooks
    try:
        yield
    finally:
        _local.hooks = prior


# --- real impls ----------------------------------------------------------------------
class UndefinedGradError(RuntimeError):
    """A backward left a different set of gradients undefined than the graph expects."""


@torch._dynamo.disable
def run_cpp(grads, tensors, ints, floats, symints, key):  # type: ignore[no-untyped-def]
    # Excluded from Dynamo: this runs inside backward, which may run inside a
    # compiled frame, and a traced copy would freeze the saved values it read.
    spec = _REGISTRY[key]
    int_values, float_values = ints.tolist(), floats.tolist()
    args, out_meta = _rebuild(spec, tensors, int_values, float_values, symints)
    outs = spec.fn(list(grads), *args)  # type: ignore[misc]
    return _finish(
        key, spec, outs, out_meta, (*grads, *tensors),
        lambda: f"saved ints {int_values}, floats {float_values}",
    )


@torch._dynamo.disable
def run_python(grads, saved, symints, key, hook):  # type: ignore[no-untyped-def]
    spec = _REGISTRY[key]
    hooks = getattr(_local, "hooks", None)
    if hooks is None:
        raise RuntimeError(f"ca_dynsaved: {spec.name} run outside the runtime wrapper of its CA graph")
    ctx = hooks[hook]
    (positions,), out_meta = _rebuild(spec, saved, (), (), symints)
    outs = _compat.call_backward(ctx, list(saved), *grads)
    for i, out in enumerate(outs):
        if out is not None and i not in positions:
            # The engine's own error for this case.
            raise RuntimeError(
                f"function {spec.name}Backward returned a gradient different than None at "
                f"position {i + 1}, but the corresponding forward input was not a Variable"
            )
    outs = [outs[i] if i < len(outs) else None for i in positions]
    return _finish(key, spec, outs, out_meta, (*grads, *saved), lambda: f"ctx attributes {vars(ctx)}")


def _finish(key, spec, outs, out_meta, inputs, describe_saved):  # type: ignore[no-untyped-def]
    """Check undefined grads against the graph, validate as the engine does, and
    return outputs a custom op may return (contiguous, not aliasing an input).
    ``describe_saved()`` names the saved values, for the error message only."""
    outs = list(outs) + [None] * (len(spec.out_defined) - len(outs))
    defined = tuple(v and outs[i] is not None for i, v in enumerate(spec.out_defined))
    expected = _DEFINED.setdefault(key, defined)
    if defined != expected:
        raise UndefinedGradError(_undefined_message(spec, expected, defined, describe_saved()))
    validated = _compat.validate_outputs_fn()(
        [o if d else None for o, d in zip(outs, defined)], out_meta
    )
    storages = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    result: list[torch.Tensor | None] = []
    for out, d in zip(validated, defined):
        if not d:
            result.append(None)
            continue
        out = out.contiguous()
        # Backward often returns the incoming grad as is; a custom op may not.
        if out.untyped_storage().data_ptr() in storages:
            out = out.clone()
        result.append(out)
    return result


def _undefined_message(spec, expected, got, saved_desc) -> str:  # type: ignore[no-untyped-def]
    slots = [i for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    return (
        f"ca_dynsaved: {spec.name} returned "
        + ", ".join(
            f"{'an undefined' if not got[i] else 'a defined'} gradient for input {i}"
            for i in slots
        )
        + f" ({saved_desc}), but on the run its compiled graph was built from it was "
        "the opposite: whether a gradient is None depends on saved values, which one "
        "compiled graph cannot express. Return a zero gradient instead of None, or "
        "keep this node stock with enable(exclude=[...])."
    )


# --- the ops -------------------------------------------------------------------------
@torch.library.custom_op(
    "ca_dynsaved::cpp_function",
    mutates_args=(),
    schema="(Tensor?[] grads, Tensor?[] tensors, Tensor ints, Tensor floats, "
    "SymInt[] symints, str key) -> Tensor?[]",
)
def _cpp_function(grads, tensors, ints, floats, symints, key):  # type: ignore[no-untyped-def]
    return run_cpp(grads, tensors, ints, floats, symints, key)


@torch.library.custom_op(
    "ca_dynsaved::py_function",
    mutates_args=(),
    schema="(Tensor?[] grads, Tensor?[] saved, SymInt[] symints, str key, int hook) -> Tensor?[]",
)
def _py_function(grads, saved, symints, key, hook):  # type: ignore[no-untyped-def]
    return run_python(grads, saved, symints, key, hook)


def _fake_outputs(key: str, tensors, symints) -> list[torch.Tensor | None]:  # type: ignore[no-untyped-def]
    spec = _REGISTRY[key]
    defined = _DEFINED.setdefault(key, spec.out_defined)
    # Saved values only feed the call args; the output metadata never holds one.
    _, out_meta = _rebuild(spec, tensors, defaultdict(int), defaultdict(float), symints)
    outs: list[torch.Tensor | None] = []
    for d, meta in zip(defined, out_meta):
        if not d:
            outs.append(None)
            continue
        empty = torch.empty(_compat.metadata_sizes(meta), device=_compat.metadata_device(meta))
        # validate_outputs gives the dtype (and layout) eager's engine would.
        outs.append(_compat.validate_outputs_fn()([empty], [meta])[0].contiguous())
    return outs


@_cpp_function.register_fake
def _(grads, tensors, ints, floats, symints, key):  # type: ignore[no-untyped-def]
    return _fake_outputs(key, tensors, symints)


@_py_function.register_fake
def _(grads, saved, symints, key, hook):  # type: ignore[no-untyped-def]
    return _fake_outputs(key, saved, symints)


#: The OpOverloads CA graphs call.
CPP_OP = torch.ops.ca_dynsaved.cpp_function.default
PY_OP = torch.ops.ca_dynsaved.py_function.default
#: Direct (differentiable) runners, used when a graph runs with create_graph=True.
RUNNERS = {CPP_OP: run_cpp, PY_OP: run_python}
