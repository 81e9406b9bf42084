"""Capture-time hooks: the AutogradCompilerInstance subclass.

C++ calls ``bind_function``, ``apply_functional``, ``validate_outputs``,
``begin_capture`` and ``end_capture`` on the instance by name, so overriding them
is enough to change how C++ custom-function nodes enter the CA graph:

* ``begin_capture`` remembers which symbolic scalars are lifted ``saved_data``
  values (the ``scalars`` placeholder);
* ``apply_functional`` of a C++ custom function records the call instead of
  tracing it, and ``validate_outputs`` (which C++ calls right after, with the
  symbolic output sizes) emits one opaque op that runs the backward and validates
  its outputs;
* ``end_capture`` wraps the runtime wrapper so it packs the lifted scalars into
  two tensors the opaque ops read (the graph no longer uses the Python scalars,
  so Dynamo guards on none of them).

Every override is excluded from Dynamo: capture runs inside ``.backward()``, which
may run inside a compiled frame (see DESIGN-NOTES pitfall 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from . import _compat, opaque, runtime
from .report import NodeRecord, record_capture

_disable = torch._dynamo.disable


@dataclass
class _PendingCall:
    """A custom-function call seen by apply_functional, waiting for its metadata."""

    name: str
    op_name: str  # the CppNode op bound by bind_function, for the stock fallback
    fn: Callable[..., Any]
    grads: list[Any]
    args: tuple[Any, ...]
    dummies: list[torch.Tensor]
    out_defined: tuple[bool, ...]


class _Unsupported(Exception):
    """This node cannot be made opaque; it keeps stock behaviour."""


class DynSavedCompilerInstance(_compat.StockCompilerInstance):
    """A CA capture that makes C++ custom-function nodes opaque to Dynamo.

    ``exclude``: substrings of C++ node names (e.g. ``"MyFunction"``) that keep
    stock behaviour.
    """

    def __init__(self, compiler_fn: Callable[..., Any], exclude: frozenset[str] = frozenset()) -> None:
        super().__init__(compiler_fn)
        self.exclude = exclude

    @_disable
    def begin_capture(self, inputs, sizes, scalars_, origins, accumulate_grad, check_nans):  # type: ignore[no-untyped-def,override]
        out = super().begin_capture(inputs, sizes, scalars_, origins, accumulate_grad, check_nans)
        symbolic = out[3]
        # symnode -> (kind, index among scalars of that kind)
        self._lifted: dict[Any, tuple[str, int]] = {}
        self._scalar_kinds: list[str] = []
        n_int = n_float = 0
        for sym in symbolic:
            if isinstance(sym, torch.SymInt):
                self._lifted[sym.node] = (opaque.INT, n_int)
                self._scalar_kinds.append(opaque.INT)
                n_int += 1
            else:
                self._lifted[sym.node] = (opaque.FLOAT, n_float)
                self._scalar_kinds.append(opaque.FLOAT)
                n_float += 1
        self._n_scalars = len(symbolic)
        self._packed_proxies: tuple[Any, Any] | None = None
        self._custom_fns: dict[str, Callable[..., Any]] = {}
        self._pending: _PendingCall | None = None
        self._records: list[NodeRecord] = []
        self._keys: list[str] = []
        return out

    @_disable
    def bind_function(self, fn_name, fn, is_custom_function, is_traceable):  # type: ignore[no-untyped-def,override]
        name = super().bind_function(fn_name, fn, is_custom_function, is_traceable)
        if is_custom_function:
            self._custom_fns[name] = fn
        return name

    @_disable
    def apply_functional(self, fn_name, grads, args, output_metadata):  # type: ignore[no-untyped-def,override]
        if fn_name not in self._custom_fns:
            return super().apply_functional(fn_name, grads, args, output_metadata)
        name = _compat.cpp_node_name(args)
        if any(pattern in name for pattern in self.exclude):
            self._records.append(
                NodeRecord(name, opaque=False, keys=(), kinds=(), reason="excluded by enable(exclude=...)")
            )
            _compat.counters["ca_dynsaved"]["stock_nodes"] += 1
            return super().apply_functional(fn_name, grads, args, output_metadata)
        with torch.fx.experimental.proxy_tensor.disable_proxy_modes_tracing():
            dummies = [self.allocate_dummy() for _ in output_metadata]
        self._pending = _PendingCall(
            name=name,
            op_name=fn_name,
            fn=self._custom_fns[fn_name],
            grads=list(grads),
            args=tuple(args),
            dummies=dummies,
            out_defined=tuple(m is not None for m in output_metadata),
        )
        return dummies

    @_disable
    def validate_outputs(self, _, outputs, args, output_metadata):  # type: ignore[no-untyped-def,override]
        pending, self._pending = self._pending, None
        if pending is None:
            return super().validate_outputs(_, outputs, args, output_metadata)
        if len(outputs) != len(pending.dummies) or any(
            o is not d for o, d in zip(outputs, pending.dummies)
        ):
            raise RuntimeError(
                f"ca_dynsaved: validate_outputs after {pending.name} got other tensors "
                "than its outputs; this torch's CA capture order is not supported"
            )
        (meta,) = args
        try:
            proxy_out, record = self._emit_opaque(pending, meta)
        except _Unsupported as e:
            record = self._emit_stock(pending, args, output_metadata, reason=str(e))
        else:
            self.bind_objects_to_proxies(
                outputs, [proxy_out[i] for i in range(len(outputs))]
            )
        self._records.append(record)
        return outputs

    def _emit_stock(self, pending: _PendingCall, args, output_metadata, reason: str) -> NodeRecord:
        """Trace the node as stock CA would, for a call the op cannot express."""
        op = _compat.ca.ops.get(pending.op_name)
        proxy_args = pytree.tree_map(self.to_proxy, (pending.grads, *pending.args))
        proxy_out = self.fx_tracer.create_proxy("call_function", op, proxy_args, {})
        self.bind_objects_to_proxies(
            pending.dummies, [proxy_out[i] for i in range(len(pending.dummies))]
        )
        super().validate_outputs(None, pending.dummies, args, output_metadata)
        _compat.counters["ca_dynsaved"]["stock_nodes"] += 1
        return NodeRecord(pending.name, opaque=False, keys=(), kinds=(), reason=reason)

    def _emit_opaque(self, pending: _PendingCall, meta: Any) -> tuple[Any, NodeRecord]:
        try:
            keys, values, _ = _compat.split_cpp_node_args(pending.args)
        except _compat.LayoutError as e:
            raise _Unsupported(str(e)) from e
        leaves, treedef = pytree.tree_flatten((pending.args, meta))
        specs: list[tuple[str, Any]] = []
        tensors: list[Any] = []
        symints: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                specs.append((opaque.TENSOR, len(tensors)))
                tensors.append(self.to_proxy(leaf))
            elif isinstance(leaf, (torch.SymInt, torch.SymFloat)):
                lifted = self._lifted.get(leaf.node)
                if lifted is not None:
                    specs.append(lifted)
                elif isinstance(leaf, torch.SymInt):
                    specs.append((opaque.SYMINT, len(symints)))
                    symints.append(self.to_proxy(leaf))
                else:
                    raise _Unsupported(f"a symbolic {type(leaf).__name__} that is not a lifted saved value")
            elif isinstance(leaf, torch.SymBool):
                raise _Unsupported("a symbolic bool")
            else:
                # Anything else CA hashed into its cache key: fixed for this graph.
                specs.append((opaque.CONST, leaf))
        spec = opaque.NodeSpec(
            name=pending.name,
            fn=pending.fn,
            treedef=treedef,
            leaves=tuple(specs),
            out_defined=pending.out_defined,
        )
        key = opaque.register(spec)
        self._keys.append(key)
        ints_proxy, floats_proxy = self._packed_scalar_proxies()
        proxy_out = self.fx_tracer.create_proxy(
            "call_function",
            opaque.OP,
            (self.to_proxy(pending.grads), tensors, ints_proxy, floats_proxy, symints, key),
            {},
        )
        kinds = tuple(_value_kind(v, self._lifted) for v in values)
        counters = _compat.counters["ca_dynsaved"]
        counters["opaque_nodes"] += 1
        counters["lifted_ints"] += kinds.count("int")
        counters["lifted_floats"] += kinds.count("float")
        return proxy_out, NodeRecord(pending.name, opaque=True, keys=tuple(keys), kinds=kinds)

    def _packed_scalar_proxies(self) -> tuple[Any, Any]:
        if self._packed_proxies is None:
            self._packed_proxies = (
                self.scalars_proxy[self._n_scalars],
                self.scalars_proxy[self._n_scalars + 1],
            )
        return self._packed_proxies

    def create_graph_module(self, id: str) -> torch.fx.GraphModule:  # type: ignore[override]
        self._graph_module = super().create_graph_module(id)
        return self._graph_module

    @_disable
    def end_capture(self, outputs):  # type: ignore[no-untyped-def,override]
        runtime_wrapper, compiled_fn = super().end_capture(outputs)
        record_capture(self._records)
        if not self._keys:
            return runtime_wrapper, compiled_fn
        wrapper = runtime.make_runtime_wrapper(
            runtime_wrapper, self._graph_module, self._scalar_kinds, self._keys
        )
        return wrapper, compiled_fn


def _value_kind(value: Any, lifted: dict[Any, tuple[str, int]]) -> str:
    if isinstance(value, (torch.SymInt, torch.SymFloat)) and value.node in lifted:
        return lifted[value.node][0]
    return type(value).__name__
