"""C++ functions reading with toInt() / toDouble(), opted in with enable(trace_cpp=...):
traced and fused when two sentinel traces agree, refused (opaque, with a warning)
when they do not, and checked per new value by verify, which runs a refused step
with the node called directly."""

from __future__ import annotations

import warnings

import pytest
import torch

import ca_dynsaved
from helpers import Counts, counts, entry_point, frame_breaks, leaf_grad_step, run_loop, stock_enable, ENTRY_POINTS

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release

NAME = "DirectFn"
DIRECT, TRANSFORMED, PARITY, CAPPED, LEAKY, BRANCH, SIZED = range(7)


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


def test_not_opted_in_stays_opaque(ext):
    run_loop(_step(ext, DIRECT), lambda: ca_dynsaved.enable(backend="aot_eager", fullgraph=True))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = ca_dynsaved.report().nodes
    assert node.handling == "opaque"
    assert node.reason.startswith("saved 'k' is read as a plain number (guard ")
    assert _counter("sentinel_plans") == 0


#: mode -> the reason the sentinel check refuses it
REFUSED = {
    TRANSFORMED: "argument 1 of aten.mul.Scalar is computed from a saved value (0.6385728973675814, then -3.4660547401377544)",
    PARITY: "argument 1 of aten.mul.Scalar is computed from a saved value (1.0, then 0.0)",
    LEAKY: (
        "saved 'alpha' (a double) reaches argument 1 of aten.leaky_relu.default, where the backend would "
        "specialise it (only the scalar of mul/add/sub/div/pow on a floating tensor can take it)"
    ),
}


@pytest.mark.parametrize("mode", REFUSED, ids=["transformed", "k%2", "scalar-only op"])
def test_sentinel_check_refuses(ext, mode):
    with pytest.warns(UserWarning, match=rf"trace_cpp refused .*DirectFn<{mode}>.*: it runs opaque|trace_cpp refused"):
        run_loop(_step(ext, mode), _optin("inductor"))
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = set(ca_dynsaved.report().nodes)
    assert (node.handling, node.reason) == ("opaque", "trace_cpp refused: " + REFUSED[mode])
    assert (_counter("optin_cpp_nodes"), _counter("opaque_nodes")) == (0, 1)


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
    assert node.reason.startswith("trace_cpp refused: its ops depend on tensor sizes (")
    assert "Eq(size4, 4)" in node.reason  # C++ size(0) specialised the symbol


def test_refusal_warns_once_per_function(ext):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_loop(_step(ext, PARITY), _optin())
        run_loop(_step(ext, PARITY), _optin())
    assert [str(w.message) for w in seen if "trace_cpp" in str(w.message)] == [
        f"ca_dynsaved: trace_cpp refused torch::autograd::CppNode<DirectFn<2> >: {REFUSED[PARITY]}; it runs opaque"
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
    assert {reason for _, _, reason in ca_dynsaved.report().captures[0].refused} == {"it runs 3 ops instead of 1"}


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
