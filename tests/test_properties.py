"""Property-based equivalence with eager: random sequences of saved values.

Each test runs one hypothesis search (fixed seed: ``derandomize=True``; a bounded
number of examples) inside one test, so the plugin's CA graph, once compiled by the
first example, serves every later example: the search checks the compiled graph
against eager on values it has never seen, and the compile counts are exact over
the whole search.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ca_dynsaved
from ca_dynsaved import UndefinedGradError, probe, tiers
from ca_dynsaved.ways import python_traced
from helpers import Counts, assert_grads_equal, counts, stock_counts, this_release

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
SUBNORMAL = 5e-324

SEARCH = settings(
    max_examples=25,
    derandomize=True,  # a fixed seed: CI sees the same examples every run
    deadline=None,  # the first example compiles
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

int64s = st.one_of(
    st.sampled_from([0, 1, -1, I64_MAX, I64_MIN, I64_MAX - 1, I64_MIN + 1]),
    st.integers(I64_MIN, I64_MAX),
)
floats = st.one_of(
    st.sampled_from([0.0, -0.0, SUBNORMAL, -SUBNORMAL, math.inf, -math.inf, math.nan, 1e308]),
    st.floats(allow_nan=True, allow_infinity=True),
)
texts = st.one_of(st.sampled_from(["square", "", "sq"]), st.text(max_size=6))


def _steps(values: st.SearchStrategy) -> st.SearchStrategy:
    # At least 2 steps: the first run of a capture is eager, the second compiles.
    return st.lists(values, min_size=2, max_size=5)


def _check_steps(step, values_list, backend: str = "aot_eager", **options) -> None:
    """Each step under the plugin, then eager: the same gradients, NaN where eager
    has NaN. With aot_eager every op of both runs is the same ATen call on the same
    doubles, so the gradients must be identical bit for bit (a saved double that
    lost precision would show); inductor may reorder float math."""
    for values in values_list:
        with ca_dynsaved.enable(backend=backend, **options):
            got = step(*values)
        want = step(*values)
        if backend == "aot_eager":
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        else:
            assert_grads_equal(got, want, equal_nan=True)


def _leaf_grad(apply):
    """float64 tensors: a double saved value keeps all its bits in the gradient."""

    def step(*values):
        x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64, requires_grad=True)
        apply(x * 2, *values).sum().backward()
        return (x.grad,)

    return step


@pytest.mark.parametrize("variant", ["traceable", "opaque"])
def test_cpp_lifted_ints_and_floats(ext, variant):
    fn = getattr(ext, f"scale_{variant}")
    step = _leaf_grad(fn)

    @SEARCH
    @given(_steps(st.tuples(int64s, int64s, floats, floats)))
    def search(values_list):
        _check_steps(step, values_list)
        assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)

    search()


def test_cpp_symbolic_reader_traced(ext):
    """A C++ function reading toSymInt() / toSymFloat() is traced into the CA graph
    (its double read from the packed float64 tensor, its int a dynamic graph input):
    still bit-identical to eager over the extremes, one compile."""
    step = _leaf_grad(lambda x, a, s: ext.sym_scale_traceable(x, a, s, False))

    @SEARCH
    @given(_steps(st.tuples(int64s, floats)))
    def search(values_list):
        _check_steps(step, values_list)
        assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)

    search()
    assert {n.handling for n in ca_dynsaved.report().nodes} == {"traced-dynamic"}


@pytest.mark.parametrize("mode", [0, 3, 1, 2], ids=["direct", "capped", "2*alpha", "k%2"])
def test_cpp_opted_in_plain_reader_traced(ext, mode):
    """toInt()/toDouble() readers opted in with trace_cpp: the int reaches the op as
    a double through the packed int64 tensor, the doubles through the packed float64
    one, bit-identical to eager over the extremes. ``capped`` (std::min on both)
    passes the sentinel check; verify runs every value the caps change directly.
    ``2*alpha`` and ``k%2``: values computed from the numbers, lifted from verify's
    run (int64 extremes, inf, NaN, -0.0 and subnormals included)."""
    step = _leaf_grad(lambda x, k, alpha, beta: ext.direct_fn(x, k, alpha, beta, mode))

    @SEARCH
    @given(_steps(st.tuples(int64s, floats, floats)))
    def search(values_list):
        _check_steps(step, values_list, trace_cpp=["DirectFn"])
        assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)

    search()
    assert {n.handling for n in ca_dynsaved.report().nodes} == {"traced-dynamic"}


def test_cpp_bools_strings_and_hashed_doubles(ext):
    """Every new combination is a new CA capture (CA hashes these values); all of
    them run the code compiled once."""
    step = _leaf_grad(ext.config_opaque)
    dims = st.lists(st.integers(-3, 3), max_size=3)

    @SEARCH
    @given(_steps(st.tuples(st.booleans(), texts, dims, floats, floats)))
    def search(values_list):
        _check_steps(step, values_list)
        assert counts().compiles <= 1 and counts().graph_breaks == 0

    search()
    assert counts().compiles == 1
    assert torch._dynamo.utils.counters["ca_dynsaved"]["reuse_misses"] == 1


class PyScaleFn(torch.autograd.Function):
    """ctx holds an int (any Python int), a float, a bool and a str."""

    @staticmethod
    def forward(ctx, x, k, s, flag, mode):
        ctx.k, ctx.s, ctx.flag, ctx.mode = k, s, flag, mode
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        scale = (ctx.k % 1000 - 500) * ctx.s if ctx.flag else ctx.s
        grad = g * 2 * x * scale if ctx.mode == "square" else g * scale
        return grad + len(ctx.mode), None, None, None, None


class PyModeFn(torch.autograd.Function):
    """PyScaleFn without its numbers: ctx holds a bool and a str only."""

    @staticmethod
    def forward(ctx, x, flag, mode):
        ctx.flag, ctx.mode = flag, mode
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        grad = g * 2 * x if ctx.mode == "square" else -g if ctx.flag else g
        return grad + len(ctx.mode), None, None


def _python_compiles(seen: list[tuple[int, float, bool, str]]) -> int:
    """PyScaleFn's compiles over the steps ``seen``, as the plugin decides them. With
    ctx.flag, the backward multiplies by ``ctx.k % 1000``, which the backend cannot
    compile dynamic (the probe refuses it: opaque from the capture where the first
    step has the flag, else each such combination runs the capture's opaque graph:
    python_traced.Combinations, one compile from that graph's second run); without it,
    traced: Dynamo compiles each str once, and once more where ctx.s is a NaN (it
    specialises NaN)."""
    if seen[0][2]:
        return 1  # opaque: one compile, from the capture's second run
    away = sum(flag for _, _, flag, _ in seen)
    return len({(mode, s != s) for _, s, flag, mode in seen if not flag}) + (away >= 2)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_python_ctx_values(backend):
    """ctx.flag and ctx.mode from small sets (each str a compile, as stock: a str new
    at every step is test_guarded_combinations_are_capped's), the numbers anything."""
    step = _leaf_grad(PyScaleFn.apply)
    ints = st.one_of(int64s, st.integers(-(2**100), 2**100))  # beyond int64 too
    seen: list[tuple[int, float, bool, str]] = []

    @SEARCH
    @given(_steps(st.tuples(ints, floats, st.booleans(), st.sampled_from(["square", "", "sq"]))))
    def search(values_list):
        _check_steps(step, values_list, backend)
        seen.extend(values_list)
        assert counts() == Counts(captures=1, compiles=_python_compiles(seen), graph_breaks=0)

    search()


@pytest.mark.parametrize("numbers", [True, False], ids=["numbers", "hashed_only"])
def test_guarded_combinations_are_capped(numbers):
    """A str new at every step: MAX_GUARDED_COMBINATIONS - 1 of them compile (Dynamo's
    guard, as stock); later ones run the capture's opaque graph, its one compile the
    cap's last: stock's 8 compiles (Dynamo's recompile limit, then eager), and the
    steps past it compiled (one eager run first, which learns the opaque op's
    outputs); the report says so. The same with ctx numbers beside the str (lifted)
    and without (nothing lifted: stock's trace up to the cap)."""
    step = _leaf_grad(PyScaleFn.apply if numbers else PyModeFn.apply)
    limit = python_traced.MAX_GUARDED_COMBINATIONS
    values = [((3, 0.5 + i) if numbers else ()) + (False, f"mode{i}") for i in range(limit + 4)]
    assert stock_counts(lambda i: step(*values[i]), len(values)).compiles == limit
    _check_steps(step, values)
    assert counts() == Counts(captures=1, compiles=limit, graph_breaks=0)
    ours = torch._dynamo.utils.counters["ca_dynsaved"]
    assert (ours["guarded_opaque_runs"], ours["guarded_eager_runs"], ours["first_eager_runs"]) == (5, 0, 1)
    (capture,) = ca_dynsaved.report().captures
    assert capture.eager_combinations == []
    assert [values for values, _ in capture.opaque_combinations] == [
        {"ctx.flag": False, "ctx.mode": f"mode{i}"} for i in range(limit - 1, limit + 4)
    ]
    assert {reason for _, reason in capture.opaque_combinations} == {
        f"the capture has compiled {limit - 1} combinations of them"
    }
    assert "run its opaque graph: the capture has compiled 7" in str(ca_dynsaved.report())


@pytest.mark.every_release
@pytest.mark.parametrize("numbers", [True, False], ids=["numbers", "hashed_only"])
def test_a_new_combination_at_new_sizes_compiles_as_stock(numbers):
    """The str alternates while the leaf's size changes: each new combination is
    probed with the capture's saved tensors and the capture's incoming gradients
    (this run's sizes are not theirs), so the probe traces it and it compiles as
    under stock: stock's counts, none sent to the opaque graph, eager's gradients."""
    apply = PyScaleFn.apply if numbers else PyModeFn.apply

    def step(i):
        x = torch.linspace(-1.0, 1.0, (5, 7, 9)[i % 3], dtype=torch.float64, requires_grad=True)
        values = ((3, 0.5 + i) if numbers else ()) + (False, ("plain", "square")[i % 2])
        apply(x * 2, *values).sum().backward()
        return (x.grad,)

    stock = stock_counts(step, 6)
    _check_steps(step, [(i,) for i in range(6)])
    assert counts() == stock == Counts(captures=1, compiles=3, graph_breaks=0)
    assert torch._dynamo.utils.counters["ca_dynsaved"]["guarded_opaque_runs"] == 0
    assert ca_dynsaved.report().captures[0].opaque_combinations == []


def test_guarded_combination_the_probe_refuses_runs_opaque():
    """ctx.flag off at the capture: traced. Its first step with the flag on takes the
    branch with ``ctx.k % 1000``, which the backend cannot compile with k dynamic
    (stock CA fails there: BackendCompilerFailed); the probe refuses that
    combination before Dynamo sees it, and it runs the capture's opaque graph (eager
    at its first run, compiled from its second). Eager's gradients."""
    step = _leaf_grad(PyScaleFn.apply)
    _check_steps(step, [(3, 0.5, False, "square"), (4, 0.6, True, "square"), (5, 0.7, True, "square"), (6, 0.8, False, "square")])
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=0)
    assert torch._dynamo.utils.counters["ca_dynsaved"]["guarded_opaque_runs"] == 2
    (capture,) = ca_dynsaved.report().captures
    ((values, reason),) = capture.opaque_combinations
    assert values == {"ctx.flag": True, "ctx.mode": "square"}
    words = this_release({"2.11": "through Python arithmetic", "2.12": "through Python arithmetic", "2.13": probe.CANNOT_REBUILD,
                          "2.14": probe.CANNOT_REBUILD, "2.15": probe.CANNOT_REBUILD})
    assert reason.startswith("PyScaleFn: ctx.") and "reaches aten.mul.Tensor" in reason and words in reason


@pytest.mark.parametrize("kind", ["cpp", "python"])
def test_value_dependent_none_is_eager_or_refused(ext, kind, monkeypatch):
    """OddNoneFn returns no gradient for an odd k. The capture's first run learns
    whether the gradient is None; a later step of the other parity raises
    UndefinedGradError (never a zero where eager gives None), and the next step of
    the learned parity is right again. (The Python node opaque throughout: its
    capture's switch to stock's graph, which gives eager's None, is
    test_python_tiered's.)"""
    from test_python_ctx import OddNoneFn

    monkeypatch.setattr(tiers, "SPECIALISE_AFTER_RUNS", 10**9)

    if kind == "cpp":  # C++'s k % 2 == 1: positive odd k only
        apply, undefined = ext.odd_none_opaque, lambda k: k > 0 and k % 2 == 1
    else:
        apply, undefined = OddNoneFn.apply, lambda k: k % 2 == 1
    step = _leaf_grad(apply)
    learned: list[bool] = []  # whether the capture's first run left the grad undefined

    @SEARCH
    @given(_steps(st.one_of(int64s, st.integers(-5, 5))))
    def search(ks):
        for k in ks:
            learned[:1] = learned[:1] or [undefined(k)]
            if undefined(k) != learned[0]:
                with pytest.raises(UndefinedGradError, match="OddNoneFn"):
                    with ca_dynsaved.enable(backend="aot_eager"):
                        step(k)
            else:
                _check_steps(step, [(k,)])
        assert counts().captures == 1 and counts().compiles <= 1

    search()
