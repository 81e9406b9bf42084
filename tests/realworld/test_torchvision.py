"""torchvision 0.28 (torch 2.13): ResNet-18 on small images, batch norm in training
mode. No custom function: the plugin compiles what stock compiles, no break, with
eager's gradients (its convolution, batch-norm and pooling backwards are ATen's).

torchvision's wheels on the index are CUDA builds; on the CPU wheel of torch its C++
ops cannot load, which ResNet-18 never calls (``torchvision_shim``).
"""

from __future__ import annotations

import pytest

from helpers import Counts, this_release
from real_models import compare_modes, resnet18

#: A real library's training runs: the quick loop (docs/contributing.md) leaves them out.
pytestmark = pytest.mark.slow

STEPS = 3
#: stock's counts, per release (measured; aot_eager, 3 steps, 32 x 32 images)
STOCK = {"2.13": Counts(1, 1, 0)}


def test_resnet18() -> None:
    model = resnet18()
    found = compare_modes(model, STEPS)
    assert found["stock"] == this_release(STOCK)
    assert found["plugin"] == Counts(captures=1, compiles=1, graph_breaks=0)
    assert found["eager forwards"] == STEPS * len(model.blocks)
