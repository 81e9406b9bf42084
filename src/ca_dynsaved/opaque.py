"""The one opaque custom op that runs a C++ custom-function backward.

Dynamo fake-runs a traceable C++ ``backward`` while compiling the CA graph, and the
user's ``toInt()``/``toDouble()`` then guard on every saved value. Calling the
backward through an opaque ``torch.library`` op instead means Dynamo only sees the
op's fake impl (outputs built from the next edges' metadata), so it installs no
guard on saved values and breaks no graph for non-traceable functions.

Per-node data that is not a graph value (keys, constants, argument structure, the
C++ functional itself) lives in a process-local registry keyed by a content hash;
the graph carries only that key. Every fresh process refills the registry from the
CA capture it has to do first.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from . import _compat

# Leaf kinds of a node's flattened (call args, output metadata).
CONST, TENSOR, INT, FLOAT, SYMINT = "const", "tensor", "int", "float", "symint"

OP_QUALNAME = "ca_dynsaved::cpp_function"
_SCHEMA = (
    "(Tensor?[] grads, Tensor?[] tensors, Tensor ints, Tensor floats, "
    "SymInt[] symints, str key) -> Tensor?[]"
)


@dataclass(frozen=True)
class NodeSpec:
    """Everything about one C++ node call that is fixed for a CA graph."""

    name: str  # C++ node name, for messages
    fn: Callable[..., Any]  # CppNode_apply_functional_ivalue<T>
    treedef: pytree.TreeSpec  # structure of (args, output metadata)
    leaves: tuple[tuple[str, Any], ...]  # (kind, constant or slot index)
    out_defined: tuple[bool, ...]  # False where the next edge is invalid (no grad needed)


_REGISTRY: dict[str, NodeSpec] = {}


def register(spec: NodeSpec) -> str:
    """Store ``spec`` under a key derived from its content; return the key."""
    text = repr((spec.name, str(spec.treedef), spec.leaves, spec.out_defined))
    key = hashlib.sha1(text.encode()).hexdigest()[:20]
    _REGISTRY[key] = spec
    return key


def registry_size() -> int:
    return len(_REGISTRY)


def clear() -> None:
    """Forget every node spec (only safe when no plugin CA graph is cached)."""
    _REGISTRY.clear()
    _DEFINED.clear()


def _rebuild(spec: NodeSpec, tensors, ints, floats, symints) -> tuple[Any, Any]:
    """(call args, output metadata) of ``spec`` with this call's values filled in."""
    slots = {TENSOR: tensors, INT: ints, FLOAT: floats, SYMINT: symints}
    values = [payload if kind is CONST else slots[kind][payload] for kind, payload in spec.leaves]
    return pytree.tree_unflatten(values, spec.treedef)


class UndefinedGradError(RuntimeError):
    """A C++ backward left a different set of gradients undefined than the graph expects."""


# key -> which outputs the compiled graph treats as defined. Learned from the first
# (eager) run of a CA graph, or fixed by the fake impl if Dynamo traces first; the
# real impl then checks every later call against it.
_DEFINED: dict[str, tuple[bool, ...]] = {}


def is_learned(key: str) -> bool:
    return key in _DEFINED


@torch._dynamo.disable
def run(
    grads: Sequence[torch.Tensor | None],
    tensors: Sequence[torch.Tensor | None],
    ints: torch.Tensor,
    floats: torch.Tensor,
    symints: Sequence[int],
    key: str,
) -> list[torch.Tensor | None]:
    # Excluded from Dynamo: this runs inside backward, which may run inside a
    # compiled frame, and a traced copy would freeze the saved values it read.
    spec = _REGISTRY[key]
    int_values, float_values = ints.tolist(), floats.tolist()
    args, out_meta = _rebuild(spec, tensors, int_values, float_values, symints)
    outs = list(spec.fn(list(grads), *args))
    outs += [None] * (len(spec.out_defined) - len(outs))
    defined = tuple(v and outs[i] is not None for i, v in enumerate(spec.out_defined))
    expected = _DEFINED.setdefault(key, defined)
    if defined != expected:
        raise UndefinedGradError(_undefined_message(spec, expected, defined, int_values, float_values))
    validated = _compat.validate_outputs_fn()(
        [o if d else None for o, d in zip(outs, defined)], out_meta
    )
    inputs_storage = {
        t.untyped_storage().data_ptr() for t in (*grads, *tensors) if t is not None
    }
    result: list[torch.Tensor | None] = []
    for out, d in zip(validated, defined):
        if not d:
            result.append(None)
            continue
        out = out.contiguous()
        # A custom op may not return an alias of an input (backward often returns
        # the incoming grad as is).
        if out.untyped_storage().data_ptr() in inputs_storage:
            out = out.clone()
        result.append(out)
    return result


def _undefined_message(spec, expected, got, ints, floats) -> str:  # type: ignore[no-untyped-def]
    slots = [i for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    return (
        f"ca_dynsaved: {spec.name} returned "
        + ", ".join(
            f"{'an undefined' if not got[i] else 'a defined'} gradient for input {i}"
            for i in slots
        )
        + f" (saved ints {ints}, floats {floats}), but on the run its compiled graph "
        "was built from it was the opposite: whether a gradient is None depends on "
        "saved values, which one compiled graph cannot express. Return a zero "
        "gradient instead of an undefined one, or run this backward without ca_dynsaved."
    )


@torch.library.custom_op(OP_QUALNAME, mutates_args=(), schema=_SCHEMA)
def cpp_function(grads, tensors, ints, floats, symints, key):  # type: ignore[no-untyped-def]
    return run(grads, tensors, ints, floats, symints, key)


#: The OpOverload that CA graphs call.
OP = torch.ops.ca_dynsaved.cpp_function.default


@cpp_function.register_fake
def _(grads, tensors, ints, floats, symints, key):  # type: ignore[no-untyped-def]
    spec = _REGISTRY[key]
    defined = _DEFINED.setdefault(key, spec.out_defined)
    _, out_meta = _rebuild(spec, tensors, [0] * ints.numel(), [0.0] * floats.numel(), symints)
    outs: list[torch.Tensor | None] = []
    for d, meta in zip(defined, out_meta):
        if not d:
            outs.append(None)
            continue
        empty = torch.empty(
            _compat.metadata_sizes(meta), device=_compat.metadata_device(meta)
        )
        # validate_outputs gives the dtype (and layout) eager's engine would.
        outs.append(_compat.validate_outputs_fn()([empty], [meta])[0].contiguous())
    return outs
