"""Python ``autograd.Function`` ctx attributes: which nodes run opaque.

Under stock CA a Python backward is traced by Dynamo with the ctx as graph input
``hooks[i]``: reading ``ctx.k`` guards on it (an int recompiles once before
automatic dynamic; a value passed to an op whose schema says ``int``/``float``
recompiles on every new value). Policy ``"opaque"`` (the default) runs the
backward of every function whose ctx holds a top-level int or float attribute
(numpy scalars included) through ``ca_dynsaved::py_function`` with its real ctx:
new values never recompile, at the price of the backward's ops not fusing with
their neighbours. Functions whose ctx holds no int or float keep stock tracing, so
a bool or str attribute that picks a branch keeps its guard (one compile per
value), and a tensor attribute stays a graph input.
Policy ``"stock"`` leaves every Python function to stock CA.
"""

from __future__ import annotations

import numbers
from typing import Any

OPAQUE, STOCK = "opaque", "stock"
POLICIES = (OPAQUE, STOCK)


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"ca_dynsaved: python_policy must be one of {POLICIES}, got {policy!r}")
    return policy


def stock_reason(ctx: Any, policy: str, backward_state_idx: Any, opaque_object_indices: Any) -> str | None:
    """Why this Python node keeps stock behaviour, or None to run it opaque."""
    if policy == STOCK:
        return 'python_policy="stock"'
    if getattr(ctx._forward_cls, "boxed_grads_call", False):
        return "boxed_grads_call, which CA does not support"
    if backward_state_idx is not None or opaque_object_indices:
        return "it uses a BackwardState or opaque objects"
    if not any(_is_number(v) for v in vars(ctx).values()):
        return "no int or float ctx attribute (bools, strs and tensors keep stock tracing)"
    return None


def _is_number(value: Any) -> bool:
    """An int or float Dynamo would guard on: Python's (ints beyond int64, which stock
    CA cannot compile, included) and numpy's scalars; not a bool, not a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
