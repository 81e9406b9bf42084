"""The checkpoint-unpack way: each unpack of a checkpointed saved tensor as one op
in the CA graph (the op, and why it cannot give a wrong gradient: ``checkpoint.py``).

As the graph is made (``unpack_ops``), stock's ``call_hook`` nodes become unpack
ops, each reading its ``like`` from the scalars list (``scalars.Layout``), and a
copy of the graph as stock made it is kept: its stock twin, which a run whose
hooks are not all checkpoint's takes (``stock_twin``).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import torch

from ..counting import count
from .. import checkpoint
from ..graphs import Differentiable, after_inputs, head_end
from ..records import CaptureRecord
from ..state import Capture

log = logging.getLogger("ca_dynsaved")


def unpack_ops(cap: Capture, id: str) -> checkpoint.Unpacks | None:
    """Keep a copy of the graph as stock made it (the stock twin), then swap each
    checkpoint unpack's ``call_hook`` for the unpack op, reading its ``like`` from
    the scalars list after what the runtime wrapper puts there: at the graph's
    head, as the packed tensors (``state.Capture.packed_proxies``). None if CA's
    dead-code pass took every unpack."""
    graph = cap.graph
    twin = torch.fx.Graph()
    twin.output(twin.graph_copy(graph, {}))
    head = head_end(graph)
    slots = []
    for node, hook, data in cap.unpack_calls:
        if node._erased or not node.users:  # CA's dead-code pass took it
            continue
        slot = len(slots)
        slots.append((hook, data))
        with graph.inserting_after(head):
            like = graph.call_function(operator.getitem, (cap.instance.scalars_proxy.node, cap.layout.unpack_like(slot)))
        with graph.inserting_before(node):
            op = graph.call_function(checkpoint.UNPACK_OP, (like, hook, data, slot))
        op.meta.update(node.meta)
        node.replace_all_uses_with(op)
        inputs = node.all_input_nodes
        graph.erase_node(node)
        for read in inputs:  # hooks[i], packed_data[j]: Dynamo need not see them
            if not read.users and read.op != "placeholder":
                graph.erase_node(read)
    if not slots:
        return None
    after_inputs(graph)
    stock = torch.fx.GraphModule(cap.instance.fx_tracer.root, twin, f"{id}Stock")
    cap.record.unpacks = len(slots)
    return checkpoint.Unpacks(slots, stock)


def stock_twin(
    unpacks: checkpoint.Unpacks, why: str, record: CaptureRecord, compiler_fn: Callable[..., Any]
) -> Callable[..., Any]:
    """What runs a step whose unpack hooks the graph cannot take (a hook not
    checkpoint's, a checkpoint without metadata): the capture as stock CA made it,
    compiled as stock compiles it (its opaque ops bound as usual by the caller)."""
    if unpacks.fallback is None:
        log.info("capture !%d: checkpoint unpacks run as stock: %s", record.ca_id, why)
        record.unpack_fallback = why
        unpacks.fallback = compiler_fn(unpacks.stock_twin)
    count("unpack_stock_runs")
    return Differentiable(unpacks.stock_twin).run_to_list if torch.is_grad_enabled() else unpacks.fallback
