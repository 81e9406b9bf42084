"""What an opaque backward returns, checked against the graph and made op-safe.

The compiled graph was made from the capture's first run: which gradients the
backward left undefined, and which it returned as its incoming gradient without a
copy, are part of its structure (``reuse.name_learned_outputs``). Every later run
is checked against that (``UndefinedGradError`` where it differs), validated as the
engine validates a backward's outputs (dtype, layout, device; skipped where the
first run's validation kept the outputs as they were), and returned as a custom op
may return it: contiguous, no alias of an input or of another output.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from ._compat.capture import is_alias_of, validate_outputs_fn
from ._compat.layout import metadata_sizes


class UndefinedGradError(RuntimeError):
    """A backward left a different set of gradients undefined than the graph expects.

    Raised mid-backward by a custom-function node the plugin runs opaque (C++ or
    Python) when, on a later step, its backward returns ``None`` where the
    capture's first run returned a gradient (or the reverse), or a new tensor where
    that run returned its incoming gradient as is: one compiled graph cannot
    express an answer that depends on saved values. The message names the node,
    the input and the saved values. Leaves reached before it may already hold their
    gradient: drop that step. Fix: return a zero gradient instead of ``None``, a
    new tensor (``grad * 1``) instead of the incoming one, or keep the node stock
    with ``enable(exclude=[...])``. Takes the message as its one argument.

    Example::

        try:
            with ca_dynsaved.enable():
                loss.backward()
        except ca_dynsaved.UndefinedGradError:
            optimizer.zero_grad()  # drop this step
    """



def finish(spec, node, learned, outs, out_meta, grads, tensors, describe):  # type: ignore[no-untyped-def]
    """Check undefined grads against the graph, validate as the engine does, and
    return outputs a custom op may return: contiguous, not aliasing an input, and
    None where the compiled graph uses the incoming grad the first run returned as
    is. ``describe``: (function, argument) naming the saved values, called for an
    error message only. Runs for every opaque node of every backward: kept to
    plain loops."""
    out_defined = spec.out_defined
    n = len(out_defined)
    if len(outs) < n:
        outs = [*outs, *([None] * (n - len(outs)))]
    defined = tuple([d and o is not None for d, o in zip(out_defined, outs)])
    expected = learned.defined if learned.defined is not None else node.defined
    if expected is not None and defined != expected:
        raise UndefinedGradError(_undefined_message(spec, expected, defined, describe[0](describe[1])))
    if False in out_defined:  # an output for an invalid edge (no grad needed there): dropped
        outs = [o if d else None for o, d in zip(outs, out_defined)]
    kept = node.kept
    if kept is not None and _kept(outs, out_meta, kept):
        validated = outs  # what validate_outputs would return
    else:
        validated = _validate_outputs()(outs, out_meta)
        if kept is None:  # learn what it keeps as it is
            node.kept = tuple(
                (type(v), v.dtype, v.device, v.layout) if v is not None and v is o and not v.is_nested else None
                for o, v in zip(outs, validated)
            )
    if expected is None:  # the first run of this capture: learn
        node.defined = defined
        node.passthrough = tuple(
            next((j for j, g in enumerate(grads) if out is g), -1) if d else -1
            for out, d in zip(validated, defined)
        )
    through = learned.passthrough
    result: list[torch.Tensor | None] = []
    for i, out in enumerate(validated):
        if out is None:
            result.append(None)
            continue
        if through is not None and through[i] >= 0:
            if out is not grads[through[i]]:
                raise UndefinedGradError(_passthrough_message(spec, i, through[i], describe[0](describe[1])))
            result.append(None)  # the graph uses that grad itself
            continue
        out = out.contiguous()
        # A custom op may not return an alias of an input (a view, a detach, the
        # tensor itself) or of another of its outputs: a backward that returns its
        # incoming grad on a run other than the first, a saved tensor, or views of
        # one buffer (torchdiffeq's adjoint: its parameters' grads) costs a copy.
        if _aliases(out, grads) or (tensors and _aliases(out, tensors)) or (result and _aliases(out, result)):
            out = out.clone()
        result.append(out)
    return result


def _kept(outs: Sequence[Any], out_meta: Sequence[Any], kept: Sequence[tuple[Any, ...] | None]) -> bool:
    """Whether validate_outputs would return ``outs`` as they are: each one of the
    type, dtype, device and layout of an output the first run's validate kept as it
    was, not nested, and of its metadata's sizes. What validate does depends on
    nothing else (the metadata's other fields are constants of the node), so this
    saves converting the metadata for the C++ call on every run."""
    for out, meta, k in zip(outs, out_meta, kept):
        if out is None:
            continue
        if (
            k is None
            or type(out) is not k[0]
            or out.dtype is not k[1]
            or out.layout is not k[3]
            or out.is_nested
            or out.device != k[2]
            or out.shape != metadata_sizes(meta)
        ):
            return False
    return True


def _aliases(out: torch.Tensor, tensors: Sequence[torch.Tensor | None]) -> bool:
    for t in tensors:
        if t is not None and _is_alias_of(out, t):
            return True
    return False


_is_alias_of = is_alias_of


def _passthrough_message(spec, i, j, saved_desc) -> str:  # type: ignore[no-untyped-def]
    return (
        f"ca_dynsaved: {spec.name} returned a new tensor as gradient for input {i} "
        f"({saved_desc}), but on the run its compiled graph was built from it returned "
        f"its incoming gradient {j} as is, which that graph uses without a copy: "
        "whether a backward passes its gradient through depends on saved values, which "
        "one compiled graph cannot express. Return a new tensor every time (grad * 1), "
        "or keep this node stock with enable(exclude=[...])."
    )


@functools.cache
def _validate_outputs() -> Callable[..., Any]:
    """CA's C++ validate_outputs functional, looked up once (CA binds it at its
    first capture, which precedes any run of these ops)."""
    return validate_outputs_fn()


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

