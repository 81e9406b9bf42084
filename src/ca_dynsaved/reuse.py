"""One compiled function for CA graphs that differ only in hashed saved values.

CA hashes bool, str, None and nested (list / dict) ``saved_data`` values into its
cache key, so each new combination is a new capture and, under stock, a new
Dynamo compile of a new GraphModule. Once those values travel as run-time data of
the capture (``binding.NodeCapture``), such captures produce the same graph, and
this cache hands the second one the compiled function of the first.

The key of a graph is everything its compiled code depends on: the generated code
(placeholders used, node order, every constant argument, the op keys naming
structure and undefined outputs), the identity of every callable and attribute
the code reaches, since a per-capture closure (an AOT backward prologue, a stock
C++ node op) can hide behind the same name, and the compiler. The cache keeps
what it holds alive, so an id cannot be reused while its entry exists.

Compilers: ``enable``'s default compares by its ``torch.compile`` arguments; a given
``compiler_fn`` by identity. Dynamo's config path builds a new compiler for every
compiled frame it enters, so all of its compilers count as one: two compiled
frames with different backends may share code for an equal CA graph, as stock
CA's own cache shares it across them for a graph it has seen.
"""

from __future__ import annotations

import hashlib
import operator
from collections import OrderedDict
from typing import Any, Callable

import torch

from .counting import count
from ._compat.config import is_dynamo_config_compiler
from .caches import on_reset
from . import opaque
from .binding import NodeCapture

#: Most compiled functions kept; the least recently used goes first.
MAX_ENTRIES = 64

_CACHE: OrderedDict[tuple[str, Any], Callable[..., Any]] = OrderedDict()


def compiler_tag(compiler_fn: Any) -> Any:
    """What identifies a compiler for reuse: ``enable``'s default (a frozen
    dataclass) by value, a given ``compiler_fn`` by identity, Dynamo's config path
    as one compiler."""
    if is_dynamo_config_compiler(compiler_fn):
        return ("dynamo config path", compiler_fn.fullgraph)
    return compiler_fn


class _Ref:
    """A node argument in a key: the index of the node it names."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"%{self.index}"


def canonical_key(gm: torch.fx.GraphModule) -> str:
    """Each node's kind, target (by identity) and arguments (nodes by position,
    constants by repr), in order: the graph's code without its node names, which
    depend on what a capture traced and then removed (a later combination's graph
    with its node opaque: ``ways.tiered.graphs``)."""
    index: dict[torch.fx.Node, int] = {}
    items = []
    for node in gm.graph.nodes:
        index[node] = len(index)
        if node.op == "call_function":
            target: Any = id(node.target)
        elif node.op == "get_attr":
            target = id(getattr(gm, node.target))
        else:
            target = node.target  # a placeholder's name, a method's or module's
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(index[n]))  # type: ignore[arg-type,return-value]
        items.append((node.op, target, args))
    return hashlib.sha1(repr(items).encode()).hexdigest()


def name_learned_outputs(gm: torch.fx.GraphModule, nodes: list[NodeCapture]) -> None:
    """Put what each opaque node's first run learned into its key (see opaque): its
    undefined outputs, and the outputs that were an incoming grad as is, whose users
    then take that grad's node instead of a copy."""
    for node in list(gm.graph.nodes):
        index = opaque.KEY_ARG.get(node.target)
        if index is None:
            continue
        capture = nodes[node.args[index + 1]]
        through = capture.passthrough or ()
        args = list(node.args)
        args[index] = opaque.with_learned(args[index], capture.defined, through)
        node.args = tuple(args)
        for user in list(node.users):
            if user.target is operator.getitem and through and through[user.args[1]] >= 0:
                user.replace_all_uses_with(node.args[0][through[user.args[1]]])
                gm.graph.erase_node(user)
                count("passthrough_outputs")
    gm.recompile()


def compiled_for(
    gm: torch.fx.GraphModule, compiled_fn: Callable[..., Any], compiler_fn: Any
) -> tuple[Callable[..., Any], str]:
    """The compiled function of an equal graph seen before with the same compiler
    ("reused"), else ``compiled_fn``, the one compiled for ``gm`` ("compiled")."""
    key = (canonical_key(gm), compiler_tag(compiler_fn))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        count("reuse_hits")
        return hit, "reused"
    count("reuse_misses")
    _CACHE[key] = compiled_fn
    if len(_CACHE) > MAX_ENTRIES:
        _CACHE.popitem(last=False)
        count("reuse_evictions")
    return compiled_fn, "compiled"


def cache_size() -> int:
    return len(_CACHE)


@on_reset
def clear() -> None:
    _CACHE.clear()
