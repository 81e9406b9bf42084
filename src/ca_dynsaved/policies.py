"""The policies a user picks for custom functions: ``python_policy`` and
``cpp_policy`` (``enable``, the config entries) take the same three values.

* ``"auto"`` (the default): the plugin decides per node (``decision.py``): a node
  whose saved numbers only reach tensor math is traced with them dynamic, any other
  runs opaque.
* ``"opaque"``: every node with a saved number runs through the opaque op.
* ``"stock"``: every node is left to stock compiled autograd.

The values are ``names.Policy``'s, so that a policy and a node's handling
(``names.Handling``: what the report prints) are never confused for each other,
though two of them are spelled alike.
"""

from __future__ import annotations

from .names import Policy

AUTO, OPAQUE, STOCK = Policy.AUTO, Policy.OPAQUE, Policy.STOCK
POLICIES = (AUTO, OPAQUE, STOCK)


def check(policy: str, what: str = "python_policy") -> str:
    """``policy`` if it is one of ``POLICIES``; else the ``ValueError`` the user sees."""
    if policy not in POLICIES:
        raise ValueError(f"ca_dynsaved: {what} must be one of {POLICIES}, got {policy!r}")
    return policy
