"""python_policy="auto" (the default): which Python functions are traced with their
ctx numbers dynamic from the first compile, which run opaque, and why.

Each class of backward is run 12 steps with values changing every step, compared
with eager at every step, and its compile count asserted: one, whichever way the
probe decided (traced: Dynamo never guards the numbers; opaque: the op reads them).
"""

from __future__ import annotations

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import probe
from helpers import Counts, assert_grads_equal, counts, leaf_grad_step, run_loop, stock_counts, this_release
from test_python_ctx import ScaleFn, pool

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release


class _WithK(torch.autograd.Function):
    """forward: x * k, keeping ``k`` (an int) and ``s`` (a float) on the ctx."""

    @staticmethod
    def forward(ctx, x, k, s):
        ctx.k, ctx.s = k, s
        return x * k


class ParityFn(_WithK):
    """``k % 2`` stays symbolic under Dynamo (a Mod of a SymInt): no guard."""

    @staticmethod
    def backward(ctx, g):
        return g * (ctx.k % 2) + g * ctx.s, None, None


class GainBranchFn(_WithK):
    """A branch on a ctx int: Dynamo would guard ``k > 2``."""

    @staticmethod
    def backward(ctx, g):
        return (g * 2 if ctx.k > 2 else g * ctx.s), None, None


class SizeFn(_WithK):
    """A ctx int used as a size that Dynamo keeps symbolic (a tensor of that many
    ones): no guard, traced."""

    @staticmethod
    def backward(ctx, g):
        return g + torch.ones(abs(ctx.k) + 1).sum() * ctx.s, None, None


class SliceFn(_WithK):
    """A ctx int used as a slice bound: Dynamo would guard ``0 <= k <= len``."""

    @staticmethod
    def backward(ctx, g):
        return torch.cat([g[: ctx.k] * 2, g[ctx.k :]]), None, None


class IntCastFn(_WithK):
    """``int()`` of a ctx int needs its value."""

    @staticmethod
    def backward(ctx, g):
        return g * int(ctx.k), None, None


class LeakyFn(_WithK):
    """A ctx float reaching an op the tensorify pass cannot take: the backend would
    specialise it."""

    @staticmethod
    def backward(ctx, g):
        return torch.nn.functional.leaky_relu(g, ctx.s), None, None


class FlagFn(torch.autograd.Function):
    """Reads a bool beside its numbers: Dynamo would guard the bool's value."""

    @staticmethod
    def forward(ctx, x, k, flag):
        ctx.k, ctx.flag = k, flag
        return x * k

    @staticmethod
    def backward(ctx, g):
        return (-g if ctx.flag else g) * ctx.k, None, None


class SmoothLossFn(torch.autograd.Function):
    """A custom loss's backward: a float (beta) and a str (the reduction), as
    ``ctx.eps`` and ``ctx.reduction = "mean"`` in user code."""

    @staticmethod
    def forward(ctx, x, beta, reduction):
        ctx.beta, ctx.reduction = beta, reduction
        ctx.save_for_backward(x)
        return (torch.nn.functional.softplus(x * beta) / beta).sum()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        grad = g * torch.sigmoid(x * ctx.beta)
        if ctx.reduction == "mean":
            grad = grad / x.numel()
        return grad, None, None


class UnreadFlagFn(FlagFn):
    """Keeps a bool it never reads: nothing to guard."""

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None, None


_lib = torch.library.Library("ca_dynsaved_auto_tests", "DEF")
_lib.define("times(Tensor g, int n) -> Tensor")  # a plain int schema, not SymInt
_lib.impl("times", lambda g, n: g * n, "CompositeExplicitAutograd")
torch.library.register_fake("ca_dynsaved_auto_tests::times", lambda g, n: torch.empty_like(g), lib=_lib)


class IntSchemaFn(_WithK):
    @staticmethod
    def backward(ctx, g):
        return torch.ops.ca_dynsaved_auto_tests.times(g, ctx.k) * ctx.s, None, None


class ProductFn(_WithK):
    """Python arithmetic between the ctx numbers before the tensor math: torch 2.13+
    tensorify ``ctx.k * ctx.s`` (an ``operator.mul`` node); 2.11 / 2.12 take only
    ATen ops there and specialise ``ctx.s``, so the probe runs it opaque."""

    @staticmethod
    def backward(ctx, g):
        return g * (ctx.k * ctx.s), None, None


class ModFn(_WithK):
    """``ctx.k % 1000`` in the float math: the tensorify pass has no tensor form for
    Python's modulo (``PythonMod``), so with the numbers dynamic the backend's compile
    fails (stock CA: from its second step, once automatic dynamic makes them
    dynamic); the probe sees it and runs the function opaque."""

    @staticmethod
    def backward(ctx, g):
        return g * ((ctx.k % 1000 - 500) * ctx.s), None, None


#: (handling, the reason's words) of ProductFn on this torch.
_PRODUCT = this_release({
    "2.11": ("opaque", "through Python arithmetic"),
    "2.12": ("opaque", "through Python arithmetic"),
    "2.13": ("traced-dynamic", "only reach tensor math"),
    "2.14": ("traced-dynamic", "only reach tensor math"),
    "2.15": ("traced-dynamic", "only reach tensor math"),
})


def _k(i: int) -> int:
    return (-1) ** i * (i + 1)  # 1, -2, 3, -4, ...: both parities, both signs


#: name -> (apply, handling, the reason's words)
CASES = {
    "tensor_math": (lambda x, i: ScaleFn.apply(x, _k(i), 0.5 - i / 4), "traced-dynamic", "only reach tensor math"),
    "parity": (lambda x, i: ParityFn.apply(x, _k(i), i / 3), "traced-dynamic", "only reach tensor math"),
    "float_through_python_arithmetic": (lambda x, i: ProductFn.apply(x, _k(i), 0.5 - i / 4), *_PRODUCT),
    "unread_bool": (lambda x, i: UnreadFlagFn.apply(x, _k(i), i % 2 == 0), "traced-dynamic", "only reach tensor math"),
    "float_schema_op": (lambda x, i: pool(x, 0.25 + i / 2, i + 1), "opaque", "ctx.scale needs its value (guard Eq(ctx.scale, 0.37))"),
    "int_schema_op": (lambda x, i: IntSchemaFn.apply(x, _k(i), 0.5), "opaque", "ctx.k needs its value (guard Eq(ctx.k, 7))"),
    "branch": (lambda x, i: GainBranchFn.apply(x, _k(i), 0.5), "opaque", "ctx.k needs its value (guard ctx.k > 2)"),
    "size": (lambda x, i: SizeFn.apply(x, _k(i), 0.5), "traced-dynamic", "only reach tensor math"),
    "slice_bound": (lambda x, i: SliceFn.apply(x, i % 8, 0.5), "opaque", "ctx.k needs its value (guard (ctx.k >= 0) & (ctx.k <= 8))"),
    "int_cast": (lambda x, i: IntCastFn.apply(x, _k(i), 0.5), "opaque", "ctx.k needs its value (guard Eq(ctx.k, 7))"),
    "float_to_leaky_relu": (lambda x, i: LeakyFn.apply(x, 2, 0.1 * i), "opaque", "ctx.s (a float) reaches aten.leaky_relu.default"),
    "python_mod": (
        lambda x, i: ModFn.apply(x, _k(i), 0.5 - i / 4), "opaque",
        this_release({"2.11": "through Python arithmetic", "2.12": "through Python arithmetic",
                      "2.13": probe.CANNOT_REBUILD,
                      "2.14": probe.CANNOT_REBUILD,
                      "2.15": probe.CANNOT_REBUILD}),
    ),
    "reads_bool": (
        lambda x, i: FlagFn.apply(x, _k(i), i % 2 == 0), "traced-dynamic",
        "only reach tensor math: ctx.k; ctx.flag guarded by Dynamo as stock guards it (a compile per distinct value)",
    ),
}
#: a case's compiles where not 1: a bool Dynamo guards, two values (stock: 3, as
#: test_stock_recompiles_where_auto_does_not shows)
COMPILES = {"reads_bool": 2}
#: a case's probes where not 1: each combination of the bools / strs it reads
#: (ways.python_traced.Combinations probes a new one before it compiles)
PROBES = {"reads_bool": 2}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", CASES)
def test_classification_and_one_compile(case, backend):
    apply, handling, words = CASES[case]
    run_loop(leaf_grad_step(apply), lambda: ca_dynsaved.enable(backend=backend, fullgraph=True))
    assert counts() == Counts(captures=1, compiles=COMPILES.get(case, 1), graph_breaks=0)
    (node,) = ca_dynsaved.report().nodes
    assert node.handling == handling
    assert words in node.reason
    assert torch._dynamo.utils.counters["ca_dynsaved"]["probes"] == PROBES.get(case, 1)


def test_stock_recompiles_where_auto_does_not():
    """The baseline: stock CA recompiles the traced classes once (automatic dynamic)
    and the branch on every value (until the recompile limit)."""
    # ProductFn: on 2.11 / 2.12 stock specialises ctx.s, to the recompile limit (8).
    product = this_release({"2.11": 8, "2.12": 8, "2.13": 2, "2.14": 2, "2.15": 2})
    cases = (("tensor_math", 2), ("parity", 2), ("branch", 3), ("float_through_python_arithmetic", product), ("reads_bool", 3))
    for case, want in cases:
        ca_dynsaved.reset()
        torch._dynamo.utils.counters.clear()
        run_loop(leaf_grad_step(CASES[case][0]), lambda: ca_dynsaved.enable(backend="aot_eager", python_policy="stock"))
        assert counts() == Counts(captures=1, compiles=want, graph_breaks=0), case


K = [0, 1, -1, 2**62, -7, 3, 5, 0]
S = [0.0, 1.0, float("nan"), -2.5, 1e300, float("nan"), float("inf"), -0.0]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_special_values_traced(backend):
    """0, 1, negatives, huge, NaN and inf on a traced function: every step equals
    eager. Dynamo specialises a NaN float (its guards cannot model NaN), one
    recompile the probe cannot foresee; the report names the attribute."""
    step = leaf_grad_step(lambda x, i: ScaleFn.apply(x, K[i], S[i]))
    for i in range(len(K)):
        with ca_dynsaved.enable(backend=backend):
            got = step(i)
        with torch._dynamo.compiled_autograd._disable():
            want = step(i)
        assert_grads_equal(got, want, equal_nan=True)
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=0)
    keys = ca_dynsaved.report().functions["ScaleFn"].keys
    assert {n: (v.handling, v.recompiles, v.compiles) for n, v in keys.items()} == {
        "k": ("traced-dynamic", 0, 0),
        "scale": ("traced-dynamic", 1, 2),
    }
    assert "hooks[0].scale" in keys["scale"].guard
    assert f"ScaleFn.scale: {keys['scale'].reason}; Dynamo recompiled on {keys['scale'].guard}" in str(
        ca_dynsaved.report()
    )


def test_probe_runs_once_per_function_and_layout(ext):
    """A C++ function whose saved str is new at every step makes a capture per step;
    the traced Python function beside it is probed once, not once per capture."""

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        y = ScaleFn.apply(x * 2, i, 0.5 + i)
        ext.config_opaque(y, False, f"mode-{i}", [1, 2], 0.5, 1.5).sum().backward()
        return (x.grad,)

    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    assert counts().captures == 6
    assert torch._dynamo.utils.counters["ca_dynsaved"]["probes"] == 1
    assert probe.cache_size() == 1
    # A new layout (the same function, a float where an int was) is probed again.
    run_loop(leaf_grad_step(lambda x, i: ScaleFn.apply(x, float(i), 0.5)), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=2)
    assert probe.cache_size() == 2


def test_probe_sees_no_side_effect_on_the_real_ctx():
    """The probe's backward writes to a stand-in, never to the real ctx."""

    class Writes(_WithK):
        @staticmethod
        def backward(ctx, g):
            ctx.k = ctx.k + 1  # a write in backward
            return g * ctx.k, None, None

    run_loop(leaf_grad_step(lambda x, i: Writes.apply(x, i, 0.5)), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=4)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)


def test_cudagraphs_flag_makes_floats_opaque():
    """With inductor's global CUDA-graphs flag on, Dynamo specialises every float it
    reads, so a traced float would recompile per value: such functions run opaque."""
    step = leaf_grad_step(CASES["tensor_math"][0])
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=6)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (node,) = ca_dynsaved.report().nodes
    assert (node.handling, node.reason.split(" and ")[0]) == ("opaque", "ctx.scale is a float")


def test_report_and_log_say_traced_or_opaque_and_why():
    run_loop(leaf_grad_step(CASES["tensor_math"][0]), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=3)
    run_loop(leaf_grad_step(CASES["branch"][0]), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=3)
    rep = ca_dynsaved.report()
    functions = {f["name"]: f for f in rep.to_dict()["functions"]}
    assert (functions["ScaleFn"]["handling"], functions["ScaleFn"]["reason"]) == (
        "traced-dynamic",
        "its ctx numbers only reach tensor math: ctx.k, ctx.scale",
    )
    assert (functions["GainBranchFn"]["handling"], functions["GainBranchFn"]["reason"]) == (
        "opaque",
        "ctx.k needs its value (guard ctx.k > 2)",
    )
    keys = {k["key"]: (k["handling"], k["compiles"]) for k in functions["ScaleFn"]["keys"]}
    assert keys == {"k": ("traced-dynamic", 0), "scale": ("traced-dynamic", 0)}
    text = str(rep)
    assert "ScaleFn: traced-dynamic, its ctx numbers only reach tensor math: ctx.k, ctx.scale" in text
    assert "GainBranchFn: opaque, ctx.k needs its value (guard ctx.k > 2)" in text


#: (beta, reduction) per step: the str never changes; the float new every step and the str in turn
LOSS_SCHEDULES = {
    "never_change": lambda i: (0.75, "mean"),
    "float_new_str_alternating": lambda i: (0.5 + i / 8, ("mean", "sum")[i % 2]),
}


@pytest.mark.parametrize("schedule", LOSS_SCHEDULES)
def test_numbers_and_str_traced(schedule):
    """A float and a str the backward reads: traced, the float dynamic from the first
    compile and the str guarded by Dynamo as stock guards it: a compile per distinct
    str (never change: 1, as stock; alternating: 2, where stock compiles 3, the
    float's recompile added). Every step equals eager."""
    values = LOSS_SCHEDULES[schedule]
    step = leaf_grad_step(lambda x, i: SmoothLossFn.apply(x, *values(i)))
    stock = stock_counts(step, 8)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager", fullgraph=True), steps=8)
    want = {"never_change": (1, 1), "float_new_str_alternating": (3, 2)}[schedule]
    assert (stock.compiles, counts().compiles) == want
    assert counts() == Counts(captures=1, compiles=want[1], graph_breaks=0) and stock.captures == 1
    (node,) = ca_dynsaved.report().nodes
    assert (node.handling, node.reason) == (
        "traced-dynamic",
        "its ctx numbers only reach tensor math: ctx.beta; ctx.reduction guarded by Dynamo as stock guards it "
        "(a compile per distinct value)",
    )


def test_stock_fails_to_compile_where_the_probe_runs_opaque():
    """The baseline of the python_mod case: stock CA compiles its first step (the
    numbers constants), then fails in the backend once they are dynamic; the plugin
    (test_classification_and_one_compile) runs every step."""
    step = leaf_grad_step(CASES["python_mod"][0])
    with torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend="aot_eager")):
        step(0)
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
            step(1)
