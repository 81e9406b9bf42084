"""The opaque custom ops that run a custom-function backward inside a CA graph.

Dynamo traces a custom function's backward while compiling the CA graph, and the
backward's ``toInt()`` / ``ctx.k`` then guard on every saved value. Calling the
backward through an opaque ``torch.library`` op instead means Dynamo only sees the
op's fake impl (outputs built from the next edges' metadata): it installs no guard
on saved values and breaks no graph for non-traceable C++ functions.

* ``ca_dynsaved::cpp_function`` runs a C++ ``torch::autograd::Function``; its
  lifted ints and doubles arrive packed in two tensors (see ``scalars.py``).
* ``ca_dynsaved::py_function`` runs a Python ``autograd.Function`` backward with
  its real ctx, taken from CA's ``hooks`` of this run.

What the graph carries is structure only: a key naming a ``NodeSpec`` (argument
structure, constants of the output metadata; ``node_spec`` makes it from a capture's
call) in a process-local registry, and the node's slot. What belongs to one capture
rather than to the structure (the C++ functional, the bool/str/list ``saved_data``
values CA hashed, which gradients the backward leaves undefined) is a ``binding.NodeCapture``
the runtime wrapper binds for the run (``binding.bound_run``). Two captures that
differ only in hashed values therefore produce the same graph, and ``reuse.py`` can
give them one compiled function. What a backward returns is checked and made
op-safe by ``outputs.finish``; ``fuse.py``'s ``ca_dynsaved::chain`` runs a fused run
of these ops.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from ._compat.capture import call_backward, validate_outputs_fn
from ._compat.dynamo import CUDAGRAPH_UNSAFE, without_dynamo
from ._compat.engine import ForceDispatchKeys
from ._compat.layout import CppCall, metadata_device, metadata_sizes, pytree
from .caches import on_reset
from .binding import TIMING, bound, call_user_backward, timed
from .outputs import finish

# Leaf kinds of a node's flattened (call args, output metadata): a constant of the
# structure, a value of the capture, a tensor input, a lifted int / float, a size.
CONST, CAPTURED, TENSOR, INT, FLOAT, SYMINT = "const", "captured", "tensor", "int", "float", "symint"


@dataclass(frozen=True)
class NodeSpec:
    """The structure of one custom-function call: what the compiled graph depends on."""

    name: str  # node name, for messages
    treedef: pytree.TreeSpec  # structure of (call args, output metadata)
    leaves: tuple[tuple[str, Any], ...]  # (kind, constant or slot index)
    out_defined: tuple[bool, ...]  # False where the next edge is invalid (no grad needed)
    # (tensors, ints, floats, symints, captured) -> (call args, output metadata): this
    # call's values put back into its structure (_builder)
    build: Callable[..., tuple[Any, Any]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "build", _builder(self.treedef, self.leaves))


_REGISTRY: dict[str, NodeSpec] = {}


def register(spec: NodeSpec) -> str:
    """Store ``spec`` under a key derived from its content; return the key."""
    text = repr((spec.name, str(spec.treedef), spec.leaves, spec.out_defined))
    key = hashlib.sha1(text.encode()).hexdigest()[:20]
    _REGISTRY[key] = spec
    return key


def registry_size() -> int:
    return len(_REGISTRY)


@on_reset
def clear() -> None:
    """Forget every node spec (only safe when no plugin CA graph is cached)."""
    _REGISTRY.clear()
    _PARSED.clear()


# A graph compiled after the first run names what that run learned in the op's key,
# so fake impls and reuse see it as structure: the undefined outputs and the outputs
# that were an incoming grad as is ("<spec key>/101/-1,0,-1"; the last part only
# when there is one). The graph then uses that grad in place of such an output
# (reuse.name_learned_outputs), and the op returns None there: no copy.
def with_learned(key: str, defined: Sequence[bool], passthrough: Sequence[int]) -> str:
    key = key.split("/")[0] + "/" + "".join("1" if d else "0" for d in defined)
    if any(j >= 0 for j in passthrough):
        key += "/" + ",".join(str(j) for j in passthrough)
    return key


@dataclass(frozen=True)
class _Learned:
    """What a compiled graph's key says its first run learned (see with_learned)."""

    defined: tuple[bool, ...] | None = None
    passthrough: tuple[int, ...] | None = None


def _parse_key(key: str) -> tuple[NodeSpec, _Learned]:
    found = _PARSED.get(key)
    if found is None:
        spec_key, _, rest = key.partition("/")
        bits, _, through = rest.partition("/")
        learned = _Learned(
            tuple(b == "1" for b in bits) if bits else None,
            tuple(int(j) for j in through.split(",")) if through else None,
        )
        found = _PARSED[key] = (_REGISTRY[spec_key], learned)
    return found


_PARSED: dict[str, tuple[NodeSpec, _Learned]] = {}  # every run parses its keys


_SLOT_NAMES = {TENSOR: "t", INT: "i", FLOAT: "f", SYMINT: "s", CAPTURED: "k"}


def _builder(treedef: pytree.TreeSpec, leaves: Sequence[tuple[str, Any]]) -> Callable[..., Any]:
    """A function rebuilding (call args, output metadata) from this call's values.

    It runs on every backward of every opaque node, so instead of walking the
    treedef (pytree.tree_unflatten) it is one generated expression, as FX does for
    graphs; structures other than tuples, lists and dicts fall back to pytree."""
    consts: list[Any] = []
    it = iter(leaves)

    def expr(spec: pytree.TreeSpec) -> str:
        if spec.is_leaf():
            kind, payload = next(it)
            if kind is CONST:
                consts.append(payload)
                return f"c[{len(consts) - 1}]"
            return f"{_SLOT_NAMES[kind]}[{payload}]"
        children = [expr(child) for child in spec.children()]
        if spec.type is tuple:
            return "(" + "".join(f"{c}, " for c in children) + ")"
        if spec.type is list:
            return "[" + ", ".join(children) + "]"
        if spec.type is dict:
            keys = list(spec.context)
            consts.extend(keys)
            first = len(consts) - len(keys)
            return "{" + ", ".join(f"c[{first + n}]: {c}" for n, c in enumerate(children)) + "}"
        raise NotImplementedError(spec.type)

    try:
        source = f"lambda t, i, f, s, k: {expr(treedef)}"
    except NotImplementedError:
        slots = {TENSOR: 0, INT: 1, FLOAT: 2, SYMINT: 3, CAPTURED: 4}
        return lambda *values: pytree.tree_unflatten(
            [p if kind is CONST else values[slots[kind]][p] for kind, p in leaves], treedef
        )
    return eval(source, {"c": consts})  # noqa: S307 - our own generated expression


# --- a capture's call as a spec --------------------------------------------------------
class Unexpressible(Exception):
    """A call the opaque op cannot express (a symbolic bool, a symbolic float that is
    not a lifted saved value): the node keeps stock tracing."""


@dataclass(frozen=True)
class Captured:
    """Stands, in a call's arguments, for the capture's ``index``-th hashed saved value."""

    index: int


def node_spec(
    name: str, call_args: Any, meta: Sequence[Any], lifted: Mapping[Any, Any]
) -> tuple[str, list[Any], list[Any], bool]:
    """Register the structure of one call: its arguments (each hashed saved value a
    ``Captured``) and its next edges' symbolic metadata ``meta`` (None for an invalid
    edge). ``lifted``: symnode -> its ``decision.Lifted`` (read from the run). Returns
    the spec's key, the call's tensors and its other SymInts (the graph's arguments
    of the op), and whether it reads a lifted number. Raises ``Unexpressible``."""
    leaves, treedef = pytree.tree_flatten((call_args, meta))
    specs: list[tuple[str, Any]] = []
    tensors: list[Any] = []
    symints: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, Captured):
            specs.append((CAPTURED, leaf.index))
        elif isinstance(leaf, torch.Tensor):
            specs.append((TENSOR, len(tensors)))
            tensors.append(leaf)
        elif isinstance(leaf, (torch.SymInt, torch.SymFloat)):
            scalar = lifted.get(leaf.node)
            if scalar is not None:
                specs.append((scalar.kind, scalar.slot))
            elif isinstance(leaf, torch.SymInt):
                specs.append((SYMINT, len(symints)))
                symints.append(leaf)
            else:
                raise Unexpressible(f"a symbolic {type(leaf).__name__} that is not a lifted saved value")
        elif isinstance(leaf, torch.SymBool):
            raise Unexpressible("a symbolic bool")
        else:
            specs.append((CONST, leaf))
    out_defined = tuple(m is not None for m in meta)  # None: invalid next edge
    key = register(NodeSpec(name, treedef, tuple(specs), out_defined))
    return key, tensors, symints, any(kind in (INT, FLOAT) for kind, _ in specs)



@without_dynamo
def run_cpp(grads, tensors, symints, key, slot):  # type: ignore[no-untyped-def]
    # Excluded from Dynamo: this runs inside backward, which may run inside a
    # compiled frame, and a traced copy would freeze the saved values it read.
    # The lifted numbers come from the run (bound_run): Python numbers already, and
    # no tensor arguments for the dispatcher to convert, once per node.
    start = time.perf_counter() if TIMING else 0.0
    spec, learned = _parse_key(key)
    run = bound(spec.name)
    node = run.nodes[slot]
    args, out_meta = spec.build(tensors, run.ints, run.floats, symints, node.captured)
    if run.autocast is None and not TIMING:  # the common path: no extra frame
        outs, backward = node.fn(list(grads), *args), 0.0  # type: ignore[misc]
    else:
        outs, backward = call_user_backward(run, node.fn, list(grads), *args)  # type: ignore[arg-type]
    result = finish(spec, node, learned, outs, out_meta, grads, tensors, (_describe_cpp, args))
    if TIMING:
        timed(start, backward)
    return result


def _describe_ctx(ctx: Any) -> str:
    """A Python ctx's attributes, for an error message."""
    return f"ctx attributes {vars(ctx)}"


def _describe_cpp(args: Sequence[Any]) -> str:
    """A C++ call's saved values, for an error message."""
    call = CppCall.parse(args)
    return f"saved {dict(zip(call.keys, call.values))}"


@without_dynamo
def run_python(grads, saved, symints, key, slot, hook):  # type: ignore[no-untyped-def]
    start = time.perf_counter() if TIMING else 0.0
    spec, learned = _parse_key(key)
    run = bound(spec.name)
    node, ctx = run.nodes[slot], run.hooks[hook]
    (positions,), out_meta = spec.build(saved, (), (), symints, node.captured)
    # Under the caller's dispatch keys, as eager's engine calls it: a compiled graph
    # calls the op below autograd (AOTAutograd's runtime, the dispatcher's autograd
    # fallback exclude the autograd keys), where a backward that differentiates
    # something itself (torch.autograd.grad under enable_grad: an adjoint) would
    # record no history. Python backwards only: it costs each of the backward's ops
    # a pass through autograd (docs/benchmarks.md, "Component costs").
    with ForceDispatchKeys(*run.keys):  # type: ignore[misc]  (bound for a Python node)
        outs, backward = call_user_backward(run, call_backward, ctx, list(saved), *grads)
    for i, out in enumerate(outs):
        if out is not None and i not in positions:
            # The engine's own error for this case.
            raise RuntimeError(
                f"function {spec.name}Backward returned a gradient different than None at "
                f"position {i + 1}, but the corresponding forward input was not a Variable"
            )
    outs = [outs[i] if i < len(outs) else None for i in positions]
    result = finish(spec, node, learned, outs, out_meta, grads, saved, (_describe_ctx, ctx))
    if TIMING:
        timed(start, backward)
    return result

# --- the ops -------------------------------------------------------------------------
# Defined with torch.library.Library rather than custom_op: these run once per node
# per backward, and custom_op's autograd and dispatch wrappers add a cost to every
# call (docs/benchmarks.md, "Component costs").
# Gradients never flow through them (create_graph runs call the runners directly).
#
# Tagged cudagraph_unsafe: their Python reads this run's saved values (the lifted
# numbers, the ctx in CA's hooks, the bound capture data). A CUDA graph records the
# kernels an op launches once and then only replays them, so a recorded op would
# replay the first step's values forever. With the tag, inductor's graph partitioning
# runs each op between CUDA-graphed partitions (and without partitioning, skips CUDA
# graphs for the graph) - see CUDAGRAPH_UNSAFE.
LIB = torch.library.Library("ca_dynsaved", "DEF")  # fuse.py defines its op here too
LIB.define(
    "cpp_function(Tensor?[] grads, Tensor?[] tensors, SymInt[] symints, str key, int slot) -> Tensor?[]",
    tags=(CUDAGRAPH_UNSAFE,),
)
LIB.define(
    "py_function(Tensor?[] grads, Tensor?[] saved, SymInt[] symints, str key, int slot, "
    "int hook) -> Tensor?[]",
    tags=(CUDAGRAPH_UNSAFE,),
)
LIB.impl("cpp_function", run_cpp, "CompositeExplicitAutograd")
LIB.impl("py_function", run_python, "CompositeExplicitAutograd")




def fake_outputs(key: str, tensors, symints) -> list[torch.Tensor | None]:  # type: ignore[no-untyped-def]
    spec, learned = _parse_key(key)
    defined = learned.defined
    if learned.passthrough is not None:  # the graph uses the grad itself there
        defined = tuple(d and j < 0 for d, j in zip(defined or spec.out_defined, learned.passthrough))
    # Saved values only feed the call args; the output metadata holds none of them.
    _, out_meta = spec.build(tensors, defaultdict(int), defaultdict(float), symints, defaultdict(type(None)))
    outs: list[torch.Tensor | None] = []
    for d, meta in zip(defined or spec.out_defined, out_meta):
        if not d:
            outs.append(None)
            continue
        empty = torch.empty(metadata_sizes(meta), device=metadata_device(meta))
        # validate_outputs gives the dtype (and layout) eager's engine would.
        outs.append(validate_outputs_fn()([empty], [meta])[0].contiguous())
    return outs


@torch.library.register_fake("ca_dynsaved::cpp_function", lib=LIB)
def _(grads, tensors, symints, key, slot):  # type: ignore[no-untyped-def]
    return fake_outputs(key, tensors, symints)


@torch.library.register_fake("ca_dynsaved::py_function", lib=LIB)
def _(grads, saved, symints, key, slot, hook):  # type: ignore[no-untyped-def]
    return fake_outputs(key, saved, symints)




#: The OpOverloads CA graphs call.
CPP_OP = torch.ops.ca_dynsaved.cpp_function.default
PY_OP = torch.ops.ca_dynsaved.py_function.default
# Never removed as dead code, by FX, AOTAutograd or inductor: an op whose outputs
# the graph uses none of (each one the incoming grad, passed on without a copy) must
# still run the user's backward, which checks that it still passes them through.
for _op in (CPP_OP, PY_OP):
    torch.fx.node.has_side_effect(_op)
#: Direct (differentiable) runners, used when a graph runs with create_graph=True.
RUNNERS = {CPP_OP: run_cpp, PY_OP: run_python}
#: Position of the ``key`` argument of each op.
KEY_ARG = {CPP_OP: 3, PY_OP: 3}


def slots_in(graph: torch.fx.Graph) -> list[int]:
    """The slots (``NodeCapture`` indices) of the opaque ops in ``graph``."""
    return [node.args[KEY_ARG[node.target] + 1] for node in graph.nodes if node.target in KEY_ARG]
