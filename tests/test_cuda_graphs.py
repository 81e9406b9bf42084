"""CUDA graphs, checked on the CPU: inductor never records the opaque ops into one,
and ``enable(mode=..., options=..., dynamic=...)`` reach ``torch.compile``.

An opaque op's Python reads the saved values of this run. A CUDA graph replays the
kernels it recorded without running Python, so a recorded op would replay its first
step's values. These tests ask inductor's own predicates (the ones its CUDA-graph
decision and its graph partitioner use) about real CA graphs of the plugin; the
end-to-end run on a GPU is ``test_gpu_cuda_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import scheduler as inductor_scheduler
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.cudagraph_utils import check_multiple_devices_or_any_cpu_nodes
from torch._inductor.utils import (
    get_first_incompatible_cudagraph_node,
    is_cudagraph_unsafe_fx_node,
    is_cudagraph_unsafe_op,
)

import ca_dynsaved
from ca_dynsaved import fuse, opaque
from ca_dynsaved._compat.capture import no_ca
from helpers import (
    ENTRY_POINTS,
    Counts,
    assert_grads_equal,
    counts,
    entry_point,
    frame_breaks,
    leaf_grad_step,
    run_loop,
    scale_args,
    stock_enable,
)
from test_python_ctx import pool

#: The CPU side of the GPU module (test_gpu_cuda_graphs.py), on every release: the
#: lent GPU machine's torch (2.11) runs the GPU side.
pytestmark = pytest.mark.every_release


def _cpp_apply(ext):
    # not is_traceable: opaque (a traceable toInt() reader is traced with sentinels)
    return lambda x, i: ext.scale_opaque(x.sin(), *scale_args(i)).cos()


def _python_apply(ext):
    # A float-schema op in its backward: opaque under python_policy="auto".
    return lambda x, i: pool(x.sin(), 0.25 + i / 2, i + 1).cos()


#: kind -> (the custom function applied between elementwise ops, its opaque op)
FUNCTIONS = {"cpp": (_cpp_apply, opaque.CPP_OP), "python": (_python_apply, opaque.PY_OP)}


def _step(ext, kind):
    return leaf_grad_step(FUNCTIONS[kind][0](ext))


def test_the_ops_are_tagged_cudagraph_unsafe():
    for op in (opaque.CPP_OP, opaque.PY_OP, fuse.CHAIN_OP):
        assert torch.Tag.cudagraph_unsafe in op.tags


class _LoweredGraphs(CustomGraphPass):
    """A post-grad pass (an inductor option): what inductor's CUDA-graph checks say
    about each graph it lowers. No uuid: inductor's cache is bypassed, so the pass
    sees every compile."""

    def __init__(self) -> None:
        self.first_incompatible: list[object] = []  # per graph: target or None
        self.unsafe: list[list[object]] = []  # per graph: targets of unsafe nodes

    def __call__(self, graph: torch.fx.Graph) -> None:
        first = get_first_incompatible_cudagraph_node(graph.owning_module)
        self.first_incompatible.append(None if first is None else first.target)
        self.unsafe.append(
            [n.target for n in graph.nodes if n.op == "call_function" and is_cudagraph_unsafe_fx_node(n)]
        )

    def uuid(self) -> None:
        return None


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_inductor_flags_exactly_the_opaque_op(ext, kind, entry):
    """Without graph partitioning, inductor's first CUDA-graph-incompatible node of
    the CA graph is the opaque op (CUDA graphs skipped for the graph); with it, the
    op is the only node it splits off. Every entry point hands torch.compile's
    ``options`` to the CA graph's compile (the pass sees the graph). The same
    backward under stock CA has no such node."""
    apply, op = FUNCTIONS[kind]
    seen = _LoweredGraphs()
    options = {"post_grad_custom_post_pass": seen, "custom_should_partition_ops": []}
    with entry_point(entry, "inductor", compile_kwargs={"options": options}) as backward:
        for i in range(4):
            x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
            backward(apply(ext)(x * 2, i).sum())
            with no_ca():
                want = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
                apply(ext)(want * 2, i).sum().backward()
            assert_grads_equal([x.grad], [want.grad])
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=frame_breaks(entry))
    # One CA graph; any other graph inductor lowered (the config path's frame) has
    # no unsafe node.
    assert [target for target in seen.first_incompatible if target is not None] == [op]
    assert [targets for targets in seen.unsafe if targets] == [[op]]

    ca_dynsaved.reset()
    counters.clear()
    stock = _LoweredGraphs()
    with stock_enable("inductor", options={"post_grad_custom_post_pass": stock}):
        _step(ext, kind)(0)
    # (stock breaks its graph around the non-traceable C++ function: a graph a side)
    assert set(stock.first_incompatible) == {None}
    assert all(targets == [] for targets in stock.unsafe)


@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_partitioner_splits_at_the_opaque_op_only(ext, kind, monkeypatch):
    """``Scheduler.should_partition`` puts a node outside CUDA graphs when
    ``is_cudagraph_unsafe_op`` says so (after its device checks, which on a CPU say
    "cpu ops" for every node, so the predicate is asked directly): true for the
    op's fallback kernel and the outputs it unpacks, false for every fused kernel."""
    op = FUNCTIONS[kind][1]
    seen: list[list[tuple[str, object, bool]]] = []
    init = inductor_scheduler.Scheduler.__init__

    def spy(self, nodes):  # type: ignore[no-untyped-def]
        seen.append(
            [(type(n).__name__, getattr(n, "op_overload", None), is_cudagraph_unsafe_op(n)) for n in nodes]
        )
        init(self, nodes)

    monkeypatch.setattr(inductor_scheduler.Scheduler, "__init__", spy)
    with torch._inductor.config.patch(fx_graph_cache=False, graph_partition=True):
        run_loop(_step(ext, kind), lambda: ca_dynsaved.enable(), steps=3)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (nodes,) = seen
    unsafe = [(kind_, target) for kind_, target, flagged in nodes if flagged]
    assert unsafe[0] == ("FallbackKernel", op)
    assert {kind_ for kind_, _ in unsafe[1:]} == {"MultiOutput"}
    assert sum(1 for kind_, _, flagged in nodes if kind_ == "ComputedBuffer" and not flagged) >= 2
    assert all(not flagged for kind_, _, flagged in nodes if kind_ == "ComputedBuffer")


def test_cpu_scalars_do_not_disable_partitioned_cuda_graphs():
    """The packed scalars a traced C++ node reads are CPU tensors (0-dim selects, no
    device sync). Inductor ignores CPU nodes when it partitions for CUDA graphs, and
    only then: what keeps them from costing the rest of the graph its CUDA graphs."""
    graph = torch.fx.Graph()
    nodes = {torch.device("cuda", 0): graph.placeholder("grad"), torch.device("cpu"): graph.placeholder("ints")}
    with torch._inductor.config.patch({"triton.cudagraphs": True, "graph_partition": True}):
        assert check_multiple_devices_or_any_cpu_nodes(dict(nodes)) is None
    with torch._inductor.config.patch({"triton.cudagraphs": True, "graph_partition": False}):
        assert "cpu device (ints)" in check_multiple_devices_or_any_cpu_nodes(dict(nodes))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_mode_reaches_torch_compile(ext, entry):
    """``mode="reduce-overhead"`` turns inductor's CUDA graphs on; on a CPU it then
    records why it skipped them (one skip per compiled graph), and without it nothing."""
    apply = _cpp_apply(ext)
    for mode, skips in ((None, 0), ("reduce-overhead", 1)):
        ca_dynsaved.reset()
        counters.clear()
        with entry_point(entry, "inductor", compile_kwargs={"mode": mode}) as backward:
            for i in range(3):
                x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
                backward(apply(x * 2, i).sum())
        assert counts() == Counts(captures=1, compiles=1, graph_breaks=frame_breaks(entry))
        assert counters["inductor"]["cudagraph_skips"] == skips


@pytest.mark.parametrize("dynamic", [None, True, False])
def test_dynamic_means_what_it_means_to_torch_compile(ext, dynamic):
    """Sizes changing every step (6 sizes). True: sizes symbolic from the first
    compile; None: automatic dynamic (one recompile); False: the capture's sizes and
    torch.compile's static, so a new size recompiles (CA itself recaptures once with
    symbolic sizes; each capture's first run is eager)."""

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 4 + i, requires_grad=True)
        ext.scale_opaque(x * 2, *scale_args(i)).sum().backward()  # opaque: a first eager run per capture
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager", dynamic=dynamic), steps=6)
    want = {True: (1, 1), None: (1, 2), False: (2, 4)}[dynamic]
    assert counts() == Counts(*want, graph_breaks=0)


def test_torch_compile_arguments_are_checked_at_enable():
    with pytest.raises(RuntimeError, match="Unrecognized mode=reduce_overhead"):
        ca_dynsaved.enable(mode="reduce_overhead")
    with pytest.raises(RuntimeError, match="Unexpected optimization option no_such_option"):
        ca_dynsaved.enable(options={"no_such_option": 1})
    with pytest.raises(RuntimeError, match="Either mode or options"):
        ca_dynsaved.enable(mode="reduce-overhead", options={"max_autotune": True})
    with pytest.raises(TypeError, match="mode, options are torch.compile's"):
        ca_dynsaved.enable(lambda gm: gm, mode="reduce-overhead", options={})


def test_equal_arguments_share_compiled_code(ext):
    """The default compiler compares by its torch.compile arguments (reuse.py): a new
    enable() with the same mode reuses the code of a CA graph recaptured for a new
    hashed value; another mode compiles its own."""

    def step(flip: bool, how: str):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        ext.config_opaque(x * 2, flip, how, [1, 2], 0.5, 1.5).sum().backward()
        return (x.grad,)

    # Each capture runs twice: its first run is eager, the second asks reuse.py.
    for flip, how, mode in (
        (False, "square", None), (True, "square", None), (True, "scale", "max-autotune-no-cudagraphs")
    ):
        for _ in range(2):
            with ca_dynsaved.enable(backend="aot_eager", mode=mode):
                step(flip, how)
    assert counters["compiled_autograd"]["captures"] == 3
    assert counters["ca_dynsaved"]["reuse_hits"] == 1
    assert counters["ca_dynsaved"]["reuse_misses"] == 2
    assert counters["stats"]["unique_graphs"] == 2
