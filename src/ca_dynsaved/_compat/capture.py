"""What a capture uses of stock compiled autograd's module.

Touches: ``torch._dynamo.compiled_autograd`` (``AutogradCompilerInstance``, ``_enable``,
``_disable``, ``ops``, ``disable_proxy_modes_tracing``, ``active_disable_ctx``), its C++ half
``torch._C._dynamo.compiled_autograd`` (the cache), ``torch._dynamo.external_utils.
call_backward``, ``torch._dynamo.utils.counters``, ``Tensor.grad_dtype``,
``torch._C._is_alias_of``, ``allocate_dummy`` (an unpacked tensor's stand-in), the
assertions of ``CppNode::compiled_args`` and the ``CppFunction`` node type. Releases:
the same on 2.11 to 2.15 (``grad_dtype``: set by 2.15's FSDP2 mixed precision, None
elsewhere).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch._dynamo.compiled_autograd as ca
from torch._dynamo.utils import counters

#: The stock capture class; the plugin subclasses it.
StockCompilerInstance = ca.AutogradCompilerInstance
#: The stock ``_enable`` context manager, captured before the plugin wraps it.
stock_enable: Callable[..., Any] = ca._enable

_cpp = torch._C._dynamo.compiled_autograd


def clear_ca_cache() -> None:
    """Drop every cached CA graph (the C++ shadow graph), as ``ca.reset`` does."""
    _cpp.clear_cache()


def ca_cache_is_empty() -> bool:
    return bool(_cpp.is_cache_empty())


def swap_instance_class(cls: Callable[..., Any]) -> Callable[..., Any]:
    """Set the class ``ca._enable`` instantiates; returns the previous one."""
    prior = ca.AutogradCompilerInstance
    ca.AutogradCompilerInstance = cls
    return prior


def swap_enable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Set ``ca._enable`` (looked up by attribute by Dynamo's config path)."""
    prior = ca._enable
    ca._enable = fn
    return prior


def stock_ca(compiler_fn: Callable[..., Any]) -> Any:
    """Stock compiled autograd around a block (through the plugin's ``_enable`` hook,
    so the CA cache changes hands): the baseline of the demo and ``run --compare``."""
    return ca._enable(compiler_fn)


def no_ca() -> Any:
    """Plain autograd inside a block, even within a CA context: the eager reference."""
    return ca._disable()


#: What stock CA's collection asserts on a C++ custom function it cannot collect
#: (``CppNode::compiled_args`` in ``torch/csrc/autograd/custom_function.h``, 2.11 to
#: 2.15), before any node of the backward runs.
_UNCOLLECTABLE = {
    "ctx_.non_differentiable_.empty()": "a C++ custom function calls mark_non_differentiable",
    "ctx_.dirty_inputs_.empty()": "a C++ custom function calls mark_dirty",
}


def uncollectable_reason(error: BaseException) -> str:
    """Why CA could not collect a backward's graph, from the error its collection
    raised ('' for any other error): nothing of the backward has run then."""
    text = str(error)
    if "INTERNAL ASSERT FAILED" not in text:
        return ""
    return next((why for assertion, why in _UNCOLLECTABLE.items() if assertion in text), "")


#: The Python type of every C++ custom function's autograd node.
_CPP_NODE = "CppFunction"


def custom_nodes(roots: Any) -> list[str]:
    """The names of the C++ custom-function nodes below ``roots`` (tensors), each
    once: the candidates when CA cannot collect a graph (its error names none)."""
    names: dict[str, None] = {}
    seen: set[Any] = set()
    stack = [getattr(r, "grad_fn", None) for r in roots if isinstance(r, torch.Tensor)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == _CPP_NODE:
            names[node.name()] = None
        stack.extend(m for m, _ in node.next_functions)
    return list(names)


def node_name(node: Any) -> str | None:
    """A C++ custom-function node's name (they share one Python type), else None."""
    return node.name() if type(node).__name__ == _CPP_NODE else None


def call_backward(ctx: Any, saved_tensors: list[Any], *grads: Any) -> tuple[Any, ...]:
    """Run a Python custom function's backward exactly as a CA graph does."""
    from torch._dynamo.external_utils import call_backward

    return call_backward(ctx, saved_tensors, *grads)


#: Where ``register_autograd`` puts the autograd.Function it generates for a custom
#: op (2.11 to 2.15): torch's module, around the user's backward.
_GENERATED_AUTOGRAD_MODULE = "torch._library.autograd"


def is_torch_own_function(cls: type) -> bool:
    """A Python autograd.Function of torch itself (FSDP2's hooks, checkpointing), not
    one a custom op's ``register_autograd`` generated around the user's backward."""
    module = cls.__module__
    return module.partition(".")[0] == "torch" and module != _GENERATED_AUTOGRAD_MODULE


#: The shape of what stock CA's capture hands on for a tensor a saved-tensor hook
#: unpacks (``allocate_dummy``: "a weird quantity, easy to grep"): the hook runs only
#: when the graph runs, so a capture knows nothing of that tensor.
_UNPACK_PLACEHOLDER_SHAPE = StockCompilerInstance.allocate_dummy(None).shape


def is_unpack_placeholder(t: Any) -> bool:
    """``t`` is the capture's stand-in for a tensor a hook unpacks at run time (a
    checkpointed activation), not a tensor of the backward's real shape."""
    return isinstance(t, torch.Tensor) and t.shape == _UNPACK_PLACEHOLDER_SHAPE


#: Torch's event counters (``counters["ca_dynsaved"]`` holds the plugin's own).
counters = counters


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (its ``unique_graphs`` count)."""
    return counters["stats"]["unique_graphs"]


def capture_count() -> int:
    """CA captures so far in this process (a backward that added one missed CA's cache)."""
    return counters["compiled_autograd"]["captures"]


# --- What a capture allocates ----------------------------------------------------------
def grad_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype ``t.grad`` gets: ``t.grad_dtype`` (``t``'s unless set; None allows
    any, then ``t``'s)."""
    return t.grad_dtype or t.dtype


def no_proxy_modes() -> Any:
    """CA's context for making real tensors while a capture traces."""
    return ca.disable_proxy_modes_tracing()


#: Whether two tensors share storage (a view, a detach, the same tensor): one C++ call.
is_alias_of = torch._C._is_alias_of


def validate_outputs_fn() -> Callable[..., Any]:
    """The C++ ``validate_outputs`` functional, bound by the first CA capture."""
    return ca.ops.get("validate_outputs").fn
