"""Stock CA's per-graph runtime wrapper, and the plugin's copy of it.

Touches: the closure ``runtime_wrapper`` of ``AutogradCompilerInstance.end_capture``
(its source, free variables and cells), ``ca.in_compiled_autograd_region``,
``ca.make_compile_context``, ``ca._disable``, ``torch._dynamo.maybe_mark_dynamic``.
Releases: the wrapper's source is the same on 2.11 to 2.15 (checked by hash at each
use: another source keeps stock's wrapper).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import textwrap
from typing import Any, Callable

import torch
import torch._dynamo.compiled_autograd as ca

from .dynamo import without_dynamo


#: sha1 of the source of stock CA's per-graph ``runtime_wrapper`` (a closure of
#: ``end_capture``), the same in every tested release: ``sizes_made_once`` stands in
#: for it only where it is that code.
_STOCK_RUNTIME_WRAPPER_SHA1 = "175bba2e81b9e24394729b7a51bd51b2963e9a17"
_STOCK_RUNTIME_WRAPPER_FREEVARS = ("runtime_inputs_to_move", "self", "used_sizes_idx")


@functools.cache
def _is_stock_runtime_wrapper(code: Any) -> bool:
    try:
        source = textwrap.dedent(inspect.getsource(code))
    except (OSError, TypeError):
        return False
    return (
        hashlib.sha1(source.encode()).hexdigest() == _STOCK_RUNTIME_WRAPPER_SHA1
        and code.co_freevars == _STOCK_RUNTIME_WRAPPER_FREEVARS
    )


def sizes_made_once(runtime_wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """Stock CA's runtime wrapper of one graph, except for the tensor standing for
    each used size (``(0, n)``, marked dynamic): made again only when that size
    changes, and with strides ``(1, 1)``. Why: stock makes one and calls
    ``maybe_mark_dynamic`` (a disabled function: two frame-callback swaps) for every
    used size on every run, while a training loop's sizes rarely change; and
    ``torch.empty(0, n)``'s stride ``n`` adds a Python guard per size, checked on
    every run (docs/benchmarks.md, "Component costs"). Each size keeps an object of
    its own, so Dynamo sees no new aliasing between them. Returns ``runtime_wrapper``
    itself where its code is not the one this copies (another torch)."""
    code = runtime_wrapper.__code__
    if not _is_stock_runtime_wrapper(code):
        return runtime_wrapper
    cells = dict(zip(code.co_freevars, runtime_wrapper.__closure__ or ()))
    instance, to_move = cells["self"].cell_contents, cells["runtime_inputs_to_move"].cell_contents
    used = sorted(cells["used_sizes_idx"].cell_contents)
    made: dict[int, tuple[int, torch.Tensor]] = {}  # used size index -> (size, its tensor)

    @without_dynamo
    def wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):  # type: ignore[no-untyped-def]
        # stock's steps, in stock's order
        try:
            ca.in_compiled_autograd_region = True
            nan_checker = instance.nan_checker
            if nan_checker:
                nan_checker.prep_with_inputs(inputs)
            filtered: list[Any] = []
            for idx in used:
                integer = sizes[idx]
                if integer > 0:  # (stock: "can't create negative size")
                    found = made.get(idx)
                    if found is None or found[0] != integer:
                        found = made[idx] = (integer, torch.empty_strided((0, integer), (1, 1)))
                        torch._dynamo.maybe_mark_dynamic(found[1], 1)
                    filtered.append(found[1])
                else:
                    filtered.append(integer)
            for i in to_move:
                inputs[i] = inputs[i].pin_memory().cuda(non_blocking=True)
            with ca._disable(), ca.make_compile_context(instance.id):
                out = compiled_fn(inputs, filtered, scalars, hooks, packed_inputs)
                if nan_checker:
                    nan_checker.check(out)
                return out
        finally:
            ca.in_compiled_autograd_region = False

    return wrapper
