"""C++ functions reading with toInt() / toDouble(): traced and fused when two
sentinel traces agree (by default, each new value verified; opted in with
enable(trace_cpp=...), verify may be switched off), refused (opaque; with a warning
only when opted in) when they do not, and checked per new value by verify, which
runs a refused step with the node called directly. docs/cpp.md, "Why the default
is sound", names each refusal; each has its test here."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import ca_dynsaved
from helpers import Counts, counts, entry_point, frame_breaks, leaf_grad_step, run_loop, stock_enable, ENTRY_POINTS

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release

NAME = "DirectFn"
DIRECT, TRANSFORMED, PARITY, CAPPED, LEAKY, BRANCH, SIZED, SIZE_GATED, DATA, DERIVED_LEAKY = range(10)


def _k(i: int) -> int:
    return [3, 0, 1, -2, 7, 5, 4, 9, -1, 6, 8, 2][i]


def _alpha(i: int) -> float:
    return [0.5, 1.25, -0.75, 2.0, 0.0, 3.5, 1.5, 0.25, -1.0, 0.75, 1e-3, 2.5][i]


def _step(ext, mode: int, k=_k, alpha=_alpha):
    return leaf_grad_step(lambda x, i: ext.direct_fn(x, k(i), alpha(i), 0.1 * i, mode))


def _optin(backend: str = "aot_eager", **options):
    return lambda: ca_dynsaved.enable(backend=backend, fullgraph=True, trace_cpp=[NAME], **options)


def _counter(name: str) -> int:
    return torch._dynamo.utils.counters["ca_dynsaved"][name]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("verify", [True, False])
def test_direct_use_is_traced_once(ext, backend, verify):
    run_loop(_step(ext, DIRECT), _optin(backend, verify=verify))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = ca_dynsaved.report().nodes
    assert (node.handling, node.opaque) == ("traced-dynamic", False)
    assert node.reason == "opt-in (trace_cpp): uses its saved numbers only as op arguments: alpha, beta, k" + (
        "; each new value verified" if verify else ""
    )
    assert (_counter("optin_cpp_nodes"), _counter("opaque_nodes"), _counter("sentinel_plans")) == (1, 0, 1)
    # verify traces each new (k, alpha, beta) once: all 12 steps are new here.
    assert (_counter("verify_traces"), _counter("verify_fallbacks")) == ((12, 0) if verify else (0, 0))


def test_verify_traces_each_value_once(ext):
    run_loop(_step(ext, DIRECT, k=lambda i: i % 3, alpha=lambda i: 0.5), _optin(), steps=6)
    run_loop(leaf_grad_step(lambda x, i: ext.direct_fn(x, i % 3, 0.5, 0.0, DIRECT)), _optin(), steps=6)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    # 6 new tuples, then (0, 0.5, 0.0) again and two new ones: (1, 0.5, 0.0), (2, 0.5, 0.0)
    assert _counter("verify_traces") == 6 + 2


def test_stock_recompiles_the_direct_reader(ext):
    run_loop(_step(ext, DIRECT), stock_enable)
    assert counts() == Counts(captures=1, compiles=torch._dynamo.config.recompile_limit, graph_breaks=0)


def test_plain_reader_traced_by_default(ext):
    """No opt-in: the same node traced with sentinels, each new value verified, and
    nothing in the user's warnings."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_loop(_step(ext, DIRECT), lambda: ca_dynsaved.enable(backend="aot_eager", fullgraph=True))
    assert [w for w in seen if "ca_dynsaved" in str(w.message)] == []
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = ca_dynsaved.report().nodes
    assert (node.handling, node.reason) == (
        "traced-dynamic",
        "traced with sentinels: uses its saved numbers only as op arguments: "
        "alpha, beta, k; each new value verified",
    )
    assert (_counter("sentinel_cpp_nodes"), _counter("optin_cpp_nodes"), _counter("opaque_nodes")) == (1, 0, 0)
    assert (_counter("verify_traces"), _counter("verify_fallbacks")) == (12, 0)


def test_default_tracing_always_verifies(ext):
    """verify=False is the trace_cpp user's word about a function they named; a
    node traced without being named is verified anyway: the capped steps run direct."""
    run_loop(_step(ext, CAPPED, _capped_k, _capped_alpha), lambda: ca_dynsaved.enable(backend="aot_eager", verify=False))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    assert (_counter("verify_traces"), _counter("verify_fallbacks")) == (12, 2)


@pytest.mark.parametrize("policy", ["opaque", "stock"])
def test_cpp_policy_keeps_it_out_of_tracing(ext, policy):
    run_loop(_step(ext, DIRECT), lambda: ca_dynsaved.enable(backend="aot_eager", cpp_policy=policy))
    stock_compiles = torch._dynamo.config.recompile_limit  # one per new double, to the limit
    assert counts() == Counts(captures=1, compiles=1 if policy == "opaque" else stock_compiles, graph_breaks=0)
    (node,) = set(ca_dynsaved.report().nodes)
    assert (node.handling, node.reason) == (policy, f"cpp_policy='{policy}'")
    assert _counter("sentinel_plans") == 0


def test_trace_cpp_names_are_traced_under_any_policy(ext):
    run_loop(_step(ext, DIRECT), _optin(cpp_policy="opaque"))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    assert {n.handling for n in ca_dynsaved.report().nodes} == {"traced-dynamic"}
    assert _counter("optin_cpp_nodes") == 1


#: mode -> the reason the sentinel check refuses it
REFUSED = {
    LEAKY: (
        "saved 'alpha' (a double) reaches argument 1 of aten.leaky_relu.default, where the backend would "
        "specialise it (only the scalar of mul/add/sub/div/pow on a floating tensor can take it)"
    ),
    DERIVED_LEAKY: (
        "argument 1 of aten.leaky_relu.default is computed from a saved value (0.6385728973675814, then "
        "-3.4660547401377544), a double where the backend would specialise it (only the scalar of "
        "mul/add/sub/div/pow on a floating tensor can take it)"
    ),
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mode", [TRANSFORMED, PARITY], ids=["2*alpha", "k%2"])
def test_values_computed_from_the_numbers_are_lifted(ext, mode, backend):
    """g * x * (2 * alpha), g * x * alpha * (k % 2): the sentinel traces differ there
    by more than the sentinels; verify's run of each new tuple gives the computed
    value, which the graph takes as an input (a double through the packed float64
    tensor): traced, one compile, eager's gradients, k % 2 at negative k included."""
    run_loop(_step(ext, mode), lambda: ca_dynsaved.enable(backend=backend, fullgraph=True))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = ca_dynsaved.report().nodes
    assert node.handling == "traced-dynamic"
    assert node.reason.endswith(", and 1 value computed from them (lifted per new value); each new value verified")
    assert (_counter("verify_traces"), _counter("verify_fallbacks"), _counter("opaque_nodes")) == (12, 0, 0)


@pytest.mark.parametrize("mode", REFUSED, ids=["scalar-only op", "computed, into a scalar-only op"])
def test_sentinel_check_refuses(ext, mode):
    with pytest.warns(UserWarning, match=rf"trace_cpp refused .*DirectFn<{mode}>.*: it runs opaque|trace_cpp refused"):
        run_loop(_step(ext, mode), _optin("inductor"))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = set(ca_dynsaved.report().nodes)
    assert (node.handling, node.reason) == ("opaque", "trace_cpp refused: " + REFUSED[mode])
    assert (_counter("optin_cpp_nodes"), _counter("opaque_nodes")) == (0, 1)


#: What the default's refusals add to the probe's reason: the sentinel traces'
#: (a double and a value computed from one where no tensor can carry it), the
#: size-read and the data-read refusals (docs/cpp.md, "Why the default is sound").
DEFAULT_REFUSED = {
    **REFUSED,
    SIZED: "its backward reads a tensor's sizes (aten.size.default), which verify cannot check for other sizes",
    DATA: "its backward reads a tensor's data (aten.equal.default), which verify cannot check",
}


def test_default_refusals_are_reported_not_warned(ext, caplog):
    """Each refusal without an opt-in: opaque, one compile, eager's gradients, the
    reason in the report, nothing in the user's warnings or WARNING log."""
    caplog.set_level(logging.WARNING)
    for mode, reason in DEFAULT_REFUSED.items():
        ca_dynsaved.reset()
        ca_dynsaved.reset_report()
        torch._dynamo.utils.counters.clear()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            run_loop(_step(ext, mode), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=3)
        assert [w for w in seen if "ca_dynsaved" in str(w.message)] == [], mode
        assert counts() == Counts(captures=1, compiles=1, graph_breaks=0), mode
        (node,) = set(ca_dynsaved.report().nodes)
        assert node.handling == "opaque", mode
        # the symbolic probe's reason first (the data read stops it before any guard)
        probe = "the probe could not run its backward (" if mode == DATA else "saved 'k' is read as a plain number (guard "
        assert node.reason.startswith(probe), mode
        assert node.reason.endswith("; " + reason), (mode, node.reason)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_size_read_as_a_number_stays_opaque(ext):
    """k * x.size(0): both sentinel traces agree (same sizes), but traced the size
    would be a constant of a graph CA reuses for other sizes. The size probe (fake
    tensors with symbolic sizes) refuses it; opaque, every size is right."""
    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 4 + i % 3, requires_grad=True)
        ext.direct_fn(x * 2, _k(i), _alpha(i), 0.1 * i, SIZED).sum().backward()
        return (x.grad,)

    with pytest.warns(UserWarning, match="trace_cpp refused"):
        run_loop(step, _optin("aot_eager"))
    # The second compile is Dynamo's automatic dynamic for the size that changed.
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=0)
    (node,) = set(ca_dynsaved.report().nodes)
    assert node.handling == "opaque"
    # the sentinel traces see the C++ size(0) (a size-watching tensor)
    assert node.reason == "trace_cpp refused: " + DEFAULT_REFUSED[SIZED]


def test_refusal_warns_once_per_function(ext):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_loop(_step(ext, LEAKY), _optin())
        run_loop(_step(ext, LEAKY), _optin())
    assert [str(w.message) for w in seen if "trace_cpp" in str(w.message)] == [
        f"ca_dynsaved: trace_cpp refused torch::autograd::CppNode<DirectFn<4> >: {REFUSED[LEAKY]}; it runs opaque"
    ]


def _capped_k(i: int) -> int:
    return 2_000_000 if i == 5 else _k(i)


def _capped_alpha(i: int) -> float:
    return 20.0 if i == 6 else _alpha(i)


def test_verify_catches_what_both_sentinels_pass(ext):
    """std::min(k, 1000000) and std::min(alpha, 10.0): both sentinels are under the
    caps, so the plan traces the node; verify sees the cap bite at steps 5 and 6
    and runs those steps with the node called directly: gradients stay eager's."""
    run_loop(_step(ext, CAPPED, _capped_k, _capped_alpha), _optin("inductor"))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    assert (_counter("verify_traces"), _counter("verify_fallbacks")) == (12, 2)
    (capture,) = ca_dynsaved.report().captures
    assert [(name.endswith("DirectFn<3> >"), values["k"], values["alpha"], reason) for name, values, reason in capture.refused] == [
        (True, 2_000_000, 3.5, "argument 1 of aten.mul.Scalar is 1000000.0, not 2000000.0"),
        (True, 4, 20.0, "argument 1 of aten.mul.Scalar is 10.0, not 20.0"),
    ]
    text = str(ca_dynsaved.report())
    assert "verify ran it opaque for saved {'beta': 0.5, 'k': 2000000, 'alpha': 3.5}" in text


def test_verify_sees_a_size_read_the_template_lacks(ext):
    """k > 1000000 && x.size(0) > 3: both sentinels are under the bound, so the
    template reads no size. At k = 2000000 verify's small tensors (size 2) take the
    template's branch, but the run reads x's size where the template did not:
    refused, and that step runs with the node called directly - on the real size 8
    its gradient doubles, as eager's does."""
    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        ext.direct_fn(x * 2, 2_000_000 if i == 3 else 3 + i, 0.5, 0.25, SIZE_GATED).sum().backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=5)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    assert (_counter("verify_traces"), _counter("verify_fallbacks")) == (5, 1)
    ((_, values, reason),) = ca_dynsaved.report().captures[0].refused
    assert values["k"] == 2_000_000
    assert reason == "it runs 7 ops instead of 5 (op 0 is aten.dim.default, not aten.mul.Scalar)"


def test_without_verify_the_assertion_is_the_users(ext):
    """The same function with verify=False: the user's word is taken, and the capped
    step's gradient is wrong - what verify exists to catch."""
    step = _step(ext, CAPPED, _capped_k, _capped_alpha)
    for i in range(6):
        with _optin(verify=False)():
            (got,) = step(i)
        (want,) = step(i)
        if i < 5:
            torch.testing.assert_close(got, want)
    assert not torch.allclose(got, want)
    assert _counter("verify_fallbacks") == 0


def test_verify_catches_a_branch_both_sentinels_take(ext):
    """alpha > 0.5: both sentinels take the else branch; every step whose alpha
    takes the other one runs with the node called directly."""
    run_loop(_step(ext, BRANCH), _optin("inductor"))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    above = sum(_alpha(i) > 0.5 for i in range(12))
    assert (_counter("verify_traces"), _counter("verify_fallbacks")) == (12, above)
    assert {reason for _, _, reason in ca_dynsaved.report().captures[0].refused} == {"it runs 3 ops instead of 1 (op 0 is aten.mul.Tensor, not aten.mul.Scalar)"}


def test_fallback_under_create_graph(ext):
    """Step 1 takes the branch the plan did not see (g * x * alpha * k, whose
    gradient has a gradient); step 0 the one it saw (g * beta, which has none)."""
    for i in (0, 1):
        x = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64, requires_grad=True)
        with ca_dynsaved.enable(backend="aot_eager", trace_cpp=[NAME]):
            (g,) = torch.autograd.grad(ext.direct_fn(x * 2, 3, _alpha(i), 0.25, BRANCH).sum(), x, create_graph=True)
        x_e = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64, requires_grad=True)
        (g_e,) = torch.autograd.grad(ext.direct_fn(x_e * 2, 3, _alpha(i), 0.25, BRANCH).sum(), x_e, create_graph=True)
        torch.testing.assert_close(g, g_e)
        assert g.requires_grad == g_e.requires_grad == (i == 1)
        if i == 1:
            torch.testing.assert_close(torch.autograd.grad(g.sum(), x), torch.autograd.grad(g_e.sum(), x_e))
    assert _counter("verify_fallbacks") == 1


@pytest.mark.parametrize("kind", ENTRY_POINTS)
def test_entry_points_agree(ext, kind):
    config = {ca_dynsaved.CONFIG_TRACE_CPP: (NAME,)} if kind == "config" else {}
    options = {} if kind == "config" else {"trace_cpp": [NAME]}
    with torch._dynamo.config.patch(**config), entry_point(kind, **options) as backward:
        for i in range(12):
            x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
            backward(ext.direct_fn(x * 2, _k(i), _alpha(i), 0.1 * i, DIRECT).sum())
            (want,) = _step(ext, DIRECT)(i)
            torch.testing.assert_close(x.grad, want)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=frame_breaks(kind))
    assert {n.handling for n in ca_dynsaved.report().nodes} == {"traced-dynamic"}


def test_names_are_substrings_not_letters():
    with pytest.raises(TypeError, match="trace_cpp takes non-empty function-name substrings"):
        ca_dynsaved.enable(trace_cpp=[""])
    assert ca_dynsaved.enable(trace_cpp="DirectFn").trace_cpp == frozenset({"DirectFn"})


def test_cpp_policy_config_entry(ext):
    """The config path reads cpp_policy from its entry, as enable() reads it for None."""
    with torch._dynamo.config.patch(**{ca_dynsaved.CONFIG_CPP_POLICY: "opaque"}), entry_point("config") as backward:
        for i in range(3):
            x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
            backward(ext.direct_fn(x * 2, _k(i), _alpha(i), 0.1 * i, DIRECT).sum())
            (want,) = _step(ext, DIRECT)(i)
            torch.testing.assert_close(x.grad, want)
    assert {n.handling for n in ca_dynsaved.report().nodes} == {"opaque"}
    with pytest.raises(ValueError, match="cpp_policy must be one of"):
        ca_dynsaved.enable(cpp_policy="fused")
