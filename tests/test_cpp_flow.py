"""Where a saved number decides the data flow of a C++ backward: which tensor an op
takes, the order of its arguments, which result is returned for which input, a value
turned into a tensor outside dispatch, a tag check the symbolic probe cannot see, a
saved type that changes, and the functions stock CA cannot collect at all. Each row
of docs/cpp.md's "Holes, and the test that covers each" is a test here: eager's
gradients at every step (traced where the flow matches, the node run directly or
opaque where it does not, a clear error where nothing can run it), exact counts, and
the reason the report gives. The rows are programs of ``cpp_programs`` (the
generated test, ``test_generated_programs.py``, draws many more)."""

from __future__ import annotations

import pytest
import torch

import ca_dynsaved
import cpp_programs as cp
from helpers import Counts, assert_grads_equal, counts, stock_enable

X, Y, G0, G1 = 0, 1, 2, 3  # the registers a program starts with
PICK_SIGN, PICK_BIG, PICK_PARITY, ORDER_SIGN, MUL, FROM_BLOB, CLAMP_BIG, SAVED_PARITY = 0, 1, 2, 4, 10, 18, 23, 30
SWAP_SIGN, SWAP_BIG = 1, 2

#: k and alpha of each step: both signs, both parities, zero, above BIG.
VALUES = [(3, 0.5), (-2, 1.25), (4, -0.75), (0, 2.0), (7, 0.25), (2_000_000, 1.5), (-5, 0.0), (1, 3.0)]


def _counter(name: str) -> int:
    return torch._dynamo.utils.counters["ca_dynsaved"][name]


def _train(ext, prog: list[int], values=VALUES, **options) -> None:
    """Each step under the plugin (aot_eager), compared with eager."""
    for k, alpha in values:
        with ca_dynsaved.enable(backend="aot_eager", **options):
            got = cp.run(ext, prog, k, alpha)
        assert_grads_equal(got, cp.run(ext, prog, k, alpha))


#: The issue's rows, each as a program, and the reason its node runs opaque:
#: the two sentinel traces differ in flow, or a tensor has no recorded producer.
ROWS = {
    # gx = g * (k > 0 ? y : x); gy = g * x
    "tensor picked by sign": (
        cp.program(0, [(PICK_SIGN, Y, X), (MUL, G0, 4), (MUL, G0, X)], 5, 6, 0),
        "which tensor it passes as argument 1 of aten.mul.Tensor (op 0) depends on saved values "
        "(saved tensor 1 with one sentinel set, saved tensor 0 with the other)",
    ),
    # gx = g * (k % 2 == 0 ? y : x); gy = g * saved[k & 1]
    "tensor picked by parity": (
        cp.program(0, [(PICK_PARITY, Y, X), (MUL, G0, 4), (SAVED_PARITY, G0, G0)], 5, 6, 0),
        "which tensor it passes as argument 1 of aten.mul.Tensor (op 0) depends on saved values "
        "(saved tensor 0 with one sentinel set, saved tensor 1 with the other)",
    ),
    # k > 0 ? g - x : x - g
    "argument order": (
        cp.program(0, [(ORDER_SIGN, G0, X), (MUL, G0, Y)], 4, 5, 0),
        "which tensor it passes as argument 0 of aten.sub.Tensor (op 0) depends on saved values "
        "(incoming gradient 0 with one sentinel set, saved tensor 0 with the other)",
    ),
    # p = g * x, q = g * y; k > 0 ? {p, q} : {q, p}
    "output mapping": (
        cp.program(0, [(MUL, G0, X), (MUL, G0, Y)], 5, 4, SWAP_SIGN),
        "which tensor it returns as gradient 0 depends on saved values (output 0 of op 0 "
        "(aten.mul.Tensor) with one sentinel set, output 0 of op 1 (aten.mul.Tensor) with the other)",
    ),
    # gx = g * from_blob(&alpha).clone()
    "a value turned into a tensor outside dispatch": (
        cp.program(0, [(FROM_BLOB, G0, G0), (MUL, G0, X)], 4, 5, 0),
        "argument 0 of aten.clone.default (op 0) is a tensor no recorded op made (from_blob, a pointer, "
        "a global): the recording cannot see its data",
    ),
}


@pytest.mark.parametrize("row", [pytest.param(r, marks=pytest.mark.every_release) if r == "tensor picked by sign" else r
                                 for r in ROWS])
@pytest.mark.parametrize("trace_cpp", [False, True], ids=["default", "trace_cpp"])
def test_value_driven_flow_runs_opaque(ext, row, trace_cpp):
    """The sentinel plan compares where every tensor comes from: a flow that depends
    on the saved values is refused, the node runs opaque (one compile), and every
    step has eager's gradients. Opted in, the refusal also warns."""
    prog, reason = ROWS[row]
    options = {"trace_cpp": ["ProgramFn"]} if trace_cpp else {}
    if trace_cpp:
        with pytest.warns(UserWarning, match="trace_cpp refused"):
            _train(ext, prog, **options)
    else:
        _train(ext, prog)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = set(ca_dynsaved.report().nodes)
    assert node.handling == "opaque"
    assert node.reason.endswith(("trace_cpp refused: " if trace_cpp else "; ") + reason), node.reason


#: Flows both sentinels take alike, which a new value changes: k > BIG.
BEYOND_SENTINELS = {
    # gx = g * (k > BIG ? y : x): the template takes x
    "tensor picked": (
        cp.program(0, [(PICK_BIG, Y, X), (MUL, G0, 4), (MUL, G0, X)], 5, 6, 0),
        "argument 1 of aten.mul.Tensor (op 0) is saved tensor 1, not saved tensor 0",
    ),
    # the template returns (g * x, g * y); k > BIG swaps them
    "output mapping": (
        cp.program(0, [(MUL, G0, X), (MUL, G0, Y)], 4, 5, SWAP_BIG),
        "it returns output 0 of op 1 (aten.mul.Tensor) as gradient 0, not output 0 of op 0 (aten.mul.Tensor)",
    ),
    # the template uses g0 only; k > BIG takes g1, which the compiled graph lacks
    "an incoming grad the template does not use": (
        cp.program(0, [(PICK_BIG, G1, G0), (MUL, 4, X), (MUL, G0, Y)], 5, 6, 0),
        "argument 0 of aten.mul.Tensor (op 0) is incoming gradient 1, not incoming gradient 0",
    ),
    # clamp(-100, 100) for k > BIG: equal numbers on any small input, another op
    "an op the numbers cannot show": (
        cp.program(0, [(CLAMP_BIG, G0, G0), (MUL, 4, X), (MUL, G0, Y)], 5, 6, 0),
        "it runs 3 ops instead of 2 (op 0 is aten.clamp.default, not aten.mul.Tensor)",
    ),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.every_release) if c == "tensor picked" else c
                                  for c in BEYOND_SENTINELS])
def test_verify_compares_the_flow(ext, case):
    """Both sentinels take the template's flow; the step whose k is above both
    (2,000,000) takes another, which verify's recording shows: that step runs with
    the node called directly (its inputs kept for it), the others traced."""
    prog, reason = BEYOND_SENTINELS[case]
    _train(ext, prog)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = set(ca_dynsaved.report().nodes)
    assert node.handling == "traced-dynamic"
    assert (_counter("verify_traces"), _counter("verify_fallbacks")) == (len(VALUES), 1)
    ((name, values, refused),) = ca_dynsaved.report().captures[0].refused
    assert (name.endswith("<ProgramFn>"), values["k"], refused) == (True, 2_000_000, reason)


@pytest.mark.every_release  # the differential check (README, "Supported torch releases")
def test_a_tag_check_is_caught_by_the_differential_check(ext):
    """``v.isInt() ? v.toInt() : 1000``: under the symbolic probe neither number is
    read, so the probe calls it a symbolic reader, and its trace holds 1000 and 0.5.
    The capture's differential check (the traced graph against the node's backward,
    random inputs, the capture's values) sees the difference at the first step: the
    node runs opaque, every step eager's."""
    for i, (k, alpha) in enumerate(VALUES):
        def step():
            x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
            ext.tag_check_fn(x * 2, k, alpha).sum().backward()
            return (x.grad,)

        with ca_dynsaved.enable(backend="aot_eager"):
            got = step()
        assert_grads_equal(got, step())
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = set(ca_dynsaved.report().nodes)
    assert node.handling == "opaque"
    assert node.reason.startswith("reads its saved numbers symbolically (toSymInt/toSymFloat): alpha, k; but its "
                                  "traced graph and its own backward differ at the capture's values: gradient 0 differs")
    assert (_counter("differential_checks"), _counter("differential_refusals")) == (1, 1)


@pytest.mark.every_release
def test_a_saved_type_change_is_a_clear_error(ext):
    """The same key saved as an int, then as a double: CA's cache key does not hold
    the type, so the second step reaches the graph captured for an int. It raises
    before anything runs, naming the node, the key, both types and the fix."""
    def step(v: float, as_int: bool):
        x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
        ext.type_switch_fn(x * 2, v, as_int).sum().backward()
        return (x.grad,)

    for v in (2.0, 3.0):  # one type: traced, eager's gradients
        with ca_dynsaved.enable(backend="aot_eager"):
            got = step(v, True)
        assert_grads_equal(got, step(v, True))
    with pytest.raises(ca_dynsaved.SavedTypeChangedError) as raised, ca_dynsaved.enable(backend="aot_eager"):
        step(2.5, False)
    assert str(raised.value) == (
        "ca_dynsaved: torch::autograd::CppNode<TypeSwitchFn>'s saved 'v' was an int at capture and is a double "
        "now (2.5): compiled autograd keeps one graph for both types, so its graph cannot take it. Save it as "
        "one type in the forward (static_cast<double>(...) every time)."
    )
    assert (raised.value.owner, raised.value.kind, raised.value.value) == (
        "torch::autograd::CppNode<TypeSwitchFn>'s saved 'v'", "int", 2.5
    )
    assert counts().captures == 1


@pytest.mark.every_release  # _compat.capture reads CA's assertion
@pytest.mark.parametrize("dirty", [False, True], ids=["mark_non_differentiable", "mark_dirty"])
def test_what_stock_cannot_collect_runs_as_plain_autograd(ext, dirty):
    """A scatter_max-like function (values, and the argmax marked non-differentiable;
    or its input written in place and marked dirty): stock CA asserts while it
    collects the graph, before any node runs. Under the plugin that backward runs as
    plain autograd, eager's gradients; the report names the function and the reason
    once, and later backwards of the graph go straight to plain autograd (no second
    collection: the failure counter stays 1)."""
    fn = ext.row_max_dirty if dirty else ext.row_max

    def step(i: int):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i), requires_grad=True)
        a, b = fn(x * 1.0, 0.5 + i)
        (a.sum() + (b.sum() if dirty else 0)).backward()
        return (x.grad,)

    with pytest.raises(RuntimeError, match="INTERNAL ASSERT FAILED"), stock_enable():
        step(0)
    for i in range(6):
        with ca_dynsaved.enable(backend="aot_eager"):
            got = step(i)
        assert_grads_equal(got, step(i))
    assert counts() == Counts(captures=0, compiles=0, graph_breaks=0)
    assert (_counter("uncollectable_backwards"), _counter("uncaptured_backwards")) == (1, 5)
    (record,) = ca_dynsaved.report().uncaptured
    name = f"torch::autograd::CppNode<RowMaxFn<{str(dirty).lower()}> >"
    assert record.nodes == (name,)
    why = "mark_dirty" if dirty else "mark_non_differentiable"
    assert record.reason == (
        f"compiled autograd cannot collect its graph: a C++ custom function calls {why}; "
        "5 backwards run as plain autograd, 0 tries under compiled autograd failed again"
    )
