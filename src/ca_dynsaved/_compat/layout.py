"""How a custom-function node's call reaches the capture: C++ argument layouts, the
metadata of a Python node's incoming gradients and of the next edges.

Touches: the packing of ``CppNode<T>::apply_with_saved``
(``torch/csrc/autograd/custom_function.h``: keys, values, saved variables, output
info, name), ``VariableInfo``'s tuple, the next edges' input metadata tuple that
``validate_outputs`` takes, ``ctx._input_metadata``, ``torch.utils._pytree``.
Releases: the same on 2.11 to 2.15; ``CppCall.parse`` raises ``LayoutError`` on any
other layout (the node then keeps stock tracing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from .symbolic import concrete, optimization_hint

#: torch's pytree: a call's arguments flattened to leaves and rebuilt (``opaque``).
pytree = pytree


#: A gradient's shape, dtype and device (``grads_of``): what a probe makes one from.
GradSpec = tuple[tuple[int, ...], torch.dtype, torch.device]


def grads_of(ctx: Any) -> tuple[GradSpec, ...]:
    """The gradients a Python node's backward receives, at this run's sizes."""
    return tuple((tuple(m.shape), m.dtype, m.device) for m in ctx._input_metadata)


def incoming_grads(ctx: Any, grads: Sequence[GradSpec] | None = None) -> list[torch.Tensor]:
    """An empty tensor like each gradient a Python node's backward receives (fake
    under a fake mode, real outside one), as ``grads`` describes them (by default,
    this run's): at capture, CA hands ``proxy_call_backward`` placeholders in their
    place."""
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in grads or grads_of(ctx)]


# c10::ScalarType order: the dtype codes of CA's metadata tuples.
_SCALAR_TYPES = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
    torch.bool, torch.qint8, torch.quint8, torch.qint32, torch.bfloat16,
)


def _tensor_from_variable_info(info: Sequence[Any]) -> torch.Tensor:
    """An empty tensor as a C++ node's ``output_info`` entry describes a forward
    output: ``(layout, device, dtype_code, sizes, requires_grad, is_empty)``, the
    metadata of the gradient its backward receives; its sizes the hints of the
    capture's symbols (usable by a probe in another ShapeEnv)."""
    layout, device, dtype, sizes = info[0], info[1], info[2], info[3]
    if layout != 0 or not 0 <= dtype < len(_SCALAR_TYPES):
        raise LayoutError(f"unsupported output layout {layout} / dtype code {dtype}")
    return torch.empty([optimization_hint(s) for s in sizes], dtype=_SCALAR_TYPES[dtype], device=device)


# CppNode<T>::apply_with_saved packs its call as
#   (keys, *values, saved_variables, materialize_grads, has_freed_buffers,
#    needs_input_grad, output_info, is_variable_input, name)
# with one value per key, in the same order (torch/csrc/autograd/custom_function.h),
# and the functional is called as fn(grads, *those args).
CPP_NODE_TRAILING_ARGS = 7
_TAIL_OUTPUT_INFO = 3  # output_info's place after saved_variables
_INFO_SIZES = 3  # sizes' place in an output_info entry (_tensor_from_variable_info)


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

    def incoming_grads(self) -> list[torch.Tensor]:
        """An empty tensor like each gradient the backward receives, of the capture's
        concrete sizes (fake under a fake mode, real outside one)."""
        return [_tensor_from_variable_info(info) for info in self.output_info]

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
