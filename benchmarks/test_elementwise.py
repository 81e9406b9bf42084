"""Stock vs plugin on the elementwise model (fusion-sensitive): what an opaque node
costs where inductor would fuse, and what tracing with dynamic ctx numbers gets back."""

from __future__ import annotations

import pytest
import torch

from harness import run_model
from models import COLS, ELEMENTWISE_VARIANTS, LAYERS, ROWS, Elementwise

#: A benchmark's quick mode (counts, not timings): the quick loop (docs/contributing.md) leaves it out.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("variant", ELEMENTWISE_VARIANTS)
def test_elementwise(benchmark, bench_ext, full_run, record, variant):
    torch.manual_seed(0)
    model = Elementwise(variant, bench_ext)
    x = torch.randn(ROWS, COLS)
    results = run_model(benchmark, record, full_run, "elementwise", model, x, variant)
    for config, result in results.items():
        if config in ("plugin_varying", "plugin_opaque_varying", "plugin_trust_varying", "stock_constant"):
            assert (result["compiles"], result["captures"]) == (1, 1), config
        if config == "plugin_varying":
            # Traced: the Python function (auto), the toSym* C++ reader, the toDouble /
            # toInt reader (sentinels, its constant hashed values baked in), the
            # opted-in one and the one computing 0.5 * beta (lifted from verify's run).
            assert result["opaque_nodes"] == 0
        if config == "plugin_opaque_varying":
            assert result["opaque_nodes"] == LAYERS
