"""What happens to one custom-function node of a capture, decided before anything runs.

Every custom-function node a capture meets gets one ``Decision``: its handling
(``TRACED``, ``OPAQUE`` or ``STOCK``), the reason, and the plan its mechanism needs.
The module of its way (``ways/``, which ``compiler.py`` dispatches to) carries out
the plan, and ``report`` prints the handling and the reason as they are, so "why did my node run opaque" is answered by one function per kind of
node, here, each from what the capture knows (the call's arguments and lifted
scalars, the ctx, the user's options):

* ``decide_cpp``: a C++ ``torch::autograd::Function`` (``apply_functional``);
* ``decide_python``: a Python ``autograd.Function`` (``proxy_call_backward``).

The plans:

* ``CppTrace``: the backward reads its numbers symbolically (``cpptrace``): traced as
  it is, its lifted ints dynamic, its doubles read from the packed float64 tensor;
* ``SentinelTrace``: a ``toInt()`` / ``toDouble()`` reader (by default, or named in
  ``trace_cpp``), or a C++ function with hashed values in its first capture
  (``tiers.COMBINATIONS``) (``sentinel``): traced with sentinels, rewritten to the lifted
  and computed values, each new tuple of values checked before the compiled graph
  uses it (``verify``: off only for a ``trace_cpp`` name with ``verify=False``);
* ``Tiered``: a combination of a C++ function's hashed values first met after its
  first capture: opaque while new, its own graph once it repeats;
* ``PythonTrace``: stock CA traces it, its ctx numbers dynamic from the first
  compile (``pyctx``, ``probe``);
* ``OpaqueCall``: one opaque op runs the backward with this step's values
  (``opaque``); which saved values it takes from the capture rather than the graph.

The probes behind a decision (``cpptrace``, ``sentinel``, ``probe``, ``graphbreak``)
cache their verdicts per function and layout. A decision changes once at most: an
opaque node whose call the op cannot express (known only when ``validate_outputs``
gives its outputs' symbolic metadata) keeps stock tracing (``Decision.demoted``).
Model: thunder's ``splitter.py``, a ``SplitReason`` per node.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

import torch

from ._compat.capture import is_unpack_placeholder
from ._compat.layout import CppCall, LayoutError, cpp_node_name, pytree
from . import checkpoint, cpptrace, graphbreak, policies, probe, pyctx, recording, sentinel, tiers
from .names import Handling, Reason
from .opaque import FLOAT
from .probe import is_number

# Short names of the vocabulary (``names.py``) the decisions speak.
TRACED, OPAQUE, STOCK, REUSED = Handling.TRACED, Handling.OPAQUE, Handling.STOCK, Handling.REUSED
EXCLUDED, HASHED_ONLY, HASHED_ONLY_LATER = Reason.EXCLUDED, Reason.HASHED_ONLY, Reason.HASHED_ONLY_LATER
_LATER_COMBINATION, UNPACKED_AT_RUN_TIME = Reason.LATER_COMBINATION, Reason.UNPACKED_AT_RUN_TIME


@dataclass(frozen=True)
class Options:
    """What the user chose for a plugin context (``enable``'s options)."""

    exclude: frozenset[str] = frozenset()  # name substrings that keep stock
    python_policy: str = policies.AUTO
    trace_cpp: frozenset[str] = frozenset()  # C++ name substrings opted into tracing
    verify: bool = True  # for trace_cpp nodes; nodes traced by default always verify
    cpp_policy: str = policies.AUTO

    def excluded(self, name: str) -> bool:
        return any(pattern in name for pattern in self.exclude)


@dataclass(frozen=True)
class Lifted:
    """A ``saved_data`` int or double CA lifted into the graph's ``scalars``."""

    kind: str  # INT or FLOAT
    slot: int  # its index among the lifted scalars of its kind (the packed tensors)
    index: int  # its index among all lifted scalars (``scalars[index]``)
    value: int | float  # its value at capture


@dataclass(frozen=True)
class CppTrace:
    """Trace the C++ backward as it is; ``scalars``: the lifted scalars (indices) it
    reads, dynamic from the first compile; ``floats``: one of them is a double."""

    scalars: tuple[int, ...]
    floats: bool


@dataclass(frozen=True)
class SentinelTrace:
    """Trace the C++ backward with sentinels for its numbers (``sentinel.Plan``),
    then make them the lifted ``scalars``; ``verify``: check each new tuple."""

    plan: sentinel.Plan
    inputs: recording.Inputs
    scalars: tuple[int, ...]
    verify: bool
    optin: bool = True  # named in trace_cpp (else traced by default, always verified)


@dataclass(frozen=True)
class Tiered:
    """A later combination of a C++ function's hashed values (``tiers.COMBINATIONS``), or a
    Python backward stock would recompile for or break the graph at
    (``_python_tiered``): the capture holds both ways to run
    the node, ``opaque`` (what runs first, sharing compiled code with the function's
    other later combinations) and ``traced`` (its own graph, traced with sentinels,
    or as stock traces it (``traced`` None: a C++ function that saves no numbers, a
    Python backward's graph-broken pieces), compiled once the capture has run
    ``tiers.SPECIALISE_AFTER_RUNS`` times: ``ways.tiered``)."""

    opaque: "OpaqueCall"
    traced: SentinelTrace | None  # None: no saved numbers, stock's trace
    #: A traced Python node with guarded values (``PythonTrace.guarded``): its
    #: traced graph runs from the first run; its opaque op, in the capture's opaque
    #: graph, takes the combinations ``ways.python_traced.Combinations`` sends away
    guarded: "PythonTrace | None" = None


@dataclass(frozen=True)
class PythonTrace:
    """Stock CA traces the Python backward; ``sources``: its ctx numbers as Dynamo
    names them (``L['hooks'][0].k``), dynamic from the first compile; ``guarded``:
    the bools / strs / Nones it reads, which Dynamo guards (``ways.python_traced.Combinations``
    probes each new combination of them before a compile)."""

    sources: tuple[str, ...]
    guarded: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpaqueCall:
    """One opaque op runs the backward. C++: ``captured`` holds the saved values CA
    hashed (bool, str, None, lists), which reach the op as data of the capture;
    ``slots`` gives, per saved value, its index there (None: a lifted number, read
    from the run). Python: ``inputs``, the positions of the forward's tensor inputs."""

    captured: tuple[Any, ...] = ()
    slots: tuple[int | None, ...] = ()
    inputs: tuple[int, ...] = ()


Plan = Union[CppTrace, SentinelTrace, Tiered, PythonTrace, OpaqueCall, None]


@dataclass(frozen=True)
class Decision:
    """One node's handling, why, and the plan its mechanism runs. ``saved``: per
    saved key or ctx attribute, (key, type name, value at capture, lifted scalar
    index or None), what the report shows of it; for a C++ node, a lifted number's
    type name is its kind (INT / FLOAT), and an entry without an index is a value CA
    hashed."""

    name: str
    kind: str  # "C++" or "Python"
    handling: str
    reason: str
    saved: tuple[tuple[str, str, Any, int | None], ...] = ()
    plan: Plan = None

    @property
    def verified(self) -> bool:
        """Traced with sentinels, each new value checked (traced-with-verify)."""
        return isinstance(self.plan, SentinelTrace) and self.plan.verify

    def demoted(self, reason: str) -> "Decision":
        """This node kept as stock CA traces it, for ``reason``."""
        return dataclasses.replace(self, handling=STOCK, reason=reason, plan=None)


def decide_cpp(
    args: Sequence[Any],
    fn: Callable[..., Any],
    traceable: bool,
    options: Options,
    lifted: Mapping[Any, Lifted],
    undefined: tuple[bool, ...] = (),
    capture: int = 0,
) -> tuple[Decision, CppCall | None]:
    """The decision for a C++ custom function's call (CA's ``args``), and the call
    parsed (None where its layout is not CA's): ``fn`` its functional, ``traceable``
    whether it declares ``is_traceable``, ``lifted`` the capture's lifted scalars by
    symnode, ``undefined`` which incoming grads the capture has as None, ``capture``
    the CA capture's id."""
    try:
        call = CppCall.parse(args)  # the one parse of CA's layout
    except LayoutError as e:
        return Decision(cpp_node_name(args), "C++", STOCK, str(e)), None
    node = Decision(call.name, "C++", STOCK, "", _cpp_saved(call, lifted))
    if options.excluded(call.name):
        return dataclasses.replace(node, reason=EXCLUDED), call
    optin = any(pattern in call.name for pattern in options.trace_cpp)
    policy = policies.AUTO if optin else options.cpp_policy
    if policy == policies.STOCK:
        return dataclasses.replace(node, reason="cpp_policy='stock'"), call
    if not traceable:
        return opaque_cpp(node, call, "not is_traceable: its backward is not traced"), call
    if policy == policies.OPAQUE:
        return opaque_cpp(node, call, "cpp_policy='opaque'"), call
    if any(map(is_unpack_placeholder, call.saved)):
        return opaque_cpp(node, call, UNPACKED_AT_RUN_TIME), call
    # the lifted numbers, in the call's order: index among all lifted scalars, kind
    scalars = tuple(index for *_, index in node.saved if index is not None)
    kinds = {key: kind for key, kind, _, index in node.saved if index is not None}
    verdict = cpptrace.verdict(fn, call, lifted)
    if verdict.traced:
        sizes = cpptrace.size_dependence(fn, call)
        if not sizes:
            trace = CppTrace(scalars, FLOAT in kinds.values())
            return dataclasses.replace(node, handling=TRACED, reason=verdict.reason, plan=trace), call
        return opaque_cpp(node, call, sizes), call
    hashed = {key: value for key, _, value, index in node.saved if index is None}
    if len(kinds) + len(hashed) != len(call.keys):
        return opaque_cpp(node, call, verdict.reason), call  # a saved value of no kind we take
    later = bool(hashed) and not tiers.COMBINATIONS.specialised(call.name, call.keys, repr(tuple(hashed.values())), capture)
    if later and not tiers.COMBINATIONS.may_specialise(call.name, call.keys):
        return opaque_cpp(node, call, f"{verdict.reason}; {_LATER_COMBINATION}: {_capped()}"), call
    if not kinds:
        # No numbers: nothing for the plugin to lift. Stock's trace, fused, its hashed
        # values constants of the graph (stock's compile per combination) for the
        # combinations of the function's first capture; a later one tiered as below,
        # its own graph stock's trace.
        if not later:
            return dataclasses.replace(node, reason=HASHED_ONLY), call
        first = opaque_cpp(node, call, f"{HASHED_ONLY_LATER}; {_LATER_COMBINATION}: {_tiered()}")
        return dataclasses.replace(first, plan=Tiered(first.plan, None)), call  # type: ignore[arg-type]
    # A plain toInt()/toDouble() reader (or one with hashed values): traced with
    # sentinels if it passes its numbers only to ATen ops, each new value verified
    # unless the user opted it in and turned verify off (docs/cpp.md, "Why the
    # default is sound"); its hashed values are constants of this capture's graph.
    inputs = recording.Inputs.of(fn, call, undefined, hashed)
    plan = sentinel.plan(call.name, inputs, kinds, warn=optin)
    sizes = cpptrace.size_dependence(fn, call) if plan.traced else ""
    if sizes and optin:
        sentinel.refused(call.name, sizes)
    if not plan.traced or sizes:
        refusal = sizes or plan.reason
        return opaque_cpp(node, call, f"trace_cpp refused: {refusal}" if optin else f"{verdict.reason}; {refusal}"), call
    verify = options.verify or not optin or bool(plan.derived)  # verify's run gives the derived values
    checked = "; each new value verified" if verify else ""
    how = "opt-in (trace_cpp)" if optin else "traced with sentinels"
    constants = f"; its hashed values ({', '.join(hashed)}) constants of this graph" if hashed else ""
    trace = SentinelTrace(plan, inputs, scalars, verify, optin)
    if later:
        first = opaque_cpp(node, call, f"{verdict.reason}; {_LATER_COMBINATION}: {_tiered()}")
        return dataclasses.replace(first, plan=Tiered(first.plan, trace)), call  # type: ignore[arg-type]
    return dataclasses.replace(node, handling=TRACED, reason=f"{how}: {plan.reason}{checked}{constants}", plan=trace), call




def _tiered() -> str:
    return f"opaque and uncompiled until the capture's run {tiers.SPECIALISE_AFTER_RUNS}, then its own traced graph"


def _capped() -> str:
    return f"opaque, sharing compiled code with its other later combinations (the function has {tiers.MAX_SPECIALISED} with graphs of their own)"


def opaque_cpp(node: Decision, call: CppCall, reason: str) -> Decision:
    """Opaque, each saved value CA hashed (``node.saved``'s entries without a lifted
    index) taken from the capture."""
    hashed = {key: value for key, _, value, index in node.saved if index is None}
    captured = tuple(hashed.values())
    order = {key: n for n, key in enumerate(hashed)}
    plan = OpaqueCall(captured, tuple(order.get(key) for key in call.keys))
    return dataclasses.replace(node, handling=OPAQUE, reason=reason, plan=plan)


def _cpp_saved(call: CppCall, lifted: Mapping[Any, Lifted]) -> tuple[tuple[str, str, Any, int | None], ...]:
    saved = []
    for key, value in zip(call.keys, call.values):
        if _is_symbolic(value) and value.node in lifted:
            scalar = lifted[value.node]
            saved.append((key, scalar.kind, scalar.value, scalar.index))
        elif _is_hashed_constant(value):
            saved.append((key, type(value).__name__, value, None))
    return tuple(saved)


def decide_python(
    ctx: Any,
    hook: int,
    options: Options,
    backward_state_idx: Any,
    opaque_object_indices: Any,
    saved: Sequence[Any],
    tensor_inputs: tuple[bool, ...],
) -> Decision | None:
    """The decision for a Python custom function's node (its ``ctx``, at ``hooks[hook]``;
    ``saved``: its saved tensors at capture; ``tensor_inputs``: which forward inputs
    were tensors), or None for torch's own compiled backward, which is no user
    function (stock, unreported)."""
    if hasattr(ctx._forward_cls, "_aot_id"):
        return None
    attributes = vars(ctx).items()
    saved_values = tuple((k, type(v).__name__, v, None) for k, v in attributes if not isinstance(v, torch.Tensor))
    node = Decision(ctx._forward_cls.__name__, "Python", STOCK, "", saved_values)
    inputs = tuple(i for i, tensor in enumerate(tensor_inputs) if tensor)
    opaque = dataclasses.replace(node, handling=OPAQUE, plan=OpaqueCall(inputs=inputs))
    if options.excluded(node.name):
        return dataclasses.replace(node, reason=EXCLUDED)
    policy = options.python_policy
    stock = pyctx.stock_reason(ctx, policy, backward_state_idx, opaque_object_indices)
    if stock is not None:
        return dataclasses.replace(node, reason=stock)
    if checkpoint.is_reentrant(ctx._forward_cls):
        return dataclasses.replace(opaque, reason=Reason.REENTRANT)
    has_numbers = any(is_number(v) for v in vars(ctx).values())
    if has_numbers and policy == policies.OPAQUE:
        return opaque
    # A saved tensor a hook unpacks at run time (a checkpointed region's) is a
    # placeholder here: neither probe can run the backward on it.
    unpacked = any(map(is_unpack_placeholder, saved))
    if has_numbers and unpacked:
        return dataclasses.replace(opaque, reason=UNPACKED_AT_RUN_TIME)
    if has_numbers:
        verdict = probe.verdict(ctx, saved, tensor_inputs)
        if not verdict.traced and not verdict.stock_runs_it:  # stock's compile would fail, or differ from eager
            return dataclasses.replace(opaque, reason=verdict.reason)
    breaks = None if unpacked else graphbreak.break_reason(ctx, saved)  # unpacked: as stock
    refused = verdict.reason if has_numbers and not verdict.traced else None  # the probe's, named first
    if breaks is not None and breaks.startswith(graphbreak.TRACING_FAILED):  # stock's compile would fail
        return dataclasses.replace(opaque, reason=refused or breaks)
    if refused is not None:
        return _python_tiered(opaque, refused)
    if breaks is not None:
        return _python_tiered(opaque, breaks)
    if has_numbers:
        plan = PythonTrace(tuple(pyctx.dynamic_sources(ctx, hook)), verdict.guarded)
        if plan.guarded:  # also its opaque op: the shared graph past the combinations' cap
            return dataclasses.replace(node, handling=TRACED, reason=verdict.reason, plan=Tiered(opaque.plan, None, plan))  # type: ignore[arg-type]
        return dataclasses.replace(node, handling=TRACED, reason=verdict.reason, plan=plan)
    if not unpacked and probe.hashed_values(ctx):
        # No numbers, but a bool / str the backward may read: stock's trace, each
        # combination guarded as stock guards it, and the capture's opaque graph for
        # combinations past the cap (where stock would run the whole backward eagerly).
        verdict = probe.verdict(ctx, saved, tensor_inputs)
        if verdict.traced and verdict.guarded:
            plan = Tiered(opaque.plan, None, PythonTrace((), verdict.guarded))
            return dataclasses.replace(node, handling=TRACED, reason=verdict.reason, plan=plan)  # type: ignore[arg-type]
    return dataclasses.replace(
        node, reason=f"{probe.NO_NUMBERS}, and Dynamo traces its backward (bools, strs and tensors keep stock tracing)"
    )


def _python_tiered(opaque: Decision, reason: str) -> Decision:
    """A Python backward stock would recompile for (a value it specialises on) or
    break the graph at: opaque while stock's graph would recompile (new values, new
    sizes); stock's graph, its pieces fused, once the capture has shown it repeats
    (``ways.tiered.wrap``; the capture's record says when: ``specialised``,
    ``despecialised``)."""
    return dataclasses.replace(opaque, reason=reason, plan=Tiered(opaque.plan, None))  # type: ignore[arg-type]


def _is_symbolic(value: Any) -> bool:
    return isinstance(value, (torch.SymInt, torch.SymFloat))


def _is_hashed_constant(value: Any) -> bool:
    """A saved value CA hashed into its cache key: nothing symbolic or tensor in it."""
    return not any(
        isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))
        for leaf in pytree.tree_leaves(value)
    )
