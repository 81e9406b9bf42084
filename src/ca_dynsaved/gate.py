"""Whether a backward under a plugin context runs under compiled autograd.

Every outermost ``backward()`` / ``autograd.grad`` under a plugin context goes
through ``gate`` (``_compat.engine.gating_backwards``): under CA, unless
``payoff``'s policy has sent its graph structure to plain autograd, and as plain
autograd where CA cannot collect the graph. Stock CA asserts in
``CppNode::compiled_args`` on a C++ function that calls ``mark_non_differentiable``
or ``mark_dirty``, while it walks the graph for its cache key, before any node runs
(and before it releases the graph's saved tensors): the backward then runs again as
plain autograd, its only run, and its structure stays there (``payoff.uncollectable``:
one backward in 64, then doubling, tries CA again).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .counting import count
from ._compat.capture import custom_nodes, no_ca, uncollectable_reason
from ._compat.dynamo import without_dynamo
from . import payoff

log = logging.getLogger("ca_dynsaved")


@without_dynamo  # runs with Dynamo's frame callback on (the config path)
def gate(run_backward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A backward under a plugin context (``gating_backwards``)."""
    try:
        return payoff.run(run_backward, args, kwargs)
    except RuntimeError as e:
        reason = uncollectable_reason(e)
        if not reason:
            raise
        roots = payoff.roots(args, kwargs)
        nodes = custom_nodes(roots)
        payoff.uncollectable(roots, reason, nodes)
        log.info("ca_dynsaved: a backward runs without compiled autograd: %s (%s)", reason, ", ".join(nodes))
        count("uncollectable_backwards")
        with no_ca():
            return run_backward(*args, **kwargs)
