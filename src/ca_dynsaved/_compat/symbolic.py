"""A private symbolic world for probing a backward, and reading the capture's symbols.

Touches: ``torch.fx.experimental.symbolic_shapes`` (``ShapeEnv``, ``DimDynamic``,
guards and replacements, ``TLS.suppress_guards``, ``optimization_hint`` /
``size_hint``), ``torch._subclasses.fake_tensor`` (``FakeTensorMode``,
``unset_fake_temporarily``), ``torch._dynamo.source.ConstantSource``,
``torch.fx.passes._tensorify_python_scalars.SUPPORTED_OPS``,
``torch.utils._sympy.interp.handlers`` / ``reference.TensorReferenceAnalysis``,
``torch.utils._python_dispatch.TorchDispatchMode``, ``Tensor._make_wrapper_subclass``
(``dispatch_sizes_strides_policy``). Releases:
``optimization_hint`` is 2.12+ (2.11: ``size_hint``); the tensorify pass lists Python
operators on 2.13+, only ATen ops on 2.11 / 2.12.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable, Iterator

import torch
from torch.fx.experimental import symbolic_shapes as _symbolic_shapes
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

#: A mode that sees every ATen op a backward runs (the probes record with it).
TorchDispatchMode = TorchDispatchMode


class RecordingMode(TorchDispatchMode):
    """A mode for verify's per-step recording, which runs outside any Dynamo frame
    (the runtime wrapper, or a capture's eager probe): torch wraps a subclass's
    ``__torch_dispatch__`` in a Dynamo-disabling frame unless the subclass declines,
    a Python frame and four eval-frame swaps on every op verify records."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def real_tensors_only() -> Any:
    """``outside_capture()`` where a fake or proxy mode may be active (any mode on
    torch's dispatch stack, as in a capture); nothing where none is (verify at run
    time): the ExitStack costs about as much as recording three ops."""
    return outside_capture() if torch._C._len_torch_dispatch_stack() else contextlib.nullcontext()


class SizeWatched(torch.Tensor):
    """A real tensor whose size, stride and numel queries dispatch to Python: under a
    ``TorchDispatchMode`` they appear as ops (``aten.sym_size.default``,
    ``aten.size.default``, ``aten.dim.default``...), so a recording sees where C++
    code reads a tensor's sizes, which on a plain tensor no mode can see. Ops run on
    the wrapped tensor and return wrapped results, so what the code computes from
    its inputs is watched too."""

    __slots__ = ("inner",)
    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "SizeWatched":
        self = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=inner.device,
            dispatch_sizes_strides_policy="sizes",
        )
        self.inner = inner
        return self

    def __repr__(self) -> str:
        return f"SizeWatched({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # By hand, not pytree (ATen arguments nest only lists and tuples). verify's
        # recorder unwraps in its own walk (sentinel._leaves_of), so its ops never
        # reach this second dispatch.
        return watched(func(*map(_unwrapped, args), **{k: _unwrapped(v) for k, v in (kwargs or {}).items()}))


def _unwrapped(value: Any) -> Any:
    kind = type(value)
    if kind is SizeWatched:
        return value.inner
    if kind is list or kind is tuple:
        return kind(map(_unwrapped, value))
    return value


def watched(value: Any) -> Any:
    """An op's results as SizeWatched's dispatch returns them: each tensor wrapped."""
    if isinstance(value, torch.Tensor):
        return SizeWatched(value)
    kind = type(value)
    if kind is list or kind is tuple:
        return kind(map(watched, value))
    return value


def symbolic_probe_mode() -> tuple[Any, Any]:
    """(ShapeEnv, FakeTensorMode over it), fresh: nothing shared with a capture."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    # A tensor kept as a ctx attribute is real: faked on first use.
    return shape_env, FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)


def new_symbol(shape_env: Any, name: str, hint: int | float) -> Any:
    """A fresh SymInt / SymFloat called ``name`` with ``hint``, never specialised
    on 0 or 1 (what Dynamo makes of a dynamic int or float it reads)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    source = ConstantSource(name)
    sym = shape_env.create_unspecified_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    create = shape_env.create_symintnode if type(hint) is int else shape_env.create_symfloatnode
    return create(sym, hint=hint, source=source)


def guards_on(shape_env: Any, names: dict[Any, str]) -> list[tuple[str, str]]:
    """(name, guard text) for each guard or specialisation of ``shape_env`` that
    names one of the symbols in ``names`` (symbol -> name), the guard written with
    those names."""
    found = [(guard.expr, str(guard.expr)) for guard in shape_env.guards]
    found += [(sym, f"{sym} specialized to {value}") for sym, value in shape_env.replacements.items()]
    result = []
    for expr, text in found:
        named = [names[sym] for sym in expr.free_symbols if sym in names]
        if named:
            for sym, name in names.items():
                text = re.sub(rf"\b{sym}\b", name, text)
            result.append((named[0], text))
    return result


def holds_for_sizes_above_one(shape_env: Any, names: dict[Any, str]) -> bool:
    """Whether every guard and specialisation ``shape_env`` recorded holds whatever
    sizes >= 2 its symbols (``names``) take: what fake tensors ask of any size (not
    0 or 1, non-negative), not a branch on one value or on two sizes' order. Checked
    on assignments of small, large, equal, increasing and decreasing sizes."""
    import sympy

    exprs = [guard.expr for guard in shape_env.guards]
    exprs += [sympy.Eq(sym, value) for sym, value in shape_env.replacements.items()]
    symbols = sorted(names, key=str)
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]
    assignments = [
        [2] * len(symbols),
        [1_000_003] * len(symbols),
        [primes[i % len(primes)] for i in range(len(symbols))],
        [primes[-1 - i % len(primes)] for i in range(len(symbols))],
        [10 ** (1 + i % 6) for i in range(len(symbols))],
        [10 ** (6 - i % 6) for i in range(len(symbols))],
    ]
    for values in assignments:
        mapping = dict(zip(symbols, values))
        for expr in exprs:
            if expr.free_symbols - set(mapping) or expr.xreplace(mapping) != sympy.true:
                return False
    return True


#: The concrete value of a SymInt (an int as is), read without guarding. torch
#: 2.12+: optimization_hint; 2.11: size_hint (the same read, for a backed symbol).
optimization_hint: Callable[[Any], int] = (
    getattr(_symbolic_shapes, "optimization_hint", None) or _symbolic_shapes.size_hint
)


def size_hints(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Concrete sizes and strides of a (possibly symbolic) capture tensor, read
    without guarding."""
    return [optimization_hint(s) for s in t.shape], [optimization_hint(s) for s in t.stride()]


def concrete(value: Any) -> Any:
    """``value`` with every SymInt / SymFloat in it replaced by its hint, read without
    guarding: capture data a private fake-tensor run may use."""
    def hint(v: Any) -> Any:
        if isinstance(v, torch.SymInt):
            return optimization_hint(v)
        return float(v.node.hint) if isinstance(v, torch.SymFloat) else v

    return pytree.tree_map(hint, value)


def outside_capture() -> Any:
    """Leave the capture's fake and proxy modes for a block (the probe's own fake
    tensors must not be traced into the CA graph), and its suppression of guards,
    which is thread-wide: the probe's ShapeEnv must record every guard."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    stack = contextlib.ExitStack()
    stack.enter_context(disable_proxy_modes_tracing())
    stack.enter_context(unset_fake_temporarily())
    stack.enter_context(_guards_recorded())
    return stack


@contextlib.contextmanager
def _guards_recorded() -> Iterator[None]:
    from torch.fx.experimental import symbolic_shapes

    prior = getattr(symbolic_shapes.TLS, "suppress_guards", False)
    symbolic_shapes.TLS.suppress_guards = False
    try:
        yield
    finally:
        symbolic_shapes.TLS.suppress_guards = prior


@functools.cache
def tensorifiable_ops() -> frozenset[Any]:
    """The ops whose float arguments the backends' tensorify pass turns into tensor
    arguments; a symbolic float reaching any other op gets specialised there
    (``torch/fx/passes/_tensorify_python_scalars.py``)."""
    from torch.fx.passes._tensorify_python_scalars import SUPPORTED_OPS

    return frozenset(SUPPORTED_OPS)


def tensorify_interprets(expr: Any) -> bool:
    """Whether the tensorify pass can rebuild symbolic float ``expr`` from tensors: it
    interprets each sympy function of it with ``TensorReferenceAnalysis``
    (``torch.utils._sympy.interp``), which has no handler for some (``PythonMod``:
    ``ctx.k % 1000 * ctx.s`` fails the backend's compile, under stock CA once the
    numbers are dynamic). Interprets it the same way on real 0-dim tensors, as the
    pass does on its graph's (``aten.scalar_tensor`` of each symbol)."""
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import TensorReferenceAnalysis

    try:
        with outside_capture():
            env = {sym: torch.scalar_tensor(7 if sym.is_integer else 0.37) for sym in expr.free_symbols}
            sympy_interp(TensorReferenceAnalysis, env, expr)
    except Exception:  # noqa: BLE001 - no handler, or one that fails: the pass would fail too
        return False
    return True


def tensorifies_python_arithmetic() -> bool:
    """Whether the tensorify pass takes a float through Python arithmetic on it
    (``ctx.k * ctx.scale``, a Dynamo graph node ``operator.mul``): torch 2.13+ lists
    the Python operators among its ops; 2.11 and 2.12 only ATen ops, so there a
    float that went through Python arithmetic is specialised (measured: one compile
    per value of ``ctx.scale`` in ``g * (ctx.k * ctx.scale)``)."""
    import operator

    return operator.mul in tensorifiable_ops()
