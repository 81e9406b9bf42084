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
        # once (the 4 hashed combinations are 4 captures sharing one compiled graph).
        if config in ("plugin_varying", "plugin_opaque_varying", "stock_constant"):
            captures = 4 if (variant, config) == ("hashed", "plugin_varying") else 1
            assert (result["compiles"], result["captures"]) == (1, captures), config
        if config == "plugin_varying":
            # python_policy="auto": the Python activation's ctx numbers only reach tensor
            # math, so it is traced; the C++ ones (toDouble/toInt readers) run opaque.
            assert result["opaque_nodes"] == (0 if variant == "python" else DEPTH)
