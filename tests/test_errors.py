"""An exception raised in the user's backward reaches the caller unchanged."""

from __future__ import annotations

import contextlib

import pytest
import torch

import ca_dynsaved
from helpers import Counts, assert_grads_equal, counts, leaf_grad_step, patched_state


class StepError(ValueError):
    """A user exception type, with its own attribute."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class RaisingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        if ctx.k % 3 == 2:
            raise StepError(f"RaisingFn refuses k={ctx.k}", ctx.k)
        return g * ctx.k, None


def _outcome(apply, k, plugin: bool):
    """(gradient, None) or (None, exception) of one step."""
    step = leaf_grad_step(apply)
    try:
        with ca_dynsaved.enable(backend="aot_eager") if plugin else contextlib.nullcontext():
            return step(k)[0], None
    except Exception as e:  # noqa: BLE001 - the point is to compare them
        return None, e


@pytest.mark.parametrize("first", [0, 2], ids=["raises_when_compiled", "raises_on_first_run"])
@pytest.mark.parametrize("kind", ["python", "cpp_opaque", "cpp_traceable"])
def test_exception_in_backward_surfaces_unchanged(ext, kind, first):
    """k % 3 == 2 raises (Python: StepError; C++: TORCH_CHECK_VALUE, a ValueError):
    the same type and message as eager, and the next step runs compiled and right.
    ``first=2``: the very first run of the capture (eager, learning) raises."""
    apply = RaisingFn.apply if kind == "python" else getattr(ext, f"throw_{kind.split('_')[1]}")
    raised = 0
    before = patched_state()
    for k in range(first, first + 9):
        got, got_error = _outcome(apply, k, plugin=True)
        want, want_error = _outcome(apply, k, plugin=False)
        assert (got_error is None) == (want_error is None) == (k % 3 != 2)
        if want_error is None:
            assert_grads_equal([got], [want])
            continue
        raised += 1
        assert type(got_error) is type(want_error)
        assert str(got_error) == str(want_error)
        assert getattr(got_error, "step", None) == getattr(want_error, "step", None)
        assert patched_state() == before  # the context unwound completely
    assert raised == 3
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
