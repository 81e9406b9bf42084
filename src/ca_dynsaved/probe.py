"""Would a Python backward specialise on its ctx numbers? A symbolic probe.

Stock CA traces a Python backward with the ctx as a graph input (``hooks[i]``), and
Dynamo guards whatever the backward needs to know about a ctx number. Tensor math
(``g * ctx.k * ctx.scale``) needs nothing: with the number dynamic from the first
compile, one graph serves every value and inductor fuses the backward with its
neighbours. An op whose schema says ``int``/``float``, a branch, a size, ``int()``,
``math.sqrt`` need the value itself: Dynamo guards it and recompiles per value. Such
a function should run opaque instead (``pyctx``).

The probe tells the two apart before Dynamo compiles: it runs the backward once on
fake tensors of a private ShapeEnv, with a stand-in ctx whose int and float
attributes are fresh symbols, and reads what that cost:

* a guard (or a specialisation) on a symbol: the backward needs the value;
* a symbolic float reaching an op the backends' tensorify pass cannot turn into a
  tensor op: the backend would specialise it (``leaky_relu(g, s)``, ``g ** s``);
* a read of any other attribute that is no tensor: a bool, a str or None is
  guarded by Dynamo by value, as under stock CA (a compile per distinct value, the
  numbers dynamic beside it); anything else (a tuple, a list, an object) makes the
  verdict opaque.

Its verdict is cached per function and ctx layout (attribute names and types), so
a capture pays the probe (a symbolic run: docs/benchmarks.md, "Component costs") once. It
is a forecast, not the safety net: if it misses a case, Dynamo's guards still keep
the traced graph correct (it recompiles), and the report names the attribute and
the guard. The backward really runs once more, on fake tensors: a Python side
effect in it (a print, a counter) happens once more at that first capture.
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .counting import count
from ._compat.config import dynamo_specializes_floats, torch_warnings_to
from ._compat.dynamo import exception_line
from ._compat.layout import GradSpec, grads_of, incoming_grads, pytree
from ._compat.symbolic import (
    TorchDispatchMode,
    guards_on,
    holds_for_sizes_above_one,
    new_symbol,
    outside_capture,
    size_hints,
    symbolic_probe_mode,
    tensorifiable_ops,
    tensorifies_python_arithmetic,
    tensorify_interprets,
)
from .caches import on_reset

#: Stand-in values for the symbols: not 0 or 1 (which would be specialised), odd,
#: nothing a backward divides by zero with. The hints only pick which branch the
#: probe walks; any guard on a symbol makes the verdict opaque whichever it is.
INT_HINT, FLOAT_HINT = 7, 0.37
_INT64 = (-(2**63), 2**63 - 1)

#: The types of a ctx attribute a traced backward may read besides its numbers:
#: Dynamo guards each by value, as it does under stock CA (a compile per distinct
#: value, as stock; the numbers dynamic beside them). Others (a tuple, a list, an
#: object) keep the function opaque.
GUARDED_AS_STOCK = (bool, str, type(None))

#: Around a probe's run (a decorator): the probes expect some stand-in runs to fail,
#: and what torch logs about those goes to the plugin's log at DEBUG, never the
#: user's log. Only where a probe runs (a verdict's cache miss), which pays for it once.
quietly = torch_warnings_to(logging.getLogger("ca_dynsaved"))


#: A Python function with no ctx int or float (the plugin lifts nothing of it).
NO_NUMBERS = "no int or float ctx attribute"


@dataclass(frozen=True)
class Verdict:
    """Whether a function's backward can be traced with its numbers dynamic."""

    traced: bool
    reason: str  # what decided it, for the report and the log
    attribute: str | None = None  # the attribute behind an opaque verdict
    guarded: tuple[str, ...] = ()  # the bools / strs / Nones a traced backward read
    # an opaque verdict's: stock's graph runs this backward as eager does, only
    # recompiling (a tiered node may hand it to stock's graph: decision.Tiered)
    stock_runs_it: bool = True


_CACHE: dict[tuple[Any, ...], Verdict] = {}


@on_reset
def clear() -> None:
    _CACHE.clear()


def cache_size() -> int:
    return len(_CACHE)


def verdict(
    ctx: Any, saved: Sequence[Any], tensor_inputs: tuple[bool, ...], grads: Sequence[GradSpec] | None = None
) -> Verdict:
    """The verdict for this node's function and ctx layout, probing on a miss.
    ``saved`` are the capture's (fake) saved tensors of the call; ``tensor_inputs``
    says which forward inputs were tensors (may get a gradient); ``grads`` the
    incoming gradients of the capture that made ``saved`` (by default, ``ctx``'s:
    at a later run its sizes may no longer be ``saved``'s)."""
    key = (*ctx_layout(ctx), hashed_values(ctx), tensor_inputs, dynamo_specializes_floats())
    found = _CACHE.get(key)
    if found is None:
        count("probes")
        found = _CACHE[key] = _decide(ctx, vars(ctx), saved, tensor_inputs, grads or grads_of(ctx))
    return found


def hashed_values(ctx: Any) -> tuple[tuple[str, Any], ...]:
    """The ctx's bools, strs and Nones, by name: a backward may branch on them, so
    the probe's run holds for this combination of them only."""
    return tuple((name, value) for name, value in vars(ctx).items() if type(value) in GUARDED_AS_STOCK)


def ctx_layout(ctx: Any) -> tuple[Any, ...]:
    """A Python node's function and the names and types of its ctx attributes: what
    the probes' verdicts are cached by (here and ``graphbreak``)."""
    return ctx._forward_cls, tuple((name, type(value)) for name, value in vars(ctx).items())


def _decide(
    ctx: Any, attributes: dict[str, Any], saved: Sequence[Any], tensor_inputs: tuple[bool, ...],
    grads: Sequence[GradSpec],
) -> Verdict:
    numbers = {}
    for name, value in attributes.items():
        if not is_number(value):
            continue
        if type(value) is float:
            if dynamo_specializes_floats():
                return Verdict(
                    False,
                    f"ctx.{name} is a float and Dynamo specialises floats here "
                    "(torch._inductor.config.triton.cudagraphs or specialize_float is on)",
                    name,
                )
            numbers[name] = FLOAT_HINT
        elif type(value) is int and _INT64[0] <= value <= _INT64[1]:
            numbers[name] = INT_HINT
        else:
            what = "an int beyond int64" if type(value) is int else f"a {type(value).__module__}.{type(value).__name__}"
            return Verdict(False, f"ctx.{name} is {what}, which Dynamo cannot make dynamic", name, stock_runs_it=False)
    return _probe(ctx, numbers, saved, tensor_inputs, grads)


def is_number(value: Any) -> bool:
    """An int or float Dynamo would guard on: Python's (ints beyond int64, which stock
    CA cannot compile, included) and numpy's scalars; not a bool, not a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class _StandIn:
    """The ctx as the probe's backward sees it: the numbers are symbols, the saved
    tensors fake, every other attribute read from the real ctx (and noted)."""

    def __init__(self, real: Any, saved: list[Any], symbols: dict[str, Any]) -> None:
        self.__dict__.update(symbols, saved_tensors=saved, _real=real, _reads=[])

    def __getattr__(self, name: str) -> Any:
        real = self.__dict__["_real"]
        value = getattr(real, name)
        if name in vars(real) and not isinstance(value, torch.Tensor):
            self.__dict__["_reads"].append((name, value))
        return value


#: Why a float expression the tensorify pass has no tensor form for is refused.
CANNOT_REBUILD = "which this torch's tensorify pass cannot rebuild: the backend's compile would fail"


class _FloatUses(TorchDispatchMode):
    """Notes each op a symbolic float depending on the run's symbols reaches, unless
    the tensorify pass can take it there or ``allow(func, args, leaf)`` says so;
    where that pass takes no Python arithmetic (torch 2.11 / 2.12), each op that
    any float computed from a float symbol reaches (``ctx.k * ctx.scale``); and
    where it does, each op a float expression reaches that it cannot rebuild from
    tensors (``ctx.k % 1000 * ctx.s``)."""

    def __init__(
        self, symbols: dict[Any, str], floats: set[Any], allow: Callable[[Any, tuple[Any, ...], Any], bool]
    ) -> None:
        super().__init__()
        self.symbols = symbols
        self.floats = floats if not tensorifies_python_arithmetic() else set()
        self.tensorifiable = tensorifiable_ops()
        self.allow = allow
        self.found: list[tuple[str, Any]] = []  # (symbol name, op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            if not isinstance(leaf, torch.SymFloat):
                continue
            expr = leaf.node.expr
            if func not in self.tensorifiable and not self.allow(func, args, leaf):
                self.found += [(self.symbols[sym], func) for sym in expr.free_symbols if sym in self.symbols]
            elif not expr.is_Symbol and self.floats:
                what = f"{func} (through Python arithmetic, {expr}, that this torch's tensorify pass does not take)"
                self.found += [(self.symbols[sym], what) for sym in expr.free_symbols if sym in self.floats]
            elif not expr.is_Symbol and not tensorify_interprets(expr):
                what = f"{func} (through {expr}, {CANNOT_REBUILD})"
                self.found += [(name, what) for name in sorted(self.symbols[sym] for sym in expr.free_symbols if sym in self.symbols)]
        return func(*args, **kwargs)


@dataclass
class SymbolicRun:
    """What running a backward on symbols cost (``run_symbolic``)."""

    result: Any  # what ``run`` returned (None if it raised)
    error: Exception | None  # what it raised
    guards: list[tuple[str, str]]  # (symbol name, guard in the symbols' names)
    float_uses: list[tuple[str, Any]]  # (symbol name, op) a float reached, refused
    sizes_only: bool = False  # every guard holds for any symbol values >= 2


@quietly
def run_symbolic(
    hints: dict[str, int | float],
    run: Callable[[dict[str, Any]], Any],
    allow: Callable[[Any, tuple[Any, ...], Any], bool] = lambda func, args, leaf: False,
) -> SymbolicRun:
    """Call ``run(symbols)`` in a private world: outside the capture's modes, under a
    fake mode over a fresh ShapeEnv (tensors ``run`` makes are fake), ``symbols``
    fresh SymInts / SymFloats named and hinted as in ``hints``. Report the guards it
    cost and each op a symbolic float reached that neither the tensorify pass nor
    ``allow`` takes. The probes of Python (here) and C++ (``cpptrace``) backwards."""
    with outside_capture():
        shape_env, fake_mode = symbolic_probe_mode()
        symbols = {name: new_symbol(shape_env, name, hint) for name, hint in hints.items()}
        names = {value.node.expr: name for name, value in symbols.items()}
        floats = {value.node.expr for value in symbols.values() if isinstance(value, torch.SymFloat)}
        uses = _FloatUses(names, floats, allow)
        result, error = None, None
        with fake_mode, torch.no_grad():
            try:
                with uses:
                    result = run(symbols)
            except Exception as e:  # noqa: BLE001 - the caller decides: opaque, the safe side
                error = e
    return SymbolicRun(
        result, error, guards_on(shape_env, names), uses.found,
        holds_for_sizes_above_one(shape_env, names),
    )


def _probe(
    ctx: Any, numbers: dict[str, int | float], saved: Sequence[Any], tensor_inputs: tuple[bool, ...],
    grads: Sequence[GradSpec],
) -> Verdict:
    def backward(symbols: dict[str, Any]) -> tuple[_StandIn, Any]:
        values = {name.removeprefix("ctx."): value for name, value in symbols.items()}
        stand_in = _StandIn(ctx, [empty_like(t) for t in saved], values)
        return stand_in, ctx._forward_cls.backward(stand_in, *incoming_grads(ctx, grads))

    probed = run_symbolic({f"ctx.{name}": hint for name, hint in numbers.items()}, backward)
    if probed.error is not None:
        # Opaque either way. A number used as a dim, a length or an index fails at
        # the stand-in value (a dim of 7 on a 2-d tensor); hinted with the real
        # values, the same run usually names the number and its guard instead.
        real = run_symbolic({f"ctx.{name}": getattr(ctx, name) for name in numbers}, backward)
        if real.error is None and real.guards:
            name, guard = real.guards[0]
            return Verdict(False, f"{name} needs its value (guard {guard})", name[4:])
        e = probed.error
        return Verdict(False, f"the probe could not run its backward ({exception_line(e)})", stock_runs_it=False)
    for name, guard in probed.guards:
        return Verdict(False, f"{name} needs its value (guard {guard})", name[4:])
    if probed.float_uses:
        name, op = probed.float_uses[0]
        if str(op).endswith(f"{CANNOT_REBUILD})"):
            return Verdict(False, f"{name} reaches {op}", name[4:], stock_runs_it=False)
        return Verdict(False, f"{name} (a float) reaches {op}, which would specialise it", name[4:])
    stand_in, outs = probed.result
    outs = outs if isinstance(outs, tuple) else (outs,)
    for i, out in enumerate(outs):
        if out is not None and not (i < len(tensor_inputs) and tensor_inputs[i]):
            # Eager's engine refuses it; stock CA would not: the opaque op raises as eager.
            return Verdict(
                False, f"its backward returns a gradient for forward input {i}, which is no tensor", stock_runs_it=False
            )
    guarded = []
    for name, value in stand_in._reads:
        if type(value) not in GUARDED_AS_STOCK:
            return Verdict(False, f"ctx.{name} (a {type(value).__name__}) is read: Dynamo guards its value", name)
        guarded.append(f"ctx.{name}")
    reason = "its ctx numbers only reach tensor math: " + ", ".join(f"ctx.{n}" for n in numbers) if numbers else NO_NUMBERS
    names = tuple(dict.fromkeys(guarded))
    if names:
        reason += f"; {', '.join(names)} guarded by Dynamo as stock guards it (a compile per distinct value)"
    return Verdict(True, reason, guarded=tuple(name[4:] for name in names))



def empty_like(t: Any) -> Any:
    """An empty tensor like capture tensor ``t``, its sizes concrete: fake under the
    probe's fake mode, real (uninitialised) outside it (``graphbreak``)."""
    if not isinstance(t, torch.Tensor):
        return t
    sizes, strides = size_hints(t)
    return torch.empty_strided(sizes, strides, dtype=t.dtype, device=t.device)


