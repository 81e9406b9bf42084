"""The per-node decision as data (``decision.py``): each kind of node gets the record
the capture carried out, as the report keeps it (``report().nodes[i].decision``):
its handling, its reason, and the plan its mechanism ran. Gradients equal eager in
every case (``run_loop``)."""

from __future__ import annotations

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import decision, opaque
from ca_dynsaved._compat.symbolic import new_symbol, symbolic_probe_mode
from helpers import leaf_grad_step, run_loop
from test_python_auto import UnreadFlagFn
from test_python_ctx import BranchFn


class UnreadBoolFn(torch.autograd.Function):
    """A bool on ctx its backward never reads."""

    @staticmethod
    def forward(ctx, x, flag):
        ctx.flag = flag
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


def _decisions(step, steps: int = 2, **options) -> list[decision.Decision]:
    """Run ``step`` under the plugin (aot_eager); the decisions of the first capture."""
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager", **options), steps=steps)
    return [node.decision for node in ca_dynsaved.report().captures[0].nodes]


def _saved(d: decision.Decision) -> dict[str, tuple[str, object]]:
    return {key: (type_, value) for key, type_, value, _ in d.saved}


def test_cpp_symbolic_reader_is_a_cpp_trace(ext):
    (d,) = _decisions(leaf_grad_step(lambda x, i: ext.sym_scale_traceable(x, 3 + i, 0.5 + i, False)))
    assert (d.kind, d.handling, d.verified) == ("C++", decision.TRACED, False)
    assert d.reason == "reads its saved numbers symbolically (toSymInt/toSymFloat): a, s"
    assert _saved(d) == {"a": ("int", 3), "s": ("float", 0.5)}
    assert isinstance(d.plan, decision.CppTrace) and d.plan.floats
    assert sorted(d.plan.scalars) == sorted(index for *_, index in d.saved) == [0, 1]


@pytest.mark.every_release  # the only test of Decision.verified (docs/contributing.md)
@pytest.mark.parametrize(
    ("options", "handling", "plan", "verified", "optin"),
    [
        ({}, decision.TRACED, decision.SentinelTrace, True, False),
        ({"verify": False}, decision.TRACED, decision.SentinelTrace, True, False),  # not named: always verified
        ({"cpp_policy": "opaque"}, decision.OPAQUE, decision.OpaqueCall, False, False),
        ({"trace_cpp": ["DirectFn"]}, decision.TRACED, decision.SentinelTrace, True, True),
        ({"trace_cpp": ["DirectFn"], "verify": False}, decision.TRACED, decision.SentinelTrace, False, True),
    ],
)
def test_cpp_plain_reader_traced_and_verified_unless_told(ext, options, handling, plan, verified, optin):
    step = leaf_grad_step(lambda x, i: ext.direct_fn(x, 3 + i, 0.5 + i, 1.5, 0))
    (d,) = _decisions(step, **options)
    assert (d.handling, type(d.plan), d.verified) == (handling, plan, verified)
    assert _saved(d) == {"k": ("int", 3), "alpha": ("float", 0.5), "beta": ("float", 1.5)}
    if plan is decision.OpaqueCall:  # every saved value a lifted number: none from the capture
        assert d.reason == "cpp_policy='opaque'"
        assert d.plan == decision.OpaqueCall(captured=(), slots=(None, None, None))
    else:
        how = "opt-in (trace_cpp)" if optin else "traced with sentinels"
        assert d.reason.startswith(f"{how}: uses its saved numbers only as op arguments")
        assert d.reason.endswith("; each new value verified") == verified
        assert d.plan.plan.traced and (d.plan.verify, d.plan.optin) == (verified, optin)
        assert sorted(d.plan.scalars) == [0, 1, 2]


def test_cpp_hashed_values_reach_the_op_from_the_capture(ext):
    step = leaf_grad_step(lambda x, i: ext.config_opaque(x, True, "linear", [2, 1], 0.5, -1.0))
    (d,) = _decisions(step)
    assert (d.handling, d.reason) == (decision.OPAQUE, "not is_traceable: its backward is not traced")
    assert isinstance(d.plan, decision.OpaqueCall) and None not in d.plan.slots
    by_key = {key: d.plan.captured[slot] for (key, *_), slot in zip(d.saved, d.plan.slots)}
    assert by_key == {"flip": True, "mode": "linear", "dims": [2, 1], "weights": {"a": 0.5, "b": -1.0}}


def test_excluded_cpp_node_is_stock(ext):
    step = leaf_grad_step(lambda x, i: ext.scale_opaque(x, 1 + i, 2, 0.5, 1.5))
    (d,) = _decisions(step, exclude=["ScaleFn"])
    assert (d.handling, d.reason, d.plan) == (decision.STOCK, decision.EXCLUDED, None)


def test_unexpected_cpp_layout_is_stock(ext, monkeypatch):
    from ca_dynsaved._compat import layout

    monkeypatch.setattr(layout, "CPP_NODE_TRAILING_ARGS", layout.CPP_NODE_TRAILING_ARGS + 1)
    (d,) = _decisions(leaf_grad_step(lambda x, i: ext.scale_opaque(x, 1 + i, 2, 0.5, 1.5)))
    assert (d.handling, d.plan, d.saved) == (decision.STOCK, None, ())
    assert d.reason.startswith("unexpected CppNode argument layout")


@pytest.mark.parametrize(
    ("policy", "handling", "plan"),
    [
        ("auto", decision.TRACED, decision.PythonTrace(("L['hooks'][0].k",))),
        ("opaque", decision.OPAQUE, decision.OpaqueCall(inputs=(0,))),
        ("stock", decision.STOCK, None),
    ],
)
def test_python_node_by_policy(policy, handling, plan):
    (d,) = _decisions(leaf_grad_step(lambda x, i: UnreadFlagFn.apply(x, 2 + i, True)), python_policy=policy)
    assert (d.kind, d.name, d.handling, d.plan) == ("Python", "UnreadFlagFn", handling, plan)
    assert _saved(d) == {"k": ("int", 2), "flag": ("bool", True)}
    reasons = {"auto": "its ctx numbers only reach tensor math: ctx.k", "opaque": "", "stock": 'python_policy="stock"'}
    assert d.reason == reasons[policy]


def test_python_node_without_numbers_is_stock_s_trace_with_its_opaque_op():
    """A bool the backward reads, no number: stock's trace (nothing lifted, the bool
    guarded as stock guards it); its opaque op for combinations past the cap."""
    (d,) = _decisions(leaf_grad_step(lambda x, i: BranchFn.apply(x, i % 2 == 0)))
    # the capture records its traced way (the opaque op is its opaque graph's:
    # test_properties::test_guarded_combinations_are_capped[hashed_only])
    assert (d.handling, d.plan) == (decision.TRACED, decision.PythonTrace((), ("flag",)))
    assert d.reason == (
        "no int or float ctx attribute; ctx.flag guarded by Dynamo as stock guards it (a compile per distinct value)"
    )


def test_python_node_without_numbers_or_bools_it_reads_keeps_stock_tracing():
    (d,) = _decisions(leaf_grad_step(lambda x, i: UnreadBoolFn.apply(x, i % 2 == 0)))
    assert (d.handling, d.plan) == (decision.STOCK, None)
    assert d.reason.startswith("no int or float ctx attribute, and Dynamo traces its backward")


# The only test reaching node_spec's refusal and Decision.demoted: in the every-release
# subset (docs/contributing.md); the other records are the same on every release, and
# the subset reaches their lines through the tests of each mechanism.
@pytest.mark.every_release
def test_a_call_the_op_cannot_express_is_refused_and_the_node_demoted():
    """What ``validate_outputs`` does when a deferred opaque node's call holds a
    symbolic bool, or a symbolic float that is no lifted value: ``node_spec``
    refuses it, and the decision becomes stock with that reason."""
    shape_env, _ = symbolic_probe_mode()
    n = new_symbol(shape_env, "n", 5)
    f = new_symbol(shape_env, "f", 0.5)
    for leaf, why in ((n > 2, "a symbolic bool"), (f, "a symbolic SymFloat that is not a lifted saved value")):
        with pytest.raises(opaque.Unexpressible, match=why):
            opaque.node_spec("Fn", ([leaf],), [None], {})
    opaque_decision = decision.Decision("Fn", "C++", decision.OPAQUE, "toInt()", plan=decision.OpaqueCall())
    demoted = opaque_decision.demoted("a symbolic bool")
    assert (demoted.handling, demoted.reason, demoted.plan) == (decision.STOCK, "a symbolic bool", None)
