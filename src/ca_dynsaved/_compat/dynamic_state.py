"""Dynamo's automatic-dynamic state: scalars made dynamic before a graph's first compile.

Touches: ``torch._dynamo.pgo`` (``get_code_state``, ``CodeId``,
``FrameStateSizeEntry``, ``auto_dynamic``), ``torch._dynamo.resume_execution.
ContinueExecutionCache.generate`` (patched while installed),
``torch._dynamo.utils.ExactWeakKeyDictionary``. Releases: ``CodeId.make(code)`` takes
one argument on 2.11, an optional closure on 2.12+; the rest the same on 2.11 to 2.15.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from torch._dynamo.utils import ExactWeakKeyDictionary

from ..caches import on_reset


def mark_dynamic_scalars(code: Any, sources: Sequence[str]) -> None:
    """Make Dynamo treat the scalars named ``sources`` (``L['hooks'][0].k``) in
    frames of ``code``, and of the resume functions Dynamo makes from them at a
    graph break, as dynamic from their first compile.

    What automatic dynamic records once a value has changed (one recompile later);
    writing it before the first compile skips that recompile. Only these names
    change: tensor sizes and every other input keep their own dynamism. Cleared by
    ``torch._dynamo.reset()``."""
    if not sources:
        return
    from torch._dynamo import pgo

    # CodeId.make(code) on 2.11; 2.12+ add an optional closure (none here).
    state = pgo.get_code_state()[pgo.CodeId.make(code)]
    for name in sources:
        state.automatic_dynamic[name] = pgo.FrameStateSizeEntry.make_scalar(pgo.auto_dynamic)
    _dynamic_by_code[code] = tuple(sources)


@on_reset
def clear_dynamic_scalars() -> None:
    """Forget the marked codes (``ca_dynsaved.reset()``; pgo's own state goes with
    ``torch._dynamo.reset()``)."""
    _dynamic_by_code.clear()


#: CA graph code (and resume functions made from it) -> its dynamic scalars. By
#: identity: code objects compare equal by value, and a stock capture's graph can
#: have the same code as a plugin one.
_dynamic_by_code: Any = ExactWeakKeyDictionary()


def _marking_resume_functions(generate: Any) -> Any:
    """``ContinueExecutionCache.generate``, then the dynamic scalars of the frame it
    resumes marked on the new code. A resume function keeps the frame's local
    names (``hooks``, ``scalars``), so the sources are the same strings; without
    this, a CA graph broken by a disabled hook (FSDP2's) recompiles once per
    resume function that reads a ctx number."""

    @functools.wraps(generate)
    def wrapper(cls: Any, code: Any, *args: Any, **kwargs: Any) -> Any:
        new_code = generate(cls, code, *args, **kwargs)
        sources = _dynamic_by_code.get(code)
        if sources:
            mark_dynamic_scalars(new_code, sources)
        return new_code

    wrapper.__wrapped_generate__ = generate  # type: ignore[attr-defined]
    return wrapper


def resume_functions_patched() -> bool:
    """Whether the resume-function marking is installed."""
    from torch._dynamo.resume_execution import ContinueExecutionCache as cache

    return getattr(cache.__dict__["generate"].__func__, "__wrapped_generate__", None) is not None


def patch_resume_functions(on: bool) -> None:
    """Install (``on``) or remove the resume-function marking; idempotent."""
    from torch._dynamo.resume_execution import ContinueExecutionCache as cache

    current = cache.__dict__["generate"].__func__
    original = getattr(current, "__wrapped_generate__", None)
    if on and original is None:
        cache.generate = classmethod(_marking_resume_functions(current))
    elif not on and original is not None:
        cache.generate = classmethod(original)
