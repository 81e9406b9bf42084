"""A real model with no custom function: what the plugin costs where it has nothing
to do. A whole training step (forward + backward) of a tiny transformers decoder
(``LlamaForCausalLM``, one layer, hidden 64, a batch of 4 sequences of 64 tokens),
eager, stock compiled autograd and the plugin, interleaved in one run
(``harness.measure``: the steady step is the smallest of ``PASSES`` passes' medians).

Nothing of the plugin runs for this model's nodes (no custom function: every node is
stock's); what it still adds per backward is its context (the engine swap), the
payoff gate and the final callbacks' frame, and its copy of stock's runtime wrapper
makes the graph's size tensors once instead of at every run (docs/benchmarks.md, "A
model with no custom function", lists each with its cost). The goal: the plugin's
steady step at most 1.02 x stock's.

``pytest benchmarks/test_real_model.py --benchmark-only`` writes
``results/real_model.json``; ``python benchmarks/report.py`` makes its table. The
quick mode (the suite) checks the counts against that file: one capture and one
compile each, no break.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import measure
from report import REAL_MODEL_RESULTS as REAL_RESULTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "realworld"))
from torchvision_shim import import_torchvision  # noqa: E402

#: A benchmark's quick mode (counts, not timings): the quick loop (docs/contributing.md) leaves it out.
pytestmark = pytest.mark.slow

CONFIGS = ["eager", "stock_constant", "plugin_varying"]
#: The decoder's size and its batch.
LAYERS, HIDDEN, VOCAB, BATCH, TOKENS = 1, 64, 256, 4, 64


def _decoder() -> torch.nn.Module:
    import_torchvision()  # transformers imports it where installed
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS, use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).train()


def test_real_model(benchmark, full_run):
    model = _decoder()

    def loss(step: int, varying: bool) -> torch.Tensor:
        ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(step))
        return model(input_ids=ids, labels=ids).loss

    results = measure(
        benchmark, loss, list(model.parameters()), CONFIGS, full_run,
        model="llama", variant="none", results_file=REAL_RESULTS,
    )
    for config, result in results.items():
        # Counts, not timings: stock and the plugin capture and compile once, no break.
        expected = (0, 0) if config == "eager" else (1, 1)
        assert (result["captures"], result["compiles"], result["breaks"], result["opaque_nodes"]) == (*expected, 0, 0), config
    if full_run:
        steady = {c: r["steady_us"] for c, r in results.items()}
        REAL_RESULTS.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "model": f"LlamaForCausalLM, {LAYERS} layer, hidden {HIDDEN}, batch {BATCH} x {TOKENS} tokens",
            "plugin_over_stock": steady["plugin_varying"] / steady["stock_constant"],
            "results": [{k: v for k, v in r.items() if k != "step_s"} for r in results.values()],
        }, indent=1))
