"""The traced way of a C++ node: its backward's ATen ops in the CA graph, its numbers
dynamic.

``decision.CppTrace``: the backward reads its numbers symbolically and is traced as
it is (``cpptrace.trace``), its lifted ints the graph's symbolic scalars, its
doubles read from the packed float64 tensor (``rewrite_floats``, as the graph is
made). ``decision.SentinelTrace``: traced with sentinels (``sentinel_traced``).
Either trace then meets the differential check (``differential.py``): its region
against the node's own backward at the capture's values; a refused trace leaves
the graph, and the node runs opaque.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..counting import count
from .._compat.capture import no_proxy_modes
from .._compat.layout import CppCall
from .._compat.symbolic import size_hints
from .. import cpptrace, differential, recording, sentinel
from ..decision import CppTrace, SentinelTrace
from ..opaque import FLOAT
from ..scalars import Packer
from ..state import Capture
from . import sentinel_traced, verify

log = logging.getLogger("ca_dynsaved")


def trace_cpp(
    cap: Capture, fn: Callable[..., Any], grads: Any, call: CppCall, plan: CppTrace | SentinelTrace,
    undefined: tuple[bool, ...],
) -> list[Any] | str:
    """Record the C++ backward's ATen ops, then the differential check. Returns the
    outputs CA gets, or why the node cannot run traced: then the region is gone and
    the node runs opaque."""
    graph = cap.graph
    if isinstance(plan, SentinelTrace) or plan.floats:
        cap.packed_proxies()  # the packed tensors' nodes, before the ops
    if isinstance(plan, SentinelTrace):
        outs, out_nodes, region, check, refusal = sentinel_traced.trace(cap, fn, grads, call, plan)
    else:
        (outs, out_nodes), region = cap.recorded(lambda: cpptrace.trace(cap.instance, fn, grads, call))
        check, refusal = None, ""
    refusal = refusal or _differential(cap, fn, call, plan, check, undefined, region, out_nodes, grads)
    if refusal:
        for node in reversed(region):
            graph.erase_node(node)
        return refusal
    # Dynamic from the first compile: an int, and a double that reaches an op the
    # backend tensorifies (one the rewrite feeds from the packed tensor is never
    # read by Dynamo at all).
    cap.dynamic_sources.extend(f"L['scalars'][{index}]" for index in plan.scalars)
    if isinstance(plan, CppTrace):
        cap.traced_floats |= plan.floats
    else:
        sentinel_traced.kept(cap, check, region)
    return outs


def _differential(
    cap: Capture, fn: Callable[..., Any], call: CppCall, plan: CppTrace | SentinelTrace, check: verify.Check | None,
    undefined: tuple[bool, ...], region: list[torch.fx.Node], out_nodes: list[Any], grads: Any,
) -> str:
    """The differential check of a node just traced: its region against its own
    backward, with the capture's values (a sentinel-traced node's, where verify
    refuses them: sentinel set 0's, which its graph holds as they are)."""
    scalars = list(cap.values)
    derived_ints, derived_floats = [0] * cap.layout.derived_ints, [0.0] * cap.layout.derived_floats
    if isinstance(plan, SentinelTrace):
        inputs = plan.inputs
        index = {k: cap.lifted[v.node].index for k, v in zip(call.keys, call.values) if k in plan.plan.kinds}
        numbers = {k: scalars[i] for k, i in index.items()}
        if check is not None:
            refusal, derived = check.verdict(scalars)
            if refusal:
                numbers = sentinel.values(plan.plan.kinds, 0)
                derived = verify.check(plan.plan, inputs, numbers)[1]
            check.place(derived, derived_ints, derived_floats)
            for key, number in numbers.items():
                scalars[index[key]] = number
        values = inputs.values(numbers)
    else:
        inputs = recording.Inputs.of(fn, call, undefined)
        values = [scalars[cap.lifted[v.node].index] for v in call.values]
    packed = Packer(cap.layout.kinds, tensors=cap.packed is not None)
    _, _, scalar_values = packed(scalars, derived_ints, derived_floats)
    with no_proxy_modes():
        capture_sizes = (
            [(size_hints(t)[0], t.dtype, t.device) if isinstance(t, torch.Tensor) else t for t in call.saved],
            [None if u else (list(t.shape), t.dtype, t.device) for t, u in zip(call.incoming_grads(), undefined)],
        )
    refusal = differential.differs(
        inputs, values, region, out_nodes, [cap.node_of(g) for g in grads], [cap.node_of(t) for t in call.saved],
        (cap.instance.scalars_proxy.node, scalar_values), capture_sizes,
    )
    count("differential_checks")
    if refusal:
        count("differential_refusals")
        log.info("capture !%d: %s runs opaque: %s", cap.id, call.name, refusal)
    return refusal and f"its traced graph and its own backward differ at the capture's values: {refusal}"


def rewrite_floats(cap: Capture) -> None:
    """As the graph is made: each lifted double a traced node reads from CA's
    scalars list, read from the packed float64 tensor instead (``X.Scalar`` ops
    become ``X.Tensor``), so Dynamo never sees it as a Python number."""
    if not cap.traced_floats:
        return
    floats = {scalar.index: symnode for symnode, scalar in cap.lifted.items() if scalar.kind is FLOAT}
    cpptrace.rewrite_float_scalars(
        cap.graph,
        cpptrace.float_getitems(cap.instance.scalars_proxy.node, floats),
        lambda symnode: cap.packed_value(symnode, False),
    )
