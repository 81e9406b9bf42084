"""Python ``autograd.Function`` nodes: traced with dynamic ctx numbers, opaque, or stock.

Under stock CA a Python backward is traced by Dynamo with the ctx as graph input
``hooks[i]``: reading ``ctx.k`` guards on it (an int or float recompiles once before
automatic dynamic makes it symbolic; a value passed to an op whose schema says
``int``/``float`` recompiles on every new value). The policies:

* ``"auto"`` (the default): a function whose ctx numbers only reach tensor math is
  traced as stock CA traces it, with those numbers dynamic from the first compile
  (``L['hooks'][i].<attr>`` seeded into Dynamo's automatic-dynamic state by
  ``compiler.py``): one compile, and inductor fuses its backward. One that would
  specialise on a number (``probe.py`` decides, once per function and ctx layout)
  runs opaque, as under ``"opaque"``.
* ``"opaque"``: every function whose ctx holds a top-level int or float (numpy
  scalars included) runs its backward through ``ca_dynsaved::py_function`` with its
  real ctx: new values never recompile; its ops do not fuse with their neighbours.
* ``"stock"``: every Python function is left to stock CA.

Under ``"auto"`` and ``"opaque"``, a function whose backward Dynamo would break
the graph at (``graphbreak.py`` traces it alone, once per function and ctx layout)
runs opaque too, whatever its ctx holds. Any other function whose ctx holds no int
or float keeps stock tracing, so a bool or str attribute that picks a branch keeps
its guard (one compile per value), and a tensor attribute stays a graph input.
``decision.decide_python`` applies the policy to a node (its values: ``policies``).
"""

from __future__ import annotations

from typing import Any

from .policies import STOCK
from .probe import is_number


def dynamic_sources(ctx: Any, hook: int) -> list[str]:
    """Dynamo's names of a traced node's ctx numbers (``L['hooks'][0].k``)."""
    return [f"L['hooks'][{hook}].{name}" for name, value in vars(ctx).items() if is_number(value)]


def stock_reason(ctx: Any, policy: str, backward_state_idx: Any, opaque_object_indices: Any) -> str | None:
    """Why this Python node keeps stock behaviour, or None to decide by the policy."""
    if policy == STOCK:
        return 'python_policy="stock"'
    if getattr(ctx._forward_cls, "boxed_grads_call", False):
        return "boxed_grads_call, which CA does not support"
    if backward_state_idx is not None or opaque_object_indices:
        return "it uses a BackwardState or opaque objects"
    return None
