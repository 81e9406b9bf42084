"""torchvision importable where its C++ ops cannot load: a CPU-only torch.

The package index these machines install from has only PyPI's torchvision wheels,
built against torch's CUDA build (``_C.so`` links ``libtorch_cuda.so``); the 2.13
venv's torch is the CPU wheel (README). There ``_C.so`` fails to load, which
torchvision tolerates (``extension._has_ops()`` is then False), but its
``_meta_registrations`` registers fake kernels for ``torchvision::nms`` and ``qnms``
unconditionally and the import fails (``RuntimeError: operator torchvision::nms does
not exist``). transformers imports torchvision whenever it is installed (its
``image_utils``, reached from every config class), so the failure takes transformers
down with it.

``import_torchvision()`` imports it as it is; on exactly that failure it defines
the two schemas (no kernel: calling them raises) and imports it again. The models
the tests train (``resnet18``) use none of torchvision's C++ ops. Where the ops load
(every CUDA build of torch), nothing is defined.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

#: The stand-in schemas' library, kept alive: a collected Library drops its definitions.
_LIB: torch.library.Library | None = None


def import_torchvision() -> ModuleType | None:
    """torchvision, importable; None where it is not installed."""
    global _LIB
    try:
        import torchvision
    except ModuleNotFoundError:
        return None
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _LIB = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            _LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import torchvision
    return torchvision
