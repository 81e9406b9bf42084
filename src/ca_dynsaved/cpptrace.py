"""Tracing a C++ custom function's backward into the CA graph, saved numbers dynamic.

Stock CA puts a traceable C++ function in the graph as one call that Dynamo
fake-runs; a backward that reads its saved numbers with ``toSymInt()`` /
``toSymFloat()`` gets symbols there, but Dynamo first compiles ints as constants
(one recompile) and the backends' tensorify pass specialises a float that reaches
``aten.mul.Scalar`` & co. (one compile per value). A backward that reads with
``toInt()`` / ``toDouble()`` turns the symbol into a plain number: whatever it
computes from it is invisible, and Dynamo guards the value.

This module traces such a backward itself, at capture: it calls the C++ functional
on fake tensors under the capture's modes, so its ATen ops land in the CA graph
and inductor can fuse them. Sound only for symbolic readers, so first a probe
(``verdict``, once per function and layout) runs the functional in a private
ShapeEnv with fresh symbols for the lifted numbers:

* a guard on a symbol means a plain read (``toInt()``, a branch, ``k % 2`` on an
  int64_t): the node stays opaque;
* a float symbol may only reach an op whose ``Scalar`` argument can become a 0-dim
  tensor (``REWRITES``, on a floating-point tensor) or one the tensorify pass
  takes; ``rewrite_float_scalars`` then feeds it the packed float64 tensor the
  runtime wrapper already builds, so Dynamo never sees a Python float;
* hashed saved values (bool, str, lists) keep the node opaque: traced, each new
  value would be a new graph, while opaque captures share compiled code.

A traced node's ops must also not depend on tensor sizes, since CA reuses its
graph for other sizes: ``size_dependence`` runs the functional once per function
and input layout on fake tensors whose sizes are symbols, and a size that reaches
an op argument or decides a branch keeps the node opaque. The capture then traces
on fake tensors of concrete sizes (``trace``), a third of the cost of symbolic ones.

Lifted ints used by traced nodes are marked dynamic for the graph's first compile
(``mark_dynamic_scalars``, ``L['scalars'][i]``). Plain readers a user opts
in (``trace_cpp``) are traced by ``sentinel``, through the same ``trace``.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Mapping, Sequence

import torch

from .counting import count
from ._compat.capture import no_proxy_modes
from ._compat.dynamo import exception_line
from ._compat.layout import CppCall, pytree
from ._compat.symbolic import TorchDispatchMode, concrete, size_hints
from .caches import on_reset
from .probe import FLOAT_HINT, INT_HINT, Verdict, empty_like, run_symbolic

aten = torch.ops.aten
#: ``X.Scalar`` overload -> ``X.Tensor`` overload taking the scalar (argument 1)
#: as a 0-dim tensor: the same result for a floating-point ``self``.
REWRITES = {
    aten.mul.Scalar: aten.mul.Tensor,
    aten.add.Scalar: aten.add.Tensor,
    aten.sub.Scalar: aten.sub.Tensor,
    aten.div.Scalar: aten.div.Tensor,
    aten.pow.Tensor_Scalar: aten.pow.Tensor_Tensor,
}

_CACHE: dict[tuple[Any, ...], Verdict] = {}


@on_reset
def clear() -> None:
    _CACHE.clear()
    _SIZES.clear()


def verdict(fn: Any, call: CppCall, lifted: Mapping[Any, Any]) -> Verdict:
    """May this C++ node be traced? ``call``: its CA call; ``lifted``: the
    capture's lifted symbols (symnode -> ``decision.Lifted``)."""
    kinds = tuple(
        lifted[v.node].kind if isinstance(v, (torch.SymInt, torch.SymFloat)) and v.node in lifted else type(v).__name__
        for v in call.values
    )
    key = (call.name, call.keys, kinds)
    found = _CACHE.get(key)
    if found is None:
        count("cpp_probes")
        found = _CACHE[key] = _decide(fn, call, lifted)
    return found


def _decide(fn: Any, call: CppCall, lifted: Mapping[Any, Any]) -> Verdict:
    numbers = {}
    for key, value in zip(call.keys, call.values):
        if isinstance(value, (torch.SymInt, torch.SymFloat)) and value.node in lifted:
            numbers[key] = INT_HINT if isinstance(value, torch.SymInt) else FLOAT_HINT
        else:
            return Verdict(False, f"saved '{key}' is hashed by CA (a {type(value).__name__}): opaque captures share code")
    if not numbers:
        return Verdict(False, "no saved ints or doubles")

    def backward(symbols: dict[str, Any]) -> Any:
        return call.call(fn, call.incoming_grads(), values=[symbols[k] for k in call.keys], saved=[empty_like(t) for t in call.saved])

    def rewritable(func: Any, args: tuple[Any, ...], leaf: Any) -> bool:
        """The float itself as the Scalar of an ``X.Scalar`` op on a floating tensor."""
        return (
            func in REWRITES and len(args) > 1 and args[1] is leaf and leaf.node.expr.is_Symbol
            and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()
        )

    probed = run_symbolic(numbers, backward, rewritable)
    if probed.error is not None:
        e = probed.error
        return Verdict(False, f"the probe could not run its backward ({exception_line(e)})")
    for key, guard in probed.guards:
        return Verdict(False, f"saved '{key}' is read as a plain number (guard {guard})")
    if probed.float_uses:
        key, op = probed.float_uses[0]
        return Verdict(False, f"saved '{key}' (a double) reaches {op}, which would specialise it")
    return Verdict(True, "reads its saved numbers symbolically (toSymInt/toSymFloat): " + ", ".join(sorted(numbers)))


def trace(
    instance: Any, fn: Any, grads: Sequence[Any], call: CppCall, values: Sequence[Any] | None = None,
    around: Any = None,
) -> tuple[list[Any], list[Any]]:
    """Call the functional under the capture's modes so its ATen ops are recorded
    (``values``: in place of the saved numbers, as ``sentinel`` traces; ``around``: a
    mode for the call alone, ``sentinel.NodesOfOps``). Returns (CA's dummies, the
    graph node of each output, None where undefined).

    Its inputs are fake tensors of the capture's concrete sizes bound to the
    proxies of the incoming grads (CA passes placeholders) and saved tensors: the
    backward's ops do not depend on sizes (``size_dependence`` said so), so the ops
    and arguments are those of symbolic sizes, at a third of the cost. Its outputs
    become CA's dummies, as stock CA returns for a call it records whole."""
    with no_proxy_modes():
        # None where the capture's grad is undefined: the backward gets it so
        fake_grads = [None if g is None else f for f, g in zip(call.incoming_grads(), grads)]
        saved = [empty_like(t) for t in call.saved]
    instance.bind_objects_to_proxies(
        [f for f in fake_grads if f is not None], [instance.to_proxy(g) for g in grads if g is not None]
    )
    instance.bind_objects_to_proxies(
        [t for t in saved if t is not None], [instance.to_proxy(t) for t in call.saved if t is not None]
    )
    with around if around is not None else contextlib.nullcontext():
        outs = list(call.call(fn, fake_grads, values=values, saved=saved))
    with no_proxy_modes():
        dummies = [None if o is None else instance.allocate_dummy() for o in outs]
    proxies = [None if o is None else instance.to_proxy(o) for o in outs]
    instance.bind_objects_to_proxies([d for d in dummies if d is not None], [p for p in proxies if p is not None])
    return dummies, [None if p is None else p.node for p in proxies]


_SIZES: dict[tuple[Any, ...], str] = {}


class _SymbolicArgs(TorchDispatchMode):
    """Notes whether any op gets a symbolic number (from a size) as an argument."""

    found = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if any(isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)) for leaf in pytree.tree_leaves((args, kwargs))):
            self.found = True
        return func(*args, **kwargs)


def size_dependence(fn: Any, call: CppCall) -> str:
    """'' if this backward's ops and arguments are the same for any tensor sizes,
    else why not (the node then runs opaque: traced, its sizes would be baked in).
    Decided once per function and input layout, on fake tensors whose sizes are
    symbols (one per distinct size, as CA's capture makes them), the saved numbers
    concrete: no guard that some sizes >= 2 would fail (a branch on a size or on two
    sizes' order, a specialisation), no size reaching an op argument, no error (a
    C++ ``sizes()`` on symbolic sizes raises). Contiguous inputs only."""
    # (sizes, strides, dtype, device) of each saved tensor (else the value), and of
    # each incoming grad (output_info): the cache key, and what the probe fakes
    saved = [
        (*map(tuple, size_hints(t)), t.dtype, t.device) if isinstance(t, torch.Tensor) else t
        for t in call.saved
    ]
    grads = [(tuple(g.shape), tuple(g.stride()), g.dtype, g.device) for g in call.incoming_grads()]
    key = (call.name, call.keys, tuple(type(v).__name__ for v in call.values), tuple(saved), tuple(grads))
    found = _SIZES.get(key)
    if found is None:
        found = _SIZES[key] = _probe_sizes(fn, call, saved, grads)
    return found


def _probe_sizes(fn: Any, call: CppCall, saved: list[Any], grads: list[tuple[Any, ...]]) -> str:
    if any(isinstance(x, tuple) and list(x[1]) != _contiguous_strides(x[0]) for x in saved):
        return "a saved tensor is not contiguous (sizes are only probed on contiguous ones)"
    distinct = {s for x in [*saved, *grads] if isinstance(x, tuple) for s in x[0] if s > 1}
    numbers = [concrete(v) for v in call.values]
    detached = call.detached()
    uses = _SymbolicArgs()

    def run(symbols: dict[str, Any]) -> None:
        def make(sizes: Sequence[int], strides: Any, dtype: torch.dtype, device: Any) -> torch.Tensor:
            return torch.empty([symbols[f"size{s}"] if s > 1 else s for s in sizes], dtype=dtype, device=device)

        fakes = [make(*x) if isinstance(x, tuple) else x for x in saved]
        fake_grads = [make(*g) for g in grads]
        with uses:
            detached.call(fn, fake_grads, values=numbers, saved=fakes)

    probed = run_symbolic({f"size{s}": s for s in distinct}, run)
    if probed.error is not None:
        e = probed.error
        return f"its backward fails on symbolic sizes ({exception_line(e)})"
    if not probed.sizes_only:
        return "its ops depend on tensor sizes (" + "; ".join(g for _, g in probed.guards[:3]) + ")"
    if uses.found:
        return "a tensor size reaches an op argument"
    return ""


def _contiguous_strides(sizes: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def rewrite_float_scalars(
    graph: torch.fx.Graph, floats: dict[torch.fx.Node, Any], tensor_for: Callable[[Any], torch.fx.Node]
) -> int:
    """``X.Scalar(t, scalars[j])`` -> ``X.Tensor(t, tensor_for(f))`` for each lifted
    float ``f`` (``floats``: its getitem node -> ``f``; ``tensor_for``: the node of its
    0-dim value in the packed float64 tensor). Returns how many calls it rewrote."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in REWRITES or len(node.args) < 2:
            continue
        scalar = node.args[1]
        if not isinstance(scalar, torch.fx.Node) or scalar not in floats:
            continue
        node.target = REWRITES[node.target]
        node.args = (node.args[0], tensor_for(floats[scalar]), *node.args[2:])
        rewritten += 1
    return rewritten


def float_getitems(scalars: torch.fx.Node, lifted: dict[int, Any]) -> dict[torch.fx.Node, Any]:
    """Every ``scalars[j]`` node of a lifted float -> ``lifted[j]`` (``lifted``: the
    index j among all lifted scalars -> what the caller names that float by)."""
    return {
        n: lifted[n.args[1]]
        for n in scalars.users
        if n.op == "call_function" and n.target is operator.getitem and n.args[1] in lifted
    }
