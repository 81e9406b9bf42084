"""FX graph helpers the ways a node runs share: a CA graph's head, its order, and
running it with its opaque ops called directly."""

from __future__ import annotations

import heapq
import operator
from typing import Any

import torch

from . import checkpoint, fuse, opaque


def head_end(graph: torch.fx.Graph) -> torch.fx.Node:
    """The last node of the graph's head: its placeholders and the items CA reads
    from them at begin_capture (``inputs[i]``, ``sizes[i]``, ``scalars[i]``), which
    CA's backends expect first, in that order."""
    last = None
    for node in graph.nodes:
        head = node.op == "placeholder" or (
            node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "placeholder"
        )
        if not head:
            break
        last = node
    assert last is not None
    return last


def after_inputs(graph: torch.fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, keeping the order
    otherwise (of the nodes ready, the earliest first)."""
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    if all(index[i] < index[node] for node in nodes for i in node.all_input_nodes):
        return
    waiting = {node: len(node.all_input_nodes) for node in nodes}
    ready = [index[node] for node in nodes if not waiting[node]]
    heapq.heapify(ready)
    placed: list[torch.fx.Node] = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        placed.append(node)
        for user in node.users:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, index[user])
    assert len(placed) == len(nodes), "ca_dynsaved: a cycle in a capture's graph"
    for before, node in zip(placed, placed[1:]):
        if before.next is not node:
            before.append(node)


_RUNNERS = {**opaque.RUNNERS, fuse.CHAIN_OP: fuse.run_chain, checkpoint.UNPACK_OP: checkpoint.unpack_now}


class Differentiable(torch.fx.Interpreter):
    """Runs a CA graph calling the backwards directly, so autograd records them."""

    def run_to_list(self, *args: Any) -> list[Any]:
        # C++ wants a plain list; the interpreter returns FX's immutable_list.
        return list(self.run(*args))

    def call_function(self, target, args, kwargs):  # type: ignore[no-untyped-def,override]
        runner = _RUNNERS.get(target)
        if runner is not None:
            return runner(*args, **kwargs)
        return super().call_function(target, args, kwargs)
