"""pytorch_wavelets 1.3.0 (PyWavelets 1.9.0): a 2D wavelet transform and its inverse.

Its ``AFB2D`` / ``SFB2D`` functions save the padding mode (a str) and a size on the
ctx; no int or float. With ``mode="symmetric"`` (or ``"zero"``) ``SFB2D``'s backward
calls ``pywt.dwt_coeff_len``, which Dynamo refuses (``_Modes.from_object``), and
pads with numpy index arrays: stock CA breaks the graph at every such node, and with
the image size changing every step each break recompiles. The plugin runs that
backward opaque (``graphbreak.py``): no break, and the compiles of a transform whose
backwards all trace (``mode="periodization"``, the same for stock and the plugin).

Quirk: the package imports ``pkg_resources`` at import (``dtcwt/coeffs.py``), which
setuptools 81 removed: the test extra pins setuptools 80.9.0, whose import warns.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import Counts, this_release
import ca_dynsaved
from loops import assert_steps_equal, compare, node, train

#: A real library's training runs: the quick loop (docs/contributing.md) leaves them out.
pytestmark = pytest.mark.slow

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "pkg_resources is deprecated", UserWarning)
    from pytorch_wavelets import DWTForward, DWTInverse

STEPS = 8


def _loop(mode: str):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 3, 3, padding=1)
    gain = torch.nn.Parameter(torch.ones(3))
    forward, inverse = DWTForward(J=1, wave="db2", mode=mode), DWTInverse(wave="db2", mode=mode)

    def step(i: int) -> torch.Tensor:
        size = 16 + 2 * (i % 4)  # a new image size each step, four of them
        x = torch.randn(2, 3, size, size + 4, generator=torch.Generator().manual_seed(i))
        low, highs = forward(conv(x))
        y = inverse((low * gain[:, None, None], [h * 0.5 for h in highs]))
        return (y**2).mean()

    return step, [conv.weight, conv.bias, gain]


#: mode -> stock counts, per release (measured)
STOCK = {
    "symmetric": {"2.11": Counts(1, 29, 22), "2.13": Counts(1, 29, 22), "2.15": Counts(1, 29, 22)},
    "periodization": {"2.11": Counts(1, 2, 0), "2.13": Counts(1, 2, 0), "2.15": Counts(1, 2, 0)},
}


@pytest.mark.parametrize("mode", ["symmetric", "periodization"])
def test_wavelet_round_trip(mode: str) -> None:
    step, params = _loop(mode)
    found = compare(step, params, STEPS)
    assert found["stock"] == this_release(STOCK[mode])
    # Both modes: the compiles of the all-traceable transform, no graph break.
    assert found["plugin"] == this_release(STOCK["periodization"])
    assert found["plugin"].graph_breaks == 0
    analysis, synthesis = node("AFB2D"), node("SFB2D")
    # periodization: SFB2D reads its ctx.mode (a str) and nothing else of ctx: stock's
    # trace, its combinations past the cap on the capture's opaque graph
    assert (analysis.handling, synthesis.handling) == ("stock", "opaque" if mode == "symmetric" else "traced-dynamic")
    if mode == "periodization":
        assert synthesis.reason == (
            "no int or float ctx attribute; ctx.mode guarded by Dynamo as stock guards it (a compile per distinct value)"
        )
    if mode == "symmetric":
        assert synthesis.reason.startswith("backward not traceable by Dynamo: Unsupported method call")
        assert "pywt/_dwt.py" in synthesis.reason and "in dwt_coeff_len" in synthesis.reason


def test_sizes_that_keep_changing_keep_the_opaque_backward() -> None:
    """Past its capture's run 16 the opaque SFB2D stays opaque: the image size changes
    every step, and stock's graph-broken pieces would recompile for each new one (the
    plugin switches to stock's graph only once sizes hold: ways.tiered.wrap). Two
    compiles in 24 steps, no break, every step's gradients eager's."""
    step, params = _loop("symmetric")
    _, want = train(step, params, "eager", 24)
    found, got = train(step, params, "plugin", 24)
    assert_steps_equal(got, want)
    assert found == this_release(STOCK["periodization"])
    assert [c.specialised for c in ca_dynsaved.report().captures] == [0]
