"""Generated C++ backwards whose saved numbers decide their data flow, against eager.

Hypothesis draws programs for ``cpp_programs``' interpreter (each instruction lets
``k`` or ``alpha`` pick a tensor, an argument order, an output, an in-place target, an
index, a dim, a chunk count, or turn a value into a tensor; branches at ``k > BIG``
that both sentinels take alike) and the values of 8 steps that cross every branch
(both signs and parities, zero, above BIG, -0.0, large doubles). Each program is a
first capture (its own plan, its own template): the plugin's state is reset before
it. Every step's gradients must equal eager's, under the default and under
``trace_cpp``, whatever the plugin decides: traced (and verified), traced with a
step run directly, or opaque. What it decided is counted, and each kind must occur,
so the test cannot pass by sending everything opaque.

The CA graph runs as captured (``compiler_fn`` the identity): what makes a gradient
wrong here is the capture, the plan and verify, which a backend compiles as given;
one configuration also runs under aot_eager. 125 programs of 8 steps a
configuration: 2,000 (program, values) pairs in all.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ca_dynsaved
import cpp_programs as cp
from ca_dynsaved import UndefinedGradError

PROGRAMS = 125
STEPS = 8

_K = st.one_of(
    st.integers(-9, 9),
    st.sampled_from([cp.BIG + 1, 2 * cp.BIG, 7919, -104728, 24, 17, -7, 10, 1000, 1001]),
)
_ALPHA = st.one_of(
    st.sampled_from([0.0, -0.0, 0.5, -0.75, 1.5, 2.25, 10.0, 11.0, 20.0, -3.0, math.inf]),
    st.floats(-20.0, 20.0, allow_nan=False, width=32),
)
#: Opcodes both sentinels trace alike (a value in an op, a value computed, a branch
#: at k > BIG or alpha > 10): traced, and verified step by step. The others make the
#: plan refuse (a flow that differs between the sentinels, a tensor made outside
#: dispatch, a double where no tensor carries it): mostly one of those a program.
_ALIKE = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16, 21, 23, 24, 25, 26, 27]
_OPCODE = st.one_of(st.sampled_from(_ALIKE), st.sampled_from(_ALIKE), st.integers(0, max(cp.OPCODES)))
_INSTRUCTION = st.tuples(_OPCODE, st.integers(0, 9), st.integers(0, 9))


@st.composite
def _programs(draw: Any) -> list[int]:
    read = draw(st.sampled_from([0, 0, 0, 1]))
    instructions = draw(st.lists(_INSTRUCTION, min_size=1, max_size=4))
    out_a, out_b = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    return cp.program(read, instructions, out_a, out_b, draw(st.sampled_from(sorted(cp.TRAILERS))))


def _identity(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    return gm


def _same(got: Any, want: Any) -> bool:
    return all(
        (g is None and w is None)
        or (g is not None and w is not None and torch.allclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True))
        for g, w in zip(got, want, strict=True)
    )


def _run_programs(ext: Any, examples: int, **options: Any) -> collections.Counter[str]:
    """Each drawn program's steps under the plugin and in eager; returns what the
    plugin did, counted."""
    seen: collections.Counter[str] = collections.Counter()

    # no shrinking: a failure names its program and step already, and shrinking a
    # failing backward takes minutes
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(_programs(), st.lists(st.tuples(_K, _ALPHA), min_size=STEPS, max_size=STEPS))
    def check(prog: list[int], values: list[tuple[int, float]]) -> None:
        ca_dynsaved.reset()
        counters = torch._dynamo.utils.counters["ca_dynsaved"]
        before = counters["verify_fallbacks"]
        for k, alpha in values:
            try:
                want: Any = cp.run(ext, prog, k, alpha)
            except RuntimeError as e:  # the program itself fails here (eager raises)
                want = e
            try:
                with ca_dynsaved.enable(**options):
                    got: Any = cp.run(ext, prog, k, alpha)
            except UndefinedGradError:
                # an opaque node that returns None, or its incoming gradient as it
                # is, for some values only: the plugin's documented clear error
                # (docs/guarantees.md), raised where a gradient would be wrong
                assert not isinstance(want, Exception)
                seen["UndefinedGradError"] += 1
                continue
            except RuntimeError as e:
                got = e
            seen["pairs"] += 1
            if isinstance(want, Exception):
                assert isinstance(got, Exception), f"eager raised {want!r}, the plugin did not\n{cp.describe(prog)}"
                continue
            assert not isinstance(got, Exception), f"{got!r} at k={k}, alpha={alpha}\n{cp.describe(prog)}"
            assert _same(got, want), f"wrong gradient at k={k}, alpha={alpha}\n{cp.describe(prog)}"
        handling = {node.handling for node in ca_dynsaved.report().nodes}
        seen["programs " + "/".join(sorted(handling))] += 1
        seen["steps run directly"] += counters["verify_fallbacks"] - before

    check()
    return seen


@pytest.mark.filterwarnings("ignore:ca_dynsaved. trace_cpp refused")
@pytest.mark.parametrize("options", [{}, {"trace_cpp": ["ProgramFn"]}], ids=["default", "trace_cpp"])
def test_generated_programs(ext, options):
    seen = _run_programs(ext, PROGRAMS, compiler_fn=_identity, **options)
    assert seen["pairs"] + seen["UndefinedGradError"] == PROGRAMS * STEPS
    # every way a node runs occurs: traced, traced with steps run directly, opaque
    assert seen["programs traced-dynamic"] >= PROGRAMS // 5, seen
    assert seen["programs opaque"] >= PROGRAMS // 5, seen
    assert seen["steps run directly"] >= PROGRAMS // 5, seen


def test_generated_programs_compiled(ext):
    """A few programs with the graph compiled by aot_eager, as a user's would be."""
    seen = _run_programs(ext, 12, backend="aot_eager")
    assert seen["pairs"] + seen["UndefinedGradError"] == 12 * STEPS
    assert seen["programs traced-dynamic"] >= 1, seen
