"""The opaque custom ops that run a custom-function backward inside a CA graph.

Dynamo traces a custom function's backward while compiling the CA graph, and the
backward's ``toInt()`` / ``ctx.k`` then guard on every saved value. Calling the
backward through an opaque ``torch.library`` op instead means Dynamo only sees the
op's fake impl (outputs built from the next edges' metadata): it installs no guard
on saved values and breaks no graph for non-traceable C++ functions.

* ``ca_dynsaved::cpp_function`` runs a C++ ``torch::autograd::Function``; its
  lifted ints and doubles arrive packed in two tensors (see ``runtime.py``).
* ``ca_dynsaved::py_function`` runs a Python ``autograd.Function`` backward with
  its real ctx, taken from CA's ``hooks`` of this run.

What the graph carries is structure only: a key naming a ``NodeSpec`` (argument
structure, constants of the output metadata) in a process-local registry, and the
node's slot. What belongs to one capture rather than to the structure (the C++
functional, the bool/str/list ``saved_data`` values CA hashed, which gradients the
backward leaves undefined) is a ``NodeCapture`` the runtime wrapper binds for the
run (``bound_run``). Two captures that differ only in hashed values therefore
produce the same graph, and ``reuse.py`` can give them one compiled function.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from . import _compat

# Leaf kinds of a node's flattened (call args, output metadata): a constant of the
# structure, a value of the capture, a tensor input, a lifted int / float, a size.
CONST, CAPTURED, TENSOR, INT, FLOAT, SYMINT = "const", "captured", "tensor", "int", "float", "symint"


@dataclass(frozen=True)
class NodeSpec:
    """The structure of one custom-function call: what the compiled graph depends on."""

    name: str  # node name, for messages
    treedef: _compat.pytree.TreeSpec  # structure of (call args, output metadata)
    leaves: tuple[tuple[str, Any], ...]  # (kind, constant or slot index)
    out_defined: tuple[bool, ...]  # False where the next edge is invalid (no grad needed)

    def __post_init__(self) -> None:
        object.__setattr__(self, "build", _builder(self.treedef, self.leaves))


@dataclass
class NodeCapture:
    """What one opaque node of one capture holds besides its structure."""

    fn: Callable[..., Any] | None  # C++: CppNode_apply_functional_ivalue<T>; Python: None
    captured: tuple[Any, ...]  # the values of the CAPTURED leaves
    defined: tuple[bool, ...] | None = None  # which outputs its backward returned, once run
    # per output, what validate_outputs kept as it was on the first run, as
    # (type, dtype, device, layout), else None (see _finish)
    kept: tuple[tuple[Any, ...] | None, ...] | None = None
    # per output, the incoming grad it returned as is on that run (its index), or -1
    passthrough: tuple[int, ...] | None = None


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
    """Forget every node spec and chain (only safe when no plugin CA graph is cached)."""
    _REGISTRY.clear()
    _PARSED.clear()
    _CHAINS.clear()


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


def _rebuild(spec: NodeSpec, tensors, ints, floats, symints, captured) -> tuple[Any, Any]:  # type: ignore[no-untyped-def]
    """(call args, output metadata) of ``spec`` with this call's values filled in."""
    return spec.build(tensors, ints, floats, symints, captured)  # type: ignore[attr-defined]


_SLOT_NAMES = {TENSOR: "t", INT: "i", FLOAT: "f", SYMINT: "s", CAPTURED: "k"}


def _builder(treedef: _compat.pytree.TreeSpec, leaves: Sequence[tuple[str, Any]]) -> Callable[..., Any]:
    """A function rebuilding (call args, output metadata) from this call's values.

    It runs on every backward of every opaque node, so instead of walking the
    treedef (pytree.tree_unflatten) it is one generated expression, as FX does for
    graphs; structures other than tuples, lists and dicts fall back to _compat.pytree."""
    consts: list[Any] = []
    it = iter(leaves)

    def expr(spec: _compat.pytree.TreeSpec) -> str:
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
        return lambda *values: _compat.pytree.tree_unflatten(
            [p if kind is CONST else values[slots[kind]][p] for kind, p in leaves], treedef
        )
    return eval(source, {"c": consts})  # noqa: S307 - our own generated expression


# --- what the runtime wrapper binds for one run ---------------------------------------
_local = threading.local()


@dataclass(frozen=True)
class _Run:
    """What one run of a CA graph binds for its opaque ops (see ``bound_run``)."""

    hooks: Sequence[Any]  # CA's hooks of this run: the Python ctx objects
    nodes: Sequence[NodeCapture]  # the capture's nodes, by slot
    autocast: _compat.AutocastState | None  # the caller's autocast state
    keys: tuple[Any, Any]  # the caller's local dispatch key sets (_compat.dispatch_keys)
    # this run's lifted ints and doubles (runtime.Packer), which the C++ ops'
    # INT / FLOAT leaves index
    ints: Sequence[int] = ()
    floats: Sequence[float] = ()


class bound_run:
    """Make this run's CA ``hooks`` (holding the Python ctx objects), the capture's
    nodes, its lifted numbers and the caller's autocast state visible to the ops: a
    custom op takes no Python objects, and runs where autocast may have been switched
    off (below). A class, not a generator: it is entered on every backward."""

    __slots__ = ("_run", "_prior")

    def __init__(
        self, hooks: Sequence[Any], nodes: Sequence[NodeCapture], ints: Sequence[int] = (), floats: Sequence[float] = ()
    ) -> None:
        self._run = _Run(hooks, nodes, _compat.autocast_state(), _compat.dispatch_keys(), ints, floats)

    def __enter__(self) -> None:
        self._prior = getattr(_local, "run", None)
        _local.run = self._run

    def __exit__(self, *exc: Any) -> None:
        _local.run = self._prior


def _bound(spec: NodeSpec) -> _Run:
    run = getattr(_local, "run", None)
    if run is None:
        raise RuntimeError(f"ca_dynsaved: {spec.name} run outside the runtime wrapper of its CA graph")
    return run


@contextlib.contextmanager
def _caller_autocast(state: _compat.AutocastState) -> Iterator[None]:
    """Run a backward under the autocast state of the code that called backward.

    Eager's engine runs a custom backward under its caller's autocast state.
    AOTAutograd runs a compiled graph under ``torch._C._DisableAutocast`` (autocast
    is already baked into the ops it traced), but an opaque op's backward was never
    traced: without this its matmuls would run in float32 where eager's run in
    bfloat16."""
    devices, cache_enabled = state
    with contextlib.ExitStack() as stack:
        for device, dtype in devices:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache_enabled))
        yield


# --- what the ops cost the plugin (benchmarks/test_opaque_overhead.py) -------------------
_TIMING: list[dict[str, float]] = []  # non-empty while timing(): the totals being kept


@contextlib.contextmanager
def timing() -> Iterator[dict[str, float]]:
    """Within the block, add up the seconds the ops spend (``ops``), of which in
    the user's backward (``backward``), count the calls (``calls``), and add up the
    runtime wrapper's own seconds before a compiled run (``wrapper``: report, scalar
    packing): the plugin's own share of an opaque node is ``ops - backward``, the
    op's dispatch, and ``wrapper`` over the graph's nodes."""
    totals = {"ops": 0.0, "backward": 0.0, "calls": 0, "wrapper": 0.0}
    _TIMING.append(totals)
    try:
        yield totals
    finally:
        _TIMING.remove(totals)


def _timed(start: float, backward: float) -> None:
    totals = _TIMING[-1]
    totals["ops"] += time.perf_counter() - start
    totals["backward"] += backward
    totals["calls"] += 1


def _call_backward(run: _Run, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` (the user's backward) under the caller's autocast state, and its
    seconds while timing (else 0)."""
    called = time.perf_counter() if _TIMING else 0.0
    if run.autocast is None:  # no contextmanager on the common path
        outs = fn(*args)
    else:
        with _caller_autocast(run.autocast):
            outs = fn(*args)
    return outs, (time.perf_counter() - called if _TIMING else 0.0)


# --- real impls ----------------------------------------------------------------------
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


@_compat.without_dynamo
def run_cpp(grads, tensors, symints, key, slot):  # type: ignore[no-untyped-def]
    # Excluded from Dynamo: this runs inside backward, which may run inside a
    # compiled frame, and a traced copy would freeze the saved values it read.
    # The lifted numbers come from the run (bound_run): Python numbers already, and
    # no tensor arguments for the dispatcher to convert, once per node.
    start = time.perf_counter() if _TIMING else 0.0
    spec, learned = _parse_key(key)
    run = _bound(spec)
    node = run.nodes[slot]
    args, out_meta = spec.build(tensors, run.ints, run.floats, symints, node.captured)  # type: ignore[attr-defined]
    if run.autocast is None and not _TIMING:  # the common path: no extra frame
        outs, backward = node.fn(list(grads), *args), 0.0  # type: ignore[misc]
    else:
        outs, backward = _call_backward(run, node.fn, list(grads), *args)  # type: ignore[arg-type]
    result = _finish(spec, node, learned, outs, out_meta, grads, tensors, (_describe_cpp, args))
    if _TIMING:
        _timed(start, backward)
    return result


def _describe_ctx(ctx: Any) -> str:
    """A Python ctx's attributes, for an error message."""
    return f"ctx attributes {vars(ctx)}"


def _describe_cpp(args: Sequence[Any]) -> str:
    """A C++ call's saved values, for an error message."""
    call = _compat.CppCall.parse(args)
    return f"saved {dict(zip(call.keys, call.values))}"


@_compat.without_dynamo
def run_python(grads, saved, symints, key, slot, hook):  # type: ignore[no-untyped-def]
    start = time.perf_counter() if _TIMING else 0.0
    spec, learned = _parse_key(key)
    run = _bound(spec)
    node, ctx = run.nodes[slot], run.hooks[hook]
    (positions,), out_meta = _rebuild(spec, saved, (), (), symints, node.captured)
    # Under the caller's dispatch keys, as eager's engine calls it: a compiled graph
    # calls the op below autograd (AOTAutograd's runtime, the dispatcher's autograd
    # fallback exclude the autograd keys), where a backward that differentiates
    # something itself (torch.autograd.grad under enable_grad: an adjoint) would
    # record no history. Python backwards only: it costs each of the backward's ops
    # a pass through autograd (2-3 us a C++ node of the chain benchmark).
    with _compat.ForceDispatchKeys(*run.keys):
        outs, backward = _call_backward(run, _compat.call_backward, ctx, list(saved), *grads)
    for i, out in enumerate(outs):
        if out is not None and i not in positions:
            # The engine's own error for this case.
            raise RuntimeError(
                f"function {spec.name}Backward returned a gradient different than None at "
                f"position {i + 1}, but the corresponding forward input was not a Variable"
            )
    outs = [outs[i] if i < len(outs) else None for i in positions]
    result = _finish(spec, node, learned, outs, out_meta, grads, saved, (_describe_ctx, ctx))
    if _TIMING:
        _timed(start, backward)
    return result


def _finish(spec, node, learned, outs, out_meta, grads, tensors, describe):  # type: ignore[no-untyped-def]
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
            or out.shape != _compat.metadata_sizes(meta)
        ):
            return False
    return True


def _aliases(out: torch.Tensor, tensors: Sequence[torch.Tensor | None]) -> bool:
    for t in tensors:
        if t is not None and _is_alias_of(out, t):
            return True
    return False


_is_alias_of = _compat.is_alias_of


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
    return _compat.validate_outputs_fn()


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


# --- the ops -------------------------------------------------------------------------
# Defined with torch.library.Library rather than custom_op: these run once per node
# per backward, and custom_op's autograd and dispatch wrappers cost ~60 us a call.
# Gradients never flow through them (create_graph runs call the runners directly).
#
# Tagged cudagraph_unsafe: their Python reads this run's saved values (the lifted
# numbers, the ctx in CA's hooks, the bound capture data). A CUDA graph records the
# kernels an op launches once and then only replays them, so a recorded op would
# replay the first step's values forever. With the tag, inductor's graph partitioning
# runs each op between CUDA-graphed partitions (and without partitioning, skips CUDA
# graphs for the graph) - see _compat.CUDAGRAPH_UNSAFE.
_lib = torch.library.Library("ca_dynsaved", "DEF")
_lib.define(
    "cpp_function(Tensor?[] grads, Tensor?[] tensors, SymInt[] symints, str key, int slot) -> Tensor?[]",
    tags=(_compat.CUDAGRAPH_UNSAFE,),
)
_lib.define(
    "py_function(Tensor?[] grads, Tensor?[] saved, SymInt[] symints, str key, int slot, "
    "int hook) -> Tensor?[]",
    tags=(_compat.CUDAGRAPH_UNSAFE,),
)
_lib.define(
    "chain(Tensor?[] grads, Tensor?[] tensors, SymInt[] symints, str plan) -> Tensor?[]",
    tags=(_compat.CUDAGRAPH_UNSAFE,),
)
_lib.impl("cpp_function", run_cpp, "CompositeExplicitAutograd")
_lib.impl("py_function", run_python, "CompositeExplicitAutograd")


# --- a run of opaque ops as one (fuse.py) ------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One opaque op of a chain: which runner, its key / slot / hook (None for C++),
    its slices of the chain's tensors and symints, and where its incoming grads come
    from (None: the chain's ``grads``; else indices into the previous step's outputs)."""

    key: str
    slot: int
    hook: int | None
    tensors: tuple[int, int]
    symints: tuple[int, int]
    sources: tuple[int, ...] | None


_CHAINS: dict[str, tuple[Step, ...]] = {}


def register_chain(steps: Sequence[Step]) -> str:
    """Store a chain's steps under a key derived from their content; return it."""
    steps = tuple(steps)
    plan = hashlib.sha1(repr(steps).encode()).hexdigest()[:20]
    _CHAINS[plan] = steps
    return plan


def chain_steps(plan: str) -> tuple[Step, ...]:
    return _CHAINS[plan]


@_compat.without_dynamo
def run_chain(grads, tensors, symints, plan):  # type: ignore[no-untyped-def]
    """Each step's op, in order, on the previous one's outputs, inside one dispatch:
    what the ops would do one by one, without the dispatcher between them."""
    outs = grads
    for step in _CHAINS[plan]:
        step_grads = grads if step.sources is None else [outs[j] for j in step.sources]
        step_tensors = tensors[step.tensors[0] : step.tensors[1]]
        step_symints = symints[step.symints[0] : step.symints[1]]
        if step.hook is None:
            outs = run_cpp(step_grads, step_tensors, step_symints, step.key, step.slot)
        else:
            outs = run_python(step_grads, step_tensors, step_symints, step.key, step.slot, step.hook)
    return outs


_lib.impl("chain", run_chain, "CompositeExplicitAutograd")


def _fake_outputs(key: str, tensors, symints) -> list[torch.Tensor | None]:  # type: ignore[no-untyped-def]
    spec, learned = _parse_key(key)
    defined = learned.defined
    if learned.passthrough is not None:  # the graph uses the grad itself there
        defined = tuple(d and j < 0 for d, j in zip(defined or spec.out_defined, learned.passthrough))
    # Saved values only feed the call args; the output metadata holds none of them.
    _, out_meta = _rebuild(
        spec, tensors, defaultdict(int), defaultdict(float), symints, defaultdict(type(None))
    )
    outs: list[torch.Tensor | None] = []
    for d, meta in zip(defined or spec.out_defined, out_meta):
        if not d:
            outs.append(None)
            continue
        empty = torch.empty(_compat.metadata_sizes(meta), device=_compat.metadata_device(meta))
        # validate_outputs gives the dtype (and layout) eager's engine would.
        outs.append(_compat.validate_outputs_fn()([empty], [meta])[0].contiguous())
    return outs


@torch.library.register_fake("ca_dynsaved::cpp_function", lib=_lib)
def _(grads, tensors, symints, key, slot):  # type: ignore[no-untyped-def]
    return _fake_outputs(key, tensors, symints)


@torch.library.register_fake("ca_dynsaved::py_function", lib=_lib)
def _(grads, saved, symints, key, slot, hook):  # type: ignore[no-untyped-def]
    return _fake_outputs(key, saved, symints)


@torch.library.register_fake("ca_dynsaved::chain", lib=_lib)
def _(grads, tensors, symints, plan):  # type: ignore[no-untyped-def]
    last = _CHAINS[plan][-1]
    return _fake_outputs(last.key, tensors[last.tensors[0] : last.tensors[1]], symints[last.symints[0] : last.symints[1]])


#: The OpOverloads CA graphs call.
CPP_OP = torch.ops.ca_dynsaved.cpp_function.default
PY_OP = torch.ops.ca_dynsaved.py_function.default
CHAIN_OP = torch.ops.ca_dynsaved.chain.default
# Never removed as dead code, by FX, AOTAutograd or inductor: an op whose outputs
# the graph uses none of (each one the incoming grad, passed on without a copy) must
# still run the user's backward, which checks that it still passes them through.
for _op in (CPP_OP, PY_OP, CHAIN_OP):
    torch.fx.node.has_side_effect(_op)
#: Direct (differentiable) runners, used when a graph runs with create_graph=True.
RUNNERS = {CPP_OP: run_cpp, PY_OP: run_python, CHAIN_OP: run_chain}
#: Position of the ``key`` argument of each op.
KEY_ARG = {CPP_OP: 3, PY_OP: 3}
