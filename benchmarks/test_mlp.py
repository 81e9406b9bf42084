"""Stock vs plugin on the benchmark MLP (matmul-bound): total time, steady step, compiles."""

from __future__ import annotations

import pytest
import torch

from harness import run_model
from models import BATCH, DEPTH, MLP, VARIANTS, WIDTH

#: A benchmark's quick mode (counts, not timings): the quick loop (docs/contributing.md) leaves it out.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("variant", VARIANTS)
def test_mlp(benchmark, bench_ext, full_run, record, variant):
    model = MLP(variant, bench_ext)
    torch.manual_seed(0)
    results = run_model(benchmark, record, full_run, "mlp", model, torch.randn(BATCH, WIDTH), variant)
    for config, result in results.items():
        # Counts, not timings: with or without changing values, the backward compiles
        # once; the 4 hashed combinations are 4 captures, the first one's graph traced
        # (its own compile), the other 3 opaque and uncompiled in the first 50 steps;
        # each gets its own traced graph at its 16th run (steps 61-63): by step 100,
        # stock's 4 compiles.
        if config in ("plugin_varying", "plugin_opaque_varying", "stock_constant"):
            assert (result["compiles"], result["captures"]) == ((1, 4) if variant == "hashed" and config == "plugin_varying" else (1, 1)), config
        if full_run and variant == "hashed" and config in ("plugin_varying", "stock_varying"):
            assert result["prefix_compiles"] == 4, config
        if config == "plugin_varying":
            # Traced: the Python activation (python_policy="auto") and the C++ toDouble /
            # toInt reader (sentinels, verified); hashed: opaque in the 3 later captures
            # (opaque nodes per capture: 3 x 4 / 4).
            assert result["opaque_nodes"] == (3 if variant == "hashed" else 0)
        if config == "plugin_opaque_varying":
            assert result["opaque_nodes"] == DEPTH
