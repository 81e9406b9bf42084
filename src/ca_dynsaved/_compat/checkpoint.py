"""What the plugin reads of activation checkpointing (``torch.utils.checkpoint``).

Touches: ``torch.utils.checkpoint._checkpoint_hook`` (the code objects of its
``unpack_hook`` and ``unpack_hook_with_error_cb`` closures, their free variable
``frame``), ``_CheckpointFrame.weak_holders`` / ``x_metadatas`` /
``metadata_fn``, ``_default_meta_extractor`` (what ``determinism_check="default"``
records: ``{"shape", "dtype", "device"}`` per saved tensor, 1:1 with
``weak_holders``), ``CheckpointFunction`` (the reentrant checkpoint), and
``torch._C._storage_Use_Count``. Releases: the same names and closure layout on
2.11 to 2.15 (2.13 adds ``GraphExecGroup`` inside the hook, which reads no more of
the frame).

Why these: a non-reentrant checkpoint packs every tensor saved in its region as a
``_Holder`` and recomputes the region when the backward first unpacks one. Under
CA the unpack is ``call_hook(hooks[i], packed_data[j])`` in the graph, which Dynamo
refuses (``torch.utils.checkpoint`` is skipped): a graph break per unpack. What the
unpacked tensor will be is known before the graph runs: the frame recorded each
saved tensor's shape, dtype and device at pack time, and checks the recomputed
tensor against it (``check_recomputed_tensors_match`` raises otherwise).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.utils.checkpoint as _cp

#: The code objects of the non-reentrant checkpoint's unpack hooks (with and
#: without ``debug=True``'s error callback): a hook is one of these closures.
#: A release without them finds none: every run then takes the stock twin.
_UNPACK_CODES = frozenset(
    c
    for c in getattr(getattr(_cp, "_checkpoint_hook", None), "__init__", _cp.checkpoint).__code__.co_consts
    if isinstance(c, types.CodeType) and c.co_name in ("unpack_hook", "unpack_hook_with_error_cb")
)
_FRAME_CELL = {code: code.co_freevars.index("frame") for code in _UNPACK_CODES if "frame" in code.co_freevars}
_DEFAULT_METADATA = getattr(_cp, "_default_meta_extractor", None)

#: torch's reentrant checkpoint (``use_reentrant=True``): a Python autograd.Function
#: whose backward recomputes and runs a nested backward; Dynamo skips it.
REENTRANT_FUNCTION = _cp.CheckpointFunction


def frame_of(hook: Any) -> Any | None:
    """The ``_CheckpointFrame`` of a non-reentrant checkpoint's unpack hook, None for
    any other hook."""
    code = getattr(hook, "__code__", None)
    cell = _FRAME_CELL.get(code)  # type: ignore[arg-type]
    if cell is None:
        return None
    return hook.__closure__[cell].cell_contents


def holder_index(frame: Any) -> dict[int, int]:
    """``id(holder) -> its index`` in ``frame``'s saved tensors (``x_metadatas``' order)."""
    index = {}
    for i, ref in enumerate(frame.weak_holders):
        holder = ref()
        if holder is not None:
            index[id(holder)] = i
    return index


def saved_metadata(frame: Any, index: int) -> tuple[torch.Size, torch.dtype, torch.device] | None:
    """(shape, dtype, device) the frame recorded for its ``index``-th saved tensor at
    pack time, which the recomputation is checked against; None where the frame
    recorded none (``determinism_check="none"``) or checks none
    (``ignore_saved_mismatch``, set by selective checkpointing's
    ``allow_cache_entry_mutation``)."""
    if (
        _DEFAULT_METADATA is None
        or frame.metadata_fn is not _DEFAULT_METADATA
        or getattr(frame, "ignore_saved_mismatch", True)
    ):
        return None
    meta = frame.x_metadatas[index]
    return meta["shape"], meta["dtype"], meta["device"]


def owns_storage(t: torch.Tensor) -> bool:
    """No other tensor shares ``t``'s storage (a view of it, a detach, the tensor a
    recomputed input came from): the one count is ``t``'s own, plus the storage
    object this call makes."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2
