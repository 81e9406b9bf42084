"""What a C++ backward does, op by op, with where each tensor it passes comes from.

The sentinel plan and verify (``sentinel.py``, ``ways/verify.py``) compare recordings
of one backward run with different saved numbers. A recording is one flat list: for
each ATen op the backward dispatches, the op, the names of its keyword arguments,
then its argument leaves (a list or tuple as its length, then its items); after the
last op, ``RETURNS`` and what the backward returned. A tensor leaf is its **origin**:

* ``("saved", i)``: saved tensor ``i``; ``("grad", j)``: incoming gradient ``j``;
* ``(n, m)``: the ``m``-th tensor op ``n`` returned (a view or an in-place op's
  result included: aliasing is part of the flow, as the ops that make it are);
* ``UNKNOWN``: a tensor no recorded op made (``from_blob``, a pointer, a global):
  its data is invisible to a recording, so a backward that uses one is refused.

So two recordings are equal exactly when the backward ran the same ops, with the same
non-tensor arguments, on tensors of the same provenance, and returned the same
tensors for the same inputs: the same computation of its inputs. Equality of the
flat lists is one C comparison; shapes and dtypes need no recording (the inputs'
are fixed per ``Inputs``, and the ops determine the rest).

The inputs are real tensors of at most 2 elements a dimension (C++ kernels on a few
elements cost a few microseconds an op, a fake tensor's Python dispatch 100), each
``SizeWatched`` (``_compat.symbolic``), as is every op's result: a read of a
tensor's sizes is an op of the recording (``aten.sym_size.default``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ._compat.layout import CppCall
from ._compat.symbolic import RecordingMode, SizeWatched, real_tensors_only, size_hints

#: The origin of a tensor no recorded op made.
UNKNOWN = ("unknown",)
#: Between the last op and the backward's returned tensors, in a flat recording.
RETURNS = "<returns>"


def saved_origin(i: int) -> tuple[str, int]:
    return ("saved", i)


def grad_origin(j: int) -> tuple[str, int]:
    return ("grad", j)


def describe(origin: Any, ops: Sequence[Any] = ()) -> str:
    """An origin in words (``ops``: the recording's ops, to name a producer)."""
    if origin is None:
        return "an undefined tensor"
    if origin == UNKNOWN:
        return "a tensor no recorded op made"
    kind, index = origin
    if kind == "saved":
        return f"saved tensor {index}"
    if kind == "grad":
        return f"incoming gradient {index}"
    op = f" ({ops[kind]})" if kind < len(ops) else ""
    return f"output {index} of op {kind}{op}"


class _Recorder(RecordingMode):
    """Appends each op to ``flat`` (its start to ``starts``), its tensors as their
    origins; runs it on the wrapped tensors and wraps its results, each a new origin.
    One Python dispatch an op, verify's per-op cost: kept to plain loops, the common
    cases (a tensor or a number argument, one tensor result) first."""

    def __init__(self) -> None:
        super().__init__()
        self.flat: list[Any] = []
        self.starts: list[int] = []
        self.origins: dict[int, Any] = {}  # id(wrapper) -> origin
        # origin -> (its wrapper, dtype, device), kept from one recording to the next
        # of the same inputs: a wrapper's sizes are read through Python (the inner
        # tensor's), so one of the same dtype and device takes the new result as it
        # is, without a new wrapper (a third of a recording's cost); not one that a
        # view op made (autograd made it a view: it cannot be made one again). Each
        # origin's wrapper is distinct, so no id is reused while recording.
        self.shells: dict[Any, tuple[Any, torch.dtype, torch.device]] = {}

    def start(self, inputs: dict[int, Any]) -> dict[int, Any]:
        """A new recording, the inputs' origins (by id) known; returns the origins."""
        self.flat, self.starts, self.origins = [], [], dict(inputs)
        return self.origins

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        flat, starts, origins = self.flat, self.starts, self.origins
        op = len(starts)
        starts.append(len(flat))
        flat.append(func)
        if kwargs:
            flat.append(tuple(kwargs))
            args = self._leaves(args)
            out = func._op(*args, **dict(zip(kwargs, self._leaves(kwargs.values()))))
        else:
            flat.append(())
            unwrapped = []  # _leaves, inlined for the top level
            for value in args:
                kind = type(value)
                if kind is SizeWatched:
                    flat.append(origins.get(id(value), UNKNOWN))
                    unwrapped.append(value.inner)
                elif kind is list or kind is tuple:
                    flat.append(len(value))
                    unwrapped.append(kind(self._leaves(value)))
                else:
                    flat.append(UNKNOWN if isinstance(value, torch.Tensor) else value)
                    unwrapped.append(value)
            out = func._op(*unwrapped)
        if type(out) is torch.Tensor:  # _shell, inlined for the common case
            origin = (op, 0)
            found = self.shells.get(origin)
            if found is not None and out.dtype is found[1] and out.device == found[2] and not found[0]._is_view():
                wrapper = found[0]
                wrapper.inner = out
            else:
                wrapper = _wrap(out)
                self.shells[origin] = (wrapper, out.dtype, out.device)
            origins[id(wrapper)] = origin
            return wrapper
        return self._watched(out, op, [0])

    def _shell(self, t: torch.Tensor, origin: Any) -> SizeWatched:
        """``t`` wrapped, as ``origin``: in the wrapper that origin had in the last
        recording when it fits."""
        found = self.shells.get(origin)
        if found is not None and t.dtype is found[1] and t.device == found[2] and not found[0]._is_view():
            wrapper = found[0]
            wrapper.inner = t
        else:
            wrapper = _wrap(t)
            self.shells[origin] = (wrapper, t.dtype, t.device)
        self.origins[id(wrapper)] = origin
        return wrapper

    def _leaves(self, values: Any) -> list[Any]:
        """``values`` unwrapped, their leaves appended to ``flat`` in one walk (ATen
        arguments nest only lists and tuples). Cheaper than pytree."""
        flat, origins, out = self.flat, self.origins, []
        for value in values:
            kind = type(value)
            if kind is SizeWatched:
                flat.append(origins.get(id(value), UNKNOWN))
                out.append(value.inner)
            elif kind is list or kind is tuple:
                flat.append(len(value))
                out.append(kind(self._leaves(value)))
            else:
                flat.append(UNKNOWN if isinstance(value, torch.Tensor) else value)
                out.append(value)
        return out

    def _watched(self, value: Any, op: int, count: list[int]) -> Any:
        if isinstance(value, torch.Tensor):
            count[0] += 1
            return self._shell(value, (op, count[0] - 1))
        kind = type(value)
        if kind is list or kind is tuple:
            return kind(self._watched(v, op, count) for v in value)
        return value


_make_wrapper = torch.Tensor._make_wrapper_subclass  # type: ignore[attr-defined]


def _wrap(t: torch.Tensor) -> SizeWatched:
    """``SizeWatched(t)``, without its ``__new__``'s frame (once per op result)."""
    wrapper = _make_wrapper(
        SizeWatched, t.shape, strides=t.stride(), dtype=t.dtype, device=t.device, dispatch_sizes_strides_policy="sizes"
    )
    wrapper.inner = t
    return wrapper


@dataclass
class Recording:
    """One run of a backward: ``flat`` (see the module docstring), where each op
    starts in it, where ``RETURNS`` is (its end when the backward raised), the
    exception it raised (None: it returned), and, when asked for, each origin's dtype."""

    flat: list[Any]
    starts: list[int]
    end: int
    error: Exception | None = None
    dtypes: dict[Any, torch.dtype] | None = None

    def ops(self) -> list[tuple[Any, tuple[Any, ...]]]:
        """(op, its leaves: the kwargs names first) per op, in order."""
        bounds = [*self.starts, self.end]
        return [(self.flat[a], tuple(self.flat[a + 1 : b])) for a, b in zip(bounds, bounds[1:])]

    def returned(self) -> tuple[Any, ...]:
        """The origin of each tensor the backward returned (None: undefined)."""
        return tuple(self.flat[self.end + 1 :])


_INTERNED: dict[tuple[Any, str], "Inputs"] = {}


def clear() -> None:
    _INTERNED.clear()


def _small(sizes: Sequence[int]) -> list[int]:
    """Sizes for a recording: each above 2 becomes 2 (``cpptrace.size_dependence`` has
    shown that the traced node's ops and arguments are the same for any sizes of at
    least 2), 0 and 1 stay."""
    return [min(int(s), 2) for s in sizes]


@dataclass(frozen=True)
class Inputs:
    """What a recording of one node needs, free of the capture's symbols and modes:
    the functional, its call (``CppCall.detached``, forward outputs of small sizes),
    the (small sizes, dtype, device) of its saved tensors and incoming grads."""

    fn: Callable[..., Any]
    call: CppCall
    saved: tuple[Any, ...]  # (sizes, dtype, device) per saved tensor, or the value
    grads: tuple[tuple[list[int], torch.dtype, torch.device] | None, ...]  # None: undefined
    constants: tuple[tuple[str, Any], ...] = ()  # saved values CA hashed: constants of the graph

    @property
    def keys(self) -> tuple[str, ...]:
        return self.call.keys

    def values(self, numbers: dict[str, Any]) -> list[Any]:
        """The saved values, in the call's order: ``numbers`` for the saved numbers,
        the capture's value for each hashed one."""
        if not self.constants:
            return [numbers[k] for k in self.keys]
        constants = dict(self.constants)
        return [numbers[k] if k in numbers else constants[k] for k in self.keys]

    @staticmethod
    def of(
        fn: Callable[..., Any], call: CppCall, undefined: Sequence[bool] = (), constants: dict[str, Any] | None = None
    ) -> "Inputs":
        """``undefined``: which incoming grads are None in the capture (the backward
        then gets an undefined grad there, as in every run of its graph);
        ``constants``: the saved values CA hashed, by key (the graph is CA's for
        them: its cache key holds them)."""
        saved = tuple(
            (_small(size_hints(t)[0]), t.dtype, t.device) if isinstance(t, torch.Tensor) else t
            for t in call.saved
        )
        grads = [(_small(t.shape), t.dtype, t.device) for t in call.incoming_grads()]
        # output_info: the forward outputs' sizes, which an undefined grad is made of
        detached = call.detached().with_output_sizes([g[0] for g in grads])
        none = tuple(undefined) or (False,) * len(grads)
        grads_ = tuple(None if u else g for g, u in zip(grads, none))
        inputs = Inputs(fn, detached, saved, grads_, tuple((constants or {}).items()))
        # One per distinct layout: the nodes of a layer's worth of one function share
        # it, so their recordings, one after the other in a step, reuse one set of
        # tensors and wrappers, warm in the caches (half a recording's cost in a step).
        key = (fn, repr((detached, saved, grads_, inputs.constants)))
        return _INTERNED.setdefault(key, inputs)

    def tensors(self, make: Callable[[list[int], torch.dtype, torch.device], torch.Tensor]) -> tuple[list[Any], list[Any]]:
        """(saved, incoming grads) made by ``make(sizes, dtype, device)``: a saved
        value that is no tensor as it is, an undefined grad None."""
        saved = [make(*s) if isinstance(s, tuple) else s for s in self.saved]
        return saved, [None if g is None else make(*g) for g in self.grads]

    def run(self, values: Sequence[Any], saved: Sequence[Any], grads: Sequence[Any]) -> Any:
        """The backward on these tensors with these saved values (in the call's order)."""
        return self.call.call(self.fn, grads, values=values, saved=saved)

    def _prepared(self) -> tuple[list[Any], list[Any], dict[int, Any], "_Recorder", tuple[Any, ...], tuple[Any, ...]]:
        """(saved, incoming grads, their origins by id, the recorder, the call's
        arguments before and after the saved values): made once, reused by every
        recording. The inputs are zeros of the small sizes, each ``SizeWatched``.
        Their data is never read (a backward whose ops read data is refused) and what
        a backward does to them is recorded, so a recording cannot depend on an
        earlier one's in-place writes except through ops it records."""
        made = self.__dict__.get("_made")
        if made is None:
            origins: dict[int, Any] = {}

            def watched(origin: Any, sizes: list[int], dtype: torch.dtype, device: torch.device) -> SizeWatched:
                with real_tensors_only():
                    wrapper = SizeWatched(torch.zeros(sizes, dtype=dtype, device=device))
                origins[id(wrapper)] = origin
                return wrapper

            saved = [watched(saved_origin(i), *s) if isinstance(s, tuple) else s for i, s in enumerate(self.saved)]
            grads = [None if g is None else watched(grad_origin(j), *g) for j, g in enumerate(self.grads)]
            # the functional's arguments: (grads, keys, *values, saved, *tail); C++
            # copies the lists it is given, so one of each serves every call
            around = ((grads, list(self.keys)), (saved, *self.call.tail))
            made = self.__dict__["_made"] = (saved, grads, origins, _Recorder(), *around)
        return made

    def record(self, values: Sequence[Any], dtypes: bool = False) -> Recording:
        """The recording of the backward with these saved values on zeros of the
        small sizes; ``dtypes``: also note each origin's dtype (the plan asks)."""
        saved, grads, inputs, recorder, head, tail = self._prepared()
        origins = recorder.start(inputs)
        # verify runs in the runtime wrapper: no mode on torch's stack, grad off
        outside = real_tensors_only() if torch._C._len_torch_dispatch_stack() else None
        grad_on = torch.is_grad_enabled()
        if outside is not None:
            outside.__enter__()
        if grad_on:
            torch._C._set_grad_enabled(False)
        try:
            with recorder:
                out = self.fn(*head, *values, *tail)
        except Exception as e:  # noqa: BLE001 - the caller refuses: the safe side
            return Recording(recorder.flat, recorder.starts, len(recorder.flat), e)
        finally:
            if grad_on:
                torch._C._set_grad_enabled(True)
            if outside is not None:
                outside.__exit__(None, None, None)
        flat = recorder.flat
        end = len(flat)
        flat.append(RETURNS)
        for t in out:
            flat.append(None if t is None else origins.get(id(t), UNKNOWN) if type(t) is SizeWatched else UNKNOWN)
        recording = Recording(flat, recorder.starts, end)
        if dtypes:
            wrappers = [*saved, *grads, *(w for w, _, _ in recorder.shells.values())]
            recording.dtypes = {origin: w.dtype for w in wrappers if (origin := origins.get(id(w)))}
        return recording
