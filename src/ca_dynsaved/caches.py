"""``ca_dynsaved.reset()`` and what it clears: every cache the plugin keeps across
backwards (node specs, probe verdicts, compiled graphs shared between captures, the
report...) registers its clear function here where it is defined, so a new cache
cannot be forgotten by ``reset()`` and ``reset()`` need not know the modules that
hold them.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

_Clear = TypeVar("_Clear", bound=Callable[[], object])
_CLEARS: list[Callable[[], object]] = []


def on_reset(clear: _Clear) -> _Clear:
    """Register ``clear`` (a decorator: returns it as it is) to run at each reset."""
    _CLEARS.append(clear)
    return clear


def clear_all() -> None:
    """Run every registered clear, in the order the modules registered them."""
    for clear in _CLEARS:
        clear()


def reset() -> None:
    """Return to a fresh process's state: ``torch._dynamo.reset()`` (which drops
    every cached CA graph), then the plugin's registry, probe verdicts,
    compiled-graph cache and report. Takes no arguments and returns None; the
    config entries and the plugin's installation are left as they are.

    Example::

        ca_dynsaved.reset()  # between experiments: no cached graph, an empty report
        with ca_dynsaved.enable(backend="aot_eager"):
            loss.backward()
    """
    torch._dynamo.reset()
    clear_all()  # every cache registers its clear where it is defined
