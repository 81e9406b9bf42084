"""Activation checkpointing inside one CA graph: the unpack as one opaque op.

A non-reentrant ``torch.utils.checkpoint`` region saves every tensor through a
pack hook (a ``_Holder``) and recomputes the region when the backward first unpacks
one. Stock CA puts each unpack in its graph as ``call_hook(hooks[i], packed_data[j])``;
Dynamo refuses the hook (``torch.utils.checkpoint`` is skipped), so the CA graph
breaks at every unpack, and each break's resume function is compiled again.

Here each unpack is ``ca_dynsaved::unpack(like, hook, data, slot)``:

* its real impl calls the hook of this run (``binding.bound_run``) on its holder, so
  the recomputation runs inside the compiled graph exactly as eager's would (once
  per region and backward, lazily, under the checkpoint's own RNG and autocast
  handling);
* its fake impl returns a tensor shaped like ``like``: a zero-element tensor the
  runtime wrapper passes per unpack and run (``Unpacks.likes``), ``(0, *shape)``
  with strides ``(1, *strides)``, in the saved tensor's dtype and on its device.
  The shape, dtype and device are the ones the frame recorded at pack time, which
  checkpoint itself checks the recomputation against; the strides are those the
  first run's recomputation gave (that run is eager). Dynamo sees a tensor input,
  so it guards the metadata and makes sizes dynamic as for any input, and never
  sees the hook, the holder or the frame.

Why it cannot give a wrong gradient: the op checks what the hook returned against
``like`` (shape, dtype, device: a clear error if they differ, which checkpoint's own
check already excludes) and returns it only where it has the declared strides, no
offset, and a storage no other tensor shares; else a copy with the declared
strides, so inductor may reuse its buffer. A run whose hook is not checkpoint's, or
whose frame recorded no metadata (``determinism_check="none"``), runs the capture's
stock twin (the same graph with stock's ``call_hook``), compiled as stock compiles
it. The reentrant checkpoint (``CheckpointFunction``) is a Python function: it runs
opaque (``decision.decide_python``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from ._compat.checkpoint import REENTRANT_FUNCTION, frame_of, holder_index, owns_storage, saved_metadata
from ._compat.dynamo import CUDAGRAPH_UNSAFE, without_dynamo
from ._compat.engine import ForceDispatchKeys
from .binding import TIMING, bound, timed



def is_reentrant(cls: type) -> bool:
    """``cls`` is torch's reentrant checkpoint function (or a subclass)."""
    return issubclass(cls, REENTRANT_FUNCTION)


def _strides(shape: Sequence[int], order: tuple[int, ...] | None) -> tuple[int, ...]:
    """Dense strides of ``shape`` with its dims laid out in ``order`` (outermost
    first; None: contiguous)."""
    dims = order if order is not None else range(len(shape))
    strides = [0] * len(shape)
    step = 1
    for d in reversed(tuple(dims)):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def _order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dim order of a dense tensor's layout (a transposed weight: (1, 0)), None
    where it is contiguous or not dense (then contiguous is declared: one copy)."""
    order = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    if order == tuple(range(t.dim())) or _strides(t.shape, order) != t.stride():
        return None
    return order


class Unpacks:
    """One capture's unpacks of checkpointed saved tensors, by slot: CA's
    ``(hooks index, packed_data index)`` of each, the dim order its first run
    learned, and the zero-element ``like`` tensors the graph reads (made again only
    when a slot's metadata changes, each slot its own object, so Dynamo sees no
    aliasing between them). ``fallback``: the stock twin's compiled function, made
    on first use."""

    def __init__(self, slots: Sequence[tuple[int, int]], stock_twin: torch.fx.GraphModule) -> None:
        self.slots = tuple(slots)
        self.stock_twin = stock_twin
        self.orders: list[tuple[int, ...] | None] = [None] * len(self.slots)
        self.learned = False  # set after the first run, whose recomputation gave the orders
        self._likes: list[torch.Tensor | None] = [None] * len(self.slots)
        self.fallback: Callable[..., Any] | None = None

    def likes(self, hooks: Sequence[Any], packed: Sequence[Any]) -> list[torch.Tensor] | str:
        """This run's ``like`` tensors, in slot order; or why this run cannot take the
        graph (then it runs the stock twin)."""
        indices: dict[int, dict[int, int]] = {}  # id(frame) -> holder ids' indices
        out = []
        for slot, (h, d) in enumerate(self.slots):
            frame = frame_of(hooks[h])
            if frame is None:
                return "a saved-tensor unpack hook that is not torch.utils.checkpoint's"
            index = indices.get(id(frame))
            if index is None:
                index = indices[id(frame)] = holder_index(frame)
            i = index.get(id(packed[d]))
            meta = None if i is None else saved_metadata(frame, i)
            if meta is None:
                return "a checkpoint that records no metadata of its saved tensors (determinism_check='none')"
            shape, dtype, device = meta
            like = self._likes[slot]
            if like is None or like.shape[1:] != shape or like.dtype != dtype or like.device != device:
                strides = _strides(shape, self.orders[slot])
                like = self._likes[slot] = torch.empty_strided((0, *shape), (1, *strides), dtype=dtype, device=device)
            out.append(like)
        return out

    def learn(self, slot: int, t: torch.Tensor) -> None:
        if not self.learned:
            self.orders[slot] = _order(t)

    def done_first_run(self) -> None:
        """The first run has given every slot's order: the likes get those strides."""
        if not self.learned:
            self.learned = True
            self._likes = [None] * len(self.slots)


def unpack_now(like: torch.Tensor | None, hook: int, data: int, slot: int) -> torch.Tensor:
    """Run this run's unpack hook ``hook`` on holder ``data`` and return the tensor
    as ``like`` declares it (see the module docstring); with no ``like`` (an eager
    run whose hooks ``Unpacks.likes`` could not describe) as the hook returns it."""
    start = time.perf_counter() if TIMING else 0.0
    run = bound("a checkpoint unpack")
    # Under the caller's dispatch keys, as in opaque.run_python: a compiled graph calls
    # the op below autograd, where the recomputation would record nothing and save
    # no tensor (checkpoint then raises: 0 tensors saved during recomputation).
    with ForceDispatchKeys(*run.keys):
        t = run.hooks[hook](run.packed[data])
    if like is None:
        return t
    shape = like.shape[1:]
    if t.shape != shape or t.dtype != like.dtype or t.device != like.device:
        raise RuntimeError(
            f"ca_dynsaved: a torch.utils.checkpoint unpack (saved tensor {slot} of this graph) returned "
            f"{tuple(t.shape)} {t.dtype} on {t.device}, but its checkpoint recorded {tuple(shape)} "
            f"{like.dtype} on {like.device} at pack time (the recomputation differs from the forward)"
        )
    unpacks = run.unpacks
    unpacks.learn(slot, t)
    strides = like.stride()[1:]
    if t.stride() != strides or t.storage_offset() != 0 or not owns_storage(t):
        out = torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device)
        out.copy_(t)
        t = out
    if TIMING:
        timed(start, 0.0)
    return t


run_unpack = without_dynamo(unpack_now)

_lib = torch.library.Library("ca_dynsaved", "FRAGMENT")
# Tagged cudagraph_unsafe: its Python reads this run's hooks (see opaque.py).
_lib.define("unpack(Tensor? like, int hook, int data, int slot) -> Tensor", tags=(CUDAGRAPH_UNSAFE,))
_lib.impl("unpack", run_unpack, "CompositeExplicitAutograd")


@torch.library.register_fake("ca_dynsaved::unpack", lib=_lib)
def _(like, hook, data, slot):  # type: ignore[no-untyped-def]
    return torch.empty_strided(like.shape[1:], like.stride()[1:], dtype=like.dtype, device=like.device)


#: The OpOverload the rewritten CA graph calls.
UNPACK_OP = torch.ops.ca_dynsaved.unpack.default
# Never removed as dead code: the recomputation it may trigger is the region's.
torch.fx.node.has_side_effect(UNPACK_OP)
