"""transformers: tiny causal LMs (Llama, GPT-2) trained with and without activation
checkpointing, the sequence length new at each of the first steps.

No custom function: stock and the plugin compile the same backward (the static
graph, then the dynamic one), which shows the plugin adds nothing to a model it has
nothing to do for. With ``gradient_checkpointing_enable()`` stock CA breaks its
graph at every unpack of a checkpointed activation (``use_reentrant=False``) or at
every layer (``True``: torch's ``CheckpointFunction``), and compiles each break's
resume function again; the plugin keeps one graph (``checkpoint.py``), and the layers
are recomputed during backward exactly as often as in eager.

Stock's non-reentrant runs are the slow part (each break re-traces the rest of the
graph: about 3 minutes for one Llama layer here, and the first backward of a 2-layer
one had not finished after 11), so the models have one layer and run three steps:
the third is the first whose sequence length the graph has seen as dynamic.
"""

from __future__ import annotations

import os

import pytest

from helpers import Counts, this_release
from real_models import CHECKPOINTING, causal_lm, compare_modes

#: A real library's training runs: the quick loop (docs/contributing.md) leaves them out.
pytestmark = pytest.mark.slow

STEPS = 3
#: Stock runs that cost minutes each (every unpack a break whose resume function
#: re-traces the rest of the graph; the non-reentrant Llama's about 4 minutes of CPU
#: in CI's 2.13 stage): their figures below were measured with this test under
#: ``CA_DYNSAVED_SLOW_BASELINES=1``, which runs them again; without it the test runs
#: eager and the plugin. test_checkpoint.py asserts stock's breaks at every unpack on
#: every release.
SLOW_BASELINES = bool(os.environ.get("CA_DYNSAVED_SLOW_BASELINES"))
MEASURED_ONLY = {("llama", "non-reentrant"), ("gpt2", "non-reentrant"), ("config", "non-reentrant")}


def _modes(case: tuple[str, str], stock: str, plugin: str) -> tuple[str, ...]:
    return (stock, plugin) if SLOW_BASELINES or case not in MEASURED_ONLY else (plugin,)

#: (arch, checkpointing) -> stock counts, per release (measured; aot_eager, 3 steps).
#: The reentrant rows' 7th compile is the tests' own forward counter: the
#: recomputation inside ``CheckpointFunction.backward`` (a frame Dynamo skips) calls
#: the MLP's pre-hook, a frame of its own that Dynamo compiles; the plugin runs that
#: backward opaque, outside Dynamo.
#: transformers is pinned in the test extra; the real models run where the whole
#: suite's real libraries do (CI: torch 2.13).
STOCK = {
    ("llama", "none"): {"2.13": Counts(1, 2, 0)},
    ("llama", "non-reentrant"): {"2.13": Counts(1, 46, 69)},
    ("llama", "reentrant"): {"2.13": Counts(1, 7, 4)},
    ("gpt2", "none"): {"2.13": Counts(1, 2, 0)},
    ("gpt2", "non-reentrant"): {"2.13": Counts(1, 22, 50)},
    ("gpt2", "reentrant"): {"2.13": Counts(1, 7, 4)},
}


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_causal_lm(arch: str, checkpointing: str) -> None:
    """Every step's gradients equal eager's under stock and the plugin, and the layers
    run (forward and recomputation) as often as in eager; the plugin compiles the
    static graph and the dynamic one with no break, never more than stock."""
    model = causal_lm(arch, checkpointing)
    found = compare_modes(model, STEPS, _modes((arch, checkpointing), "stock", "plugin"))
    stock = this_release(STOCK[arch, checkpointing])
    if "stock" in found:
        assert found["stock"] == stock
    assert found["plugin"] == Counts(captures=1, compiles=2, graph_breaks=0)
    assert found["plugin"].compiles <= stock.compiles and found["plugin"].graph_breaks <= stock.graph_breaks
    # eager's layers: once a step, once more in backward where checkpointed
    assert found["eager forwards"] == STEPS * len(model.blocks) * (1 if checkpointing == "none" else 2)


#: checkpointing -> (stock's counts per release, the plugin's) on the config path, the
#: step compiled (measured; aot_eager, 3 steps). A new sequence length is a new CA
#: capture there, and the backward() in the step a break of the forward's frame. With
#: checkpointing Dynamo cannot take transformers' checkpointed layer into the forward
#: graph (its forward mutates state outside the region: "HOP: Unsafe side effect"), so
#: it breaks the forward there and runs checkpoint eagerly: the backward unpacks
#: through checkpoint's hook, and stock breaks the CA graph at every unpack too.
CONFIG = {
    "none": ({"2.13": Counts(3, 6, 2)}, Counts(3, 6, 2)),
    "non-reentrant": ({"2.13": Counts(3, 80, 132)}, Counts(3, 11, 15)),
}


@pytest.mark.parametrize("checkpointing", list(CONFIG))
def test_config_path_with_a_compiled_forward(checkpointing: str) -> None:
    """The step under ``torch.compile`` (Dynamo compiles the forward, and the backward
    runs under CA from it), eager's gradients: the plugin's counts are stock's without
    its breaks in the backward (the forward's breaks are Dynamo's, the same)."""
    model = causal_lm("llama", checkpointing)
    found = compare_modes(model, STEPS, _modes(("config", checkpointing), "config_stock", "config"))
    stock, plugin = CONFIG[checkpointing]
    if "config_stock" in found:
        assert found["config_stock"] == this_release(stock)
    assert found["config"] == plugin
