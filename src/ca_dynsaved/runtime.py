"""The runtime wrapper of a plugin CA graph: what each run needs, and which code runs.

* Scalars: CA passes the lifted ``saved_data`` ints and doubles as a list of Python
  numbers (the ``scalars`` placeholder). Dynamo guards on a Python number it reads,
  so the graph never hands them to an op: the opaque ops read them from the run
  (``Packer`` splits them once per run), and where a traced node reads them the
  wrapper appends two tensors (all lifted ints as int64, all lifted doubles as
  float64), whose metadata, fixed for a CA graph, is all Dynamo guards.
* Bound data: CA's ``hooks`` (where the Python ctx objects are) and the capture's
  ``NodeCapture``s (hashed values, C++ functionals), for the ops to read.
* Which code: whether a backward leaves a gradient undefined cannot be seen at
  capture, so the first run of a capture is the captured graph run eagerly; it
  records those gradients, which then become part of the graph (``reuse.py``), and
  later runs use the compiled function of that graph, or of an equal one compiled
  for another capture. A backward with ``create_graph=True`` (grad mode on inside
  CA) must record the backward's own autograd history, which an opaque op without
  a derivative cuts; CA's cache does not tell such calls apart, so those calls run
  the captured graph eagerly with each opaque op replaced by a direct call.
* Verify: a C++ node traced with sentinels (``sentinel``) has
  a ``Check``; each new tuple of its saved numbers is recorded (``sentinel.check``)
  before the compiled graph may use it. A refused tuple runs that step eagerly on a
  copy of the graph where the node's C++ functional is called directly instead of
  its traced ops (``Fallback``).
* Final callbacks: those queued while the graph runs by code outside Dynamo's graph
  run after it, as after an eager backward (``running_final_callbacks``; stock CA
  drops them, FSDP2's post-backward among them).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import heapq
import logging
import operator
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ._compat.capture import counters, graphs_compiled
from ._compat.dynamic_state import mark_dynamic_scalars
from ._compat.dynamo import without_dynamo
from ._compat.engine import collecting_final_callbacks
from ._compat.layout import CppCall
from . import binding, checkpoint, fuse, opaque, recording, reuse, sentinel
from . import decision
from .records import CaptureRecord


log = logging.getLogger("ca_dynsaved")


class Packer:
    """A graph's lifted scalars (CA's list, by capture-time ``kinds``) split into its
    ints and its doubles, for the opaque C++ ops (``binding.bound_run``), and, with
    ``tensors`` (a traced node reads them), packed into one int64 and one float64
    tensor appended to the graph's scalars. Built once per graph: each run picks by
    precomputed indices and checks the types, both in C (itemgetter, issuperset).
    ``owners``: per lifted scalar, whose saved key it is ("MyFn's 'k'"), for the
    error a changed type gives."""

    def __init__(self, kinds: Sequence[str], tensors: bool, owners: dict[int, str] | None = None) -> None:
        self.kinds = tuple(kinds)
        self.tensors = tensors
        self.owners = owners or {}
        self._ints = _picker([i for i, kind in enumerate(self.kinds) if kind is opaque.INT])
        self._floats = _picker([i for i, kind in enumerate(self.kinds) if kind is not opaque.INT])

    def check_types(self, values: Sequence[Any]) -> None:
        """Raise ``SavedTypeChangedError`` for the first lifted value whose type is not its
        type at capture (CA's cache key does not hold it; an int64 slot would
        truncate a float, and a bool is no int here): before the graph runs."""
        if len(values) != len(self.kinds):
            raise RuntimeError(
                f"ca_dynsaved: CA graph captured with {len(self.kinds)} lifted scalars, called with {len(values)}"
            )
        if _ONLY_INT.issuperset(map(type, self._ints(values))) and _ONLY_FLOAT.issuperset(map(type, self._floats(values))):
            return
        index, value = next((i, v) for i, v in enumerate(values) if type(v) is not (int if self.kinds[i] is opaque.INT else float))
        raise SavedTypeChangedError(self.owners.get(index, f"lifted scalar {index}"), self.kinds[index], value)

    def __call__(
        self, values: list[Any], derived_ints: Sequence[int] = (), derived_floats: Sequence[float] = ()
    ) -> tuple[Sequence[int], Sequence[float], list[Any]]:
        """(the ints, the doubles, the graph's scalars: ``values``, then the packed
        tensors if any, the doubles computed from the saved numbers at the end of the
        float64 one, then the ints computed from them: ``sentinel.Derived``), for
        values ``check_types`` passed."""
        ints, floats = self._ints(values), self._floats(values)
        if not self.tensors:
            return ints, floats, values
        packed = (*floats, *derived_floats) if derived_floats else floats
        # frombuffer over an array (the tensor keeps it alive) is cheaper than
        # torch.tensor(list), which converts each element; it refuses an empty buffer.
        return ints, floats, [
            *values,
            torch.frombuffer(array.array("q", ints), dtype=torch.int64) if ints else _EMPTY_INTS,
            torch.frombuffer(array.array("d", packed), dtype=torch.float64) if packed else _EMPTY_FLOATS,
            *derived_ints,
        ]


class SavedTypeChangedError(TypeError):
    """A C++ function's saved number has another type than at capture.

    Raised before the backward's graph runs (nothing has run) when a ``saved_data``
    key the plugin lifted was an int at capture and is a double now, or the other way
    round: compiled autograd's cache key does not hold the type, so CA hands the step
    to the graph captured for the other type, which cannot take it. The message names
    the node, the key, both types and the fix: save the key as one type in the
    forward (``static_cast<double>(...)`` every time).

    Args:
        owner: the node and key, as "Fn's saved 'k'".
        kind: its kind at capture ("int" or "float").
        value: its value now.

    Example::

        try:
            with ca_dynsaved.enable():
                loss.backward()
        except ca_dynsaved.SavedTypeChangedError as e:
            print(e.owner, e.kind, e.value)
    """

    def __init__(self, owner: str, kind: str, value: Any) -> None:
        was = "an int" if kind is opaque.INT else "a double"
        now = {int: "an int", float: "a double", bool: "a bool"}.get(type(value), f"a {type(value).__name__}")
        super().__init__(
            f"ca_dynsaved: {owner} was {was} at capture and is {now} now ({value!r}): compiled autograd "
            f"keeps one graph for both types, so its graph cannot take it. Save it as one type in the "
            f"forward ({'static_cast<double>(...) every time' if kind is opaque.INT else 'the same type every time'})."
        )
        self.owner, self.kind, self.value = owner, kind, value


def _picker(indices: Sequence[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    if not indices:
        return lambda values: ()
    if len(indices) == 1:
        (index,) = indices
        return lambda values: (values[index],)
    return operator.itemgetter(*indices)


_ONLY_INT, _ONLY_FLOAT = frozenset({int}), frozenset({float})
_EMPTY_INTS = torch.empty(0, dtype=torch.int64)
_EMPTY_FLOATS = torch.empty(0, dtype=torch.float64)


@dataclass
class Fallback:
    """A sentinel-traced node, called directly: for a step whose values its check
    refused. The C++ functional and its concrete call data, each saved number's
    (kind, index in the packed tensors), and the CA graph's nodes of its incoming
    grads, saved tensors, packed scalars, of what its trace recorded and returned.
    Its grads and saved tensors are kept alive in the capture's graph by a
    ``keep_alive`` node (CA's dead-code pass would drop one the traced ops do not
    use), which the graph that runs compiled does not have (``fallback_base``)."""

    fn: Callable[..., Any]
    call: CppCall  # detached: filled in by each run
    numbers: tuple[tuple[str | None, Any], ...]  # (kind, slot); (None, the value) if hashed
    grads: list[torch.fx.Node | None]
    saved: list[torch.fx.Node | None]
    packed: list[torch.fx.Node]
    region: list[torch.fx.Node]
    outputs: list[torch.fx.Node | None]
    # CA's validation of its outputs, the one reader of them outside the region (an
    # output may be an input as it is, which other nodes read too)
    validate: torch.fx.Node | None = None

    def run(self, grads: list[Any], saved: list[Any], ints: torch.Tensor, floats: torch.Tensor) -> list[Any]:
        """The backward with this run's saved numbers; the forward outputs' sizes
        (output_info) are the incoming grads' of this run."""
        numbers = [i if kind is None else (ints if kind is opaque.INT else floats)[i].item() for kind, i in self.numbers]
        call = self.call.with_output_sizes([None if g is None else g.shape for g in grads])
        return list(call.call(self.fn, grads, values=numbers, saved=saved))

    @property
    def name(self) -> str:
        return self.call.name

    def remapped(self, env: dict[torch.fx.Node, torch.fx.Node]) -> "Fallback":
        """The same node, its graph nodes those ``env`` maps them to (a graph's copy)."""
        def one(node: torch.fx.Node | None) -> torch.fx.Node | None:
            return None if node is None else env.get(node)

        return dataclasses.replace(
            self,
            grads=[one(g) for g in self.grads],
            saved=[one(t) for t in self.saved],
            packed=[env[p] for p in self.packed],
            region=[env[n] for n in self.region if n in env],
            outputs=[one(o) for o in self.outputs],
            validate=one(self.validate),
        )


def keep_alive(*nodes: Any) -> None:
    """A user of a sentinel-traced node's inputs in the capture's graph (never run:
    removed before the graph is compiled or run)."""


# Side-effectful to FX's dead-code pass, so CA's own pass keeps what it holds.
torch.fx.node.has_side_effect(keep_alive)


#: verify results kept per plan, the least recently used dropped first (a step counter
#: makes one a step; a tuple that comes back after this many others is checked again).
CHECKED_LIMIT = 256


@dataclass
class Check:
    """verify: which saved-number tuples of one opted-in node the template holds for."""

    name: str
    plan: sentinel.Plan
    inputs: recording.Inputs
    keys: tuple[str, ...]
    indices: tuple[int, ...]  # each key's index among the lifted scalars
    fallback: Fallback
    # where its derived values go: (Derived.index, index among the graph's derived ints / floats)
    int_slots: tuple[tuple[int, int], ...] = ()
    float_slots: tuple[tuple[int, int], ...] = ()
    derived: tuple[Any, ...] = ()  # of the last tuple checked

    def __post_init__(self) -> None:
        # what the check's result depends on besides the values: the plan (whose cache
        # it is) and the small tensors' layout
        self._layout = repr((self.inputs.saved, self.inputs.grads))
        self._pick = _picker(self.indices)

    def refusal(self, scalars: Sequence[Any]) -> str:
        """'' if these scalars' values may run traced; else why not (cached per tuple,
        shared by the nodes of one plan; a float keyed by repr: -0.0 is not 0.0, and
        a NaN is unequal to itself). Sets ``derived``: the values the backward
        computes from them, which the graph takes as inputs."""
        values = self._pick(scalars)
        key = (self._layout, *[repr(v) if type(v) is float else v for v in values])
        checked = self.plan.checked
        found = checked.get(key)
        if found is not None:
            checked.move_to_end(key)  # the newest again: values that keep coming back stay
        else:
            counters["ca_dynsaved"]["verify_traces"] += 1
            found = checked[key] = sentinel.check(self.plan, self.inputs, dict(zip(self.keys, values)))
            if len(checked) > CHECKED_LIMIT:  # values new every step: keep the newest
                checked.popitem(last=False)
            if found[0]:
                # The report keeps it (CaptureRecord.refused); never the user's WARNING log.
                log.info("ca_dynsaved: %s with saved %s runs opaque this step: %s", self.name, self.named(values), found[0])
        self.derived = found[1]
        return found[0]

    def place(self, ints: list[Any], floats: list[Any]) -> None:
        """Put the last checked tuple's derived values where the graph reads them (a
        refused tuple has none: the graph that runs then does not read them)."""
        if self.derived:
            for index, at in self.int_slots:
                ints[at] = self.derived[index]
            for index, at in self.float_slots:
                floats[at] = self.derived[index]

    def named(self, values: Sequence[Any]) -> dict[str, Any]:
        return dict(zip(self.keys, values))


@dataclass(frozen=True)
class GuardedNode:
    """A traced Python node whose backward reads bools / strs / Nones (``guarded``):
    its ctx is ``hooks[hook]``; ``saved``, ``tensor_inputs`` and ``grads`` (the
    capture's, as its sizes are ``saved``'s) are what its probe needs
    (``probe.verdict``)."""

    name: str
    hook: int
    guarded: tuple[str, ...]
    saved: tuple[Any, ...]
    tensor_inputs: tuple[bool, ...]
    grads: tuple[Any, ...]


#: Combinations of a capture's guarded ctx values (``Combinations``) that may compile:
#: each is a compile (Dynamo guards them, as under stock CA); past these, a new one
#: runs the capture's opaque graph, compiled once, its compile the cap's last (so
#: never more compiles than stock, which runs eagerly past Dynamo's recompile limit
#: of 8), or, where a guarded node has no opaque op, the graph uncompiled, as stock.
MAX_GUARDED_COMBINATIONS = 8


class Combinations:
    """The combinations of the guarded ctx values of a capture's traced Python
    nodes. The probe walked the backward for the capture's combination only; a
    backward may branch on a str into math the probe has not seen (a number that
    needs its value, a float the backend cannot take). So each new combination is
    probed (``probe.verdict``, the real ctx's values) before Dynamo compiles it: one
    the probe traces runs compiled (Dynamo's guard on it, a compile, as stock); one
    it refuses, or one past ``MAX_GUARDED_COMBINATIONS``, is sent away (``away``)
    each time it comes: where ``shared`` (every guarded node also has its opaque op
    in the capture's opaque graph: ``tiered``'s ``GUARDED``) to that graph, compiled,
    else to the graph run uncompiled, eagerly."""

    def __init__(self, nodes: Sequence[GuardedNode], record: CaptureRecord, shared: bool = False) -> None:
        self.nodes = tuple(nodes)
        self.record = record
        self.shared = shared
        self._reads = [(node.hook, name) for node in self.nodes for name in node.guarded]
        self._away: dict[tuple[Any, ...], bool] = {}  # combination -> sent away
        self._compiled = 0
        self._cap = MAX_GUARDED_COMBINATIONS - 1 if shared else MAX_GUARDED_COMBINATIONS

    def away(self, hooks: Sequence[Any]) -> bool:
        """Whether this run's combination is sent away from the traced graph."""
        combination = tuple(getattr(hooks[i], name, None) for i, name in self._reads)
        found = self._away.get(combination)
        if found is None:
            found = self._away[combination] = self._refusal(hooks, combination)
        return found

    def _refusal(self, hooks: Sequence[Any], combination: tuple[Any, ...]) -> bool:
        from . import probe

        reason = ""
        if self._compiled >= self._cap:
            reason = f"the capture has compiled {self._cap} combinations of them"
        for node in self.nodes if not reason else ():
            verdict = probe.verdict(hooks[node.hook], node.saved, node.tensor_inputs, node.grads)
            if not verdict.traced:
                reason = f"{node.name}: {verdict.reason}"
                break
        if not reason:
            self._compiled += 1
            return False
        values = dict(zip((f"ctx.{name}" for _, name in self._reads), combination))
        if self.shared:
            self.record.opaque_combinations.append((values, reason))
        else:
            self.record.eager_combinations.append((values, reason))
        where = "the capture's opaque graph" if self.shared else "the graph uncompiled"
        log.info("capture !%d: %s run %s: %s", self.record.ca_id, values, where, reason)
        return True


def without_keep_alive(graph: torch.fx.Graph) -> None:
    """Erase ``graph``'s ``keep_alive`` nodes."""
    for node in list(graph.find_nodes(op="call_function", target=keep_alive)):
        graph.erase_node(node)


def after_inputs(graph: torch.fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, keeping the order
    otherwise (of the nodes ready, the earliest first)."""
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    if all(index[i] < index[node] for node in nodes for i in node.all_input_nodes):
        return
    waiting = {node: len(node.all_input_nodes) for node in nodes}
    ready = [index[node] for node in nodes if not waiting[node]]
    heapq.heapify(ready)
    placed: list[torch.fx.Node] = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        placed.append(node)
        for user in node.users:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, index[user])
    assert len(placed) == len(nodes), "ca_dynsaved: a cycle in a capture's graph"
    for before, node in zip(placed, placed[1:]):
        if before.next is not node:
            before.append(node)


def fallback_graph(base: torch.fx.GraphModule, fallbacks: Sequence[Fallback]) -> torch.fx.GraphModule:
    """A copy of ``base`` (the capture's graph with its ``keep_alive`` nodes, so every
    fallback's inputs are there) in which each fallback's node is called directly
    instead of its traced ops, for eager runs."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(base.graph, env))
    for fb in fallbacks:
        args = (
            [None if g is None else env[g] for g in fb.grads],
            [None if t is None else env[t] for t in fb.saved],
            *(env[p] for p in fb.packed),
        )
        with graph.inserting_before(env[fb.region[0]] if fb.region else None):
            call = graph.call_function(fb.run, args)
        # CA's validation takes the outputs as its first argument, by position (one
        # tensor may be two outputs, or an input as it is)
        assert fb.validate is not None, f"ca_dynsaved: no validation of {fb.name}'s outputs was captured"
        validate = env[fb.validate]
        outputs = list(validate.args[0])  # type: ignore[arg-type]
        assert len(outputs) == len(fb.outputs), f"ca_dynsaved: {fb.name}'s outputs and their validation differ"
        after = call
        for i, out in enumerate(fb.outputs):
            if out is not None:
                with graph.inserting_after(after):
                    after = outputs[i] = graph.call_function(operator.getitem, (call, i))
        validate.args = (outputs, *validate.args[1:])
        for node in reversed(fb.region):
            if not env[node].users:
                graph.erase_node(env[node])
    without_keep_alive(graph)
    after_inputs(graph)  # the call after its inputs (a grad the trace did not use may come later)
    return torch.fx.GraphModule(base, graph)


def running_final_callbacks(runtime_wrapper: Callable[..., Any], record: CaptureRecord) -> Callable[..., Any]:
    """CA's ``runtime_wrapper``, then every callback queued with
    ``Variable._execution_engine.queue_callback`` while it ran, in order, including
    callbacks queued by callbacks: what the engine's post-processing does at the end
    of an eager backward, and what stock CA skips for callbacks queued by code that
    runs outside Dynamo's graph (a ``torch.compiler.disable``d hook such as FSDP2's
    pre-backward, whose post-backward callback reduce-scatters the gradients and
    reshards the parameters). A callback queued by code Dynamo traces is still
    Dynamo's (run by the graph's ``exec_final_callbacks``). A backward that raises
    runs none, as in eager. ``record.final_callbacks`` counts those run."""

    @without_dynamo
    def wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        with collecting_final_callbacks() as queued:
            out = runtime_wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs)
            i = 0
            while i < len(queued):  # a callback may queue more
                queued[i]()
                i += 1
        record.final_callbacks += i
        return out

    return wrapper


def make_runtime_wrapper(
    runtime_wrapper: Callable[..., Any],
    graph_module: torch.fx.GraphModule,
    packer: Packer | None,
    nodes: list[binding.NodeCapture],
    record: CaptureRecord,
    compiler_fn: Callable[..., Any],
    dynamic_sources: Sequence[str] = (),
    checks: Sequence[Check] = (),
    derived: tuple[int, int] = (0, 0),
    refused: Callable[..., Any] | None = None,
    hold: "Hold | None" = None,
    unpacks: checkpoint.Unpacks | None = None,
    fallback_base: torch.fx.GraphModule | None = None,
    combinations: Combinations | None = None,
) -> Callable[..., Any]:
    """Wrap CA's runtime wrapper for a captured graph with opaque ops for ``nodes``;
    ``packer`` when C++ opaque ops or traced nodes read the lifted scalars;
    ``dynamic_sources``: the scalars Dynamo must treat as dynamic (traced Python
    ctx numbers), re-marked when the graph's code is regenerated; ``checks``: the
    verify checks of sentinel-traced nodes; ``derived``: how many ints and doubles
    those nodes compute from their numbers (``sentinel.Derived``), which the
    checks give per step; ``refused``: what runs a step a check refuses (called
    with the run's arguments after ``compiled_fn``), else a copy of
    ``fallback_base`` with the refused nodes called directly (``fallback_graph``);
    ``hold``: while on, the graph runs eagerly, uncompiled (``tiered``);
    ``unpacks``: the graph's checkpoint unpacks, whose ``like`` tensors each run
    appends to the scalars (a run that cannot describe them takes the stock twin),
    learned on the first run, which is eager; ``combinations``: a run whose guarded
    ctx values it sends away takes ``refused`` where it is ``shared`` (this graph a
    tiered capture's traced one), else this graph eagerly. A lifted value whose
    type is not its capture's raises before anything runs (``SavedTypeChangedError``)."""
    compiled: list[Callable[..., Any]] = []  # set once every node in the graph has run
    # a tiered capture's traced graph lacks its tiered nodes' opaque ops
    learning = [nodes[slot] for slot in opaque.slots_in(graph_module.graph)]
    # Only a Python opaque node and a checkpoint unpack run under the caller's
    # dispatch keys: read them then.
    python = any(node.fn is None for node in nodes) or unpacks is not None
    fallbacks: dict[tuple[int, ...], torch.fx.GraphModule] = {}  # by refused checks

    @without_dynamo
    def wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        start = time.perf_counter() if binding.TIMING else 0.0
        if packer is not None:
            packer.check_types(scalars)
        reasons = {i: reason for i, check in enumerate(checks) if (reason := check.refusal(scalars))} if checks else {}
        if reasons:
            counters["ca_dynsaved"]["verify_fallbacks"] += 1
            for i, reason in reasons.items():
                record.refuse(checks[i].name, checks[i].named([scalars[j] for j in checks[i].indices]), reason)
            if refused is not None:
                return refused(inputs, sizes, scalars, hooks, packed_inputs)
        eager = combinations is not None and combinations.away(hooks)
        if eager and combinations.shared:  # type: ignore[union-attr]
            # this graph is a tiered capture's traced one: its opaque graph takes it
            assert refused is not None
            counters["ca_dynsaved"]["guarded_opaque_runs"] += 1
            return refused(inputs, sizes, scalars, hooks, packed_inputs)
        record.observe(scalars, hooks)
        if eager:
            counters["ca_dynsaved"]["guarded_eager_runs"] += 1
        ints: Sequence[int] = ()
        floats: Sequence[float] = ()
        if packer is not None:
            derived_ints, derived_floats = [0] * derived[0], [0.0] * derived[1]
            for check in checks:
                check.place(derived_ints, derived_floats)
            ints, floats, scalars = packer(scalars, derived_ints, derived_floats)
        if unpacks is not None:
            likes = unpacks.likes(hooks, packed_inputs)
            if isinstance(likes, str):
                if not reasons:
                    return _stock_twin(unpacks, likes, ints, floats, inputs, sizes, scalars, hooks, packed_inputs)
                likes = [None] * len(unpacks.slots)  # the eager fallback below takes any hook
            scalars = [*scalars, *likes]
        if reasons:
            which = tuple(reasons)
            gm = fallbacks.get(which)
            if gm is None:
                assert fallback_base is not None
                gm = fallbacks[which] = fallback_graph(fallback_base, [checks[i].fallback for i in which])
            runner = _Differentiable(gm).run_to_list if torch.is_grad_enabled() else gm
            with binding.bound_run(hooks, nodes, ints, floats, python, packed_inputs, unpacks):
                return runtime_wrapper(runner, inputs, sizes, scalars, hooks, packed_inputs)
        if not nodes and unpacks is None:  # nothing opaque: the graph as captured (traced C++ nodes may
            # read the packed floats); with sentinel-traced nodes its first run is
            # eager, as a graph with opaque nodes runs it, so a capture used once (a
            # batch whose captures change) compiles nothing
            if eager:
                fn = graph_module
            elif compiled or not checks:
                fn = compiled_fn
            else:
                compiled.append(compiled_fn)
                counters["ca_dynsaved"]["first_eager_runs"] += 1
                fn = graph_module
            return runtime_wrapper(fn, inputs, sizes, scalars, hooks, packed_inputs)
        learned = unpacks is None or unpacks.learned
        if not compiled and learned and all(node.defined is not None for node in learning) and not (hold and hold.on):
            reuse.name_learned_outputs(graph_module, nodes)
            fuse.chains(graph_module)  # new code: mark it again
            mark_dynamic_scalars(graph_module.forward.__code__, dynamic_sources)
            fn, record.compiled = reuse.compiled_for(graph_module, compiled_fn, compiler_fn)
            compiled.append(fn)
            log.info("capture !%d: first run done; %s code", record.ca_id, record.compiled)
        if torch.is_grad_enabled() and learning:  # its opaque ops called directly
            counters["ca_dynsaved"]["create_graph_eager_runs"] += 1
            fn = _Differentiable(graph_module).run_to_list
        elif compiled and not eager:
            fn = compiled[0]
        elif eager:
            fn = graph_module
        else:
            counters["ca_dynsaved"]["held_eager_runs" if hold and hold.on else "first_eager_runs"] += 1
            fn = graph_module
        if binding.TIMING:
            binding.TIMING[-1]["wrapper"] += time.perf_counter() - start
        with binding.bound_run(hooks, nodes, ints, floats, python, packed_inputs, unpacks):
            out = runtime_wrapper(fn, inputs, sizes, scalars, hooks, packed_inputs)
        if not learned:
            unpacks.done_first_run()  # type: ignore[union-attr]
        return out

    def _stock_twin(unpacks: checkpoint.Unpacks, why: str, ints, floats, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        """A run whose unpack hooks the graph cannot take (a hook not checkpoint's, a
        checkpoint without metadata): the capture as stock CA made it, compiled as
        stock compiles it, its opaque ops bound as usual."""
        if unpacks.fallback is None:
            log.info("capture !%d: checkpoint unpacks run as stock: %s", record.ca_id, why)
            record.unpack_fallback = why
            unpacks.fallback = compiler_fn(unpacks.stock_twin)
        counters["ca_dynsaved"]["unpack_stock_runs"] += 1
        fn = _Differentiable(unpacks.stock_twin).run_to_list if torch.is_grad_enabled() else unpacks.fallback
        with binding.bound_run(hooks, nodes, ints, floats, python):
            return runtime_wrapper(fn, inputs, sizes, scalars, hooks, packed_inputs)

    return wrapper


@dataclass
class Hold:
    """Keeps a graph uncompiled while ``on`` (its runs eager)."""

    on: bool = True


#: How a tiered capture chooses between its graphs (``tiered``), by its nodes: a C++
#: node's later combination (held: ``first`` uncompiled until the switch), a Python
#: backward stock would recompile for or break at (measured), a traced Python node
#: with guarded values (guarded: ``graph`` from the first run).
HELD, MEASURED, GUARDED = "held", "measured", "guarded"


def tier_way(ways: Sequence[str]) -> str:
    """A capture's way from its tiered nodes': held if one is, guarded if all are,
    else measured (a guarded node's combinations past the cap then take ``first``
    from the switch on, as in the other ways)."""
    if HELD in ways:
        return HELD
    return GUARDED if ways and all(way == GUARDED for way in ways) else MEASURED


def tiered(
    first: Callable[..., Any],
    hold: Hold,
    specialised: Callable[[Callable[..., Any]], Callable[..., Any]],
    graph: torch.fx.GraphModule,
    compiler_fn: Callable[..., Any],
    functions: Sequence[tuple[str, tuple[str, ...]]],
    record: CaptureRecord,
    way: str = HELD,
) -> Callable[..., Any]:
    """The runtime wrapper of a capture with tiered nodes (``decision.Tiered``):
    ``first`` (its graph with them opaque), run eagerly while ``hold`` is on, until
    the capture's run ``SPECIALISE_AFTER_RUNS``; then, if ``COMBINATIONS`` lets
    ``functions`` have one more, ``graph`` (them traced) compiled by ``compiler_fn``
    and run by the wrapper ``specialised`` makes, which hands a step whose values
    verify refuses back to ``first``; if not, ``first`` compiled (code shared with
    the functions' other combinations at their cap). So a C++ function's later
    combination that repeats costs stock's one compile, one that does not come back
    16 times none; eager runs cost little against a compile (docs/cpp.md, "Hashed
    values"). ``GUARDED``: ``graph`` compiled from the first run, ``first`` (compiled
    when it first runs) for the combinations ``Combinations`` sends away.
    ``MEASURED`` (Python nodes tiered for a graph break or a number they
    specialise on: ``first`` compiled from the start, ``hold`` off; ``graph`` as
    stock made it, guarded by Dynamo as stock): ``graph`` gives way to ``first`` for
    good where it compiles in more than ``decision.RECOMPILING_RUNS`` runs after its
    first (it churns, as under stock), or where its median of ``decision.TIMED_RUNS``
    runs is slower than ``first``'s median over as many runs before the switch; and
    it is tried only once the run's sizes have stayed the same for that many runs
    (sizes that keep changing recompile stock's graph-broken pieces at every new
    one). A backward with ``create_graph=True`` always takes ``first``, whose eager
    run records the backward's history."""
    runs = 0
    chosen: list[Callable[..., Any]] = []
    asked = False  # COMBINATIONS once: a function at its cap stays opaque here
    # measured: runs of ``graph``'s code that compiled (its first not counted); the
    # timed runs of ``first`` (its latest with steady sizes) and of ``graph``; the
    # runs in a row whose sizes were the run before's
    recompiling = -1
    first_times: collections.deque[float] = collections.deque(maxlen=decision.TIMED_RUNS)
    own_times: list[float] = []
    same_sizes, last_sizes = 0, None

    def give_way(why: str) -> None:
        chosen.clear()
        hold.on = False
        record.despecialised = runs
        log.info("capture !%d: run %d: back to its opaque graph: %s", record.ca_id, runs, why)

    def run_measured(inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        """``graph``'s run, watched for recompiles; timed until ``TIMED_RUNS`` of
        its runs compiled nothing (a GPU run synchronises only then)."""
        nonlocal recompiling
        before = graphs_compiled()
        if len(own_times) < decision.TIMED_RUNS:
            out, seconds = _timed(chosen[0], inputs, sizes, scalars, hooks, packed_inputs)
        else:
            out, seconds = chosen[0](inputs, sizes, scalars, hooks, packed_inputs), None
        if graphs_compiled() != before:
            recompiling += 1
            if recompiling > decision.RECOMPILING_RUNS:  # churning, as under stock
                give_way(f"its own graph compiled in {recompiling} runs after its first")
        elif seconds is not None:
            own_times.append(seconds)
            if len(own_times) == decision.TIMED_RUNS:
                own, opaque_ = statistics.median(own_times), statistics.median(first_times)
                record.tier_times_us = (opaque_ * 1e6, own * 1e6)
                if own > opaque_:
                    give_way(f"its own graph's runs take {own * 1e6:.0f} us, the opaque graph's {opaque_ * 1e6:.0f}")
        return out

    measured = way == MEASURED
    run_chosen = run_measured if measured else (lambda *args: chosen[0](*args))

    def choose(compiled_fn: Callable[..., Any]) -> None:
        own = compiler_fn(graph)
        run = specialised(lambda *args: first(compiled_fn, *args))
        chosen.append(lambda *args: run(own, *args))

    @without_dynamo
    def wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        nonlocal runs, asked, same_sizes, last_sizes
        grad = torch.is_grad_enabled()
        runs += 1
        if chosen and (not grad or way == GUARDED):  # GUARDED: its graph is stock's, with create_graph too
            return run_chosen(inputs, sizes, scalars, hooks, packed_inputs)
        if way == GUARDED and not asked:
            asked = True
            choose(compiled_fn)
            return run_chosen(inputs, sizes, scalars, hooks, packed_inputs)
        steady = True
        if measured and not asked:
            same_sizes = same_sizes + 1 if sizes == last_sizes else 0
            last_sizes = list(sizes)
            steady = same_sizes >= min(decision.TIMED_RUNS, decision.SPECIALISE_AFTER_RUNS - 1)
        if way != GUARDED and not asked and not grad and runs >= decision.SPECIALISE_AFTER_RUNS and steady:
            asked = True
            if not decision.COMBINATIONS.promote(functions):
                hold.on = False  # at the cap: opaque for good, compiled
                return first(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs)
            choose(compiled_fn)
            record.specialised = runs
            counters["ca_dynsaved"]["specialised_captures"] += 1
            log.info("capture !%d: run %d: its own graph, tiered nodes traced (%s)",
                     record.ca_id, runs, ", ".join(name for name, _ in functions))
            return run_chosen(inputs, sizes, scalars, hooks, packed_inputs)
        # measured: the opaque graph's runs that may precede the switch (sizes as the
        # run before's, the first run (eager) not) are timed
        window = runs > decision.SPECIALISE_AFTER_RUNS - 1 - decision.TIMED_RUNS
        if measured and not asked and not grad and same_sizes and window:
            out, seconds = _timed(first, compiled_fn, inputs, sizes, scalars, hooks, packed_inputs)
            first_times.append(seconds)
            return out
        return first(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs)

    return wrapper


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and its wall time in seconds, the GPU's queued work included
    (a tiered capture's choice between its two graphs: ``tiered``)."""
    sync = torch.cuda.is_initialized()
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    if sync:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


_RUNNERS = {**opaque.RUNNERS, checkpoint.UNPACK_OP: checkpoint.unpack_now}


class _Differentiable(torch.fx.Interpreter):
    """Runs a CA graph calling the backwards directly, so autograd records them."""

    def run_to_list(self, *args: Any) -> list[Any]:
        # C++ wants a plain list; the interpreter returns FX's immutable_list.
        return list(self.run(*args))

    def call_function(self, target, args, kwargs):  # type: ignore[no-untyped-def,override]
        runner = _RUNNERS.get(target)
        if runner is not None:
            return runner(*args, **kwargs)
        return super().call_function(target, args, kwargs)
