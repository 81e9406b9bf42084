"""The self-check: does the plugin do on this torch what the suite shows it does?

A release the suite has not run on (a nightly) is refused at import, unless the user
sets ``CA_DYNSAVED_ALLOW_UNTESTED_TORCH=1``. Then the import runs this check first: a
real training loop, four steps whose saved values change every step, through

* the demo's C++ ``torch::autograd::Function`` (a double and an int in
  ``ctx->saved_data``, read with ``toDouble()`` / ``toInt()``): its traceable build
  must be traced (sentinels, each new value verified), its non-traceable build opaque;
* a Python ``autograd.Function`` whose ``ctx.k`` / ``ctx.scale`` only reach tensor
  math: it must be traced, its numbers dynamic from the first compile;

under ``enable(backend="aot_eager")``, and compares with what every tested release
gives: 1 CA capture, 1 Dynamo compile, no graph break, each gradient equal to
eager's, each node handled as above. The plugin switches on only if every one holds;
otherwise it stays off (stock compiled autograd) and the warning names what differed.

``python -m ca_dynsaved selfcheck`` runs the same check on any torch. The C++
extension is built once per torch build into ``~/.cache/ca_dynsaved``, where
the demo builds it too (``demo.default_build_dir``).
"""

from __future__ import annotations

import copy
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._compat import UntestedTorchWarning
from ._compat.capture import counters, no_ca
from ._compat.dynamo import exception_line
from .caches import reset
from .demo import build_extension, default_build_dir
from .enable import enable
from .report import report

#: What every tested release gives for the loop (README, "Supported torch releases").
EXPECTED = {"captures": 1, "compiles": 1, "graph_breaks": 0}
EXPECTED_HANDLING = {
    "torch::autograd::CppNode<GatedAct<true> >": "traced-dynamic",
    "torch::autograd::CppNode<GatedAct<false> >": "opaque",
    "_SelfCheckScale": "traced-dynamic",
}
STEPS = 4


@dataclass
class SelfCheckResult:
    """What the check saw; ``differences`` is empty when it passed."""

    torch_version: str
    counts: dict[str, int] = field(default_factory=dict)
    handling: dict[str, str] = field(default_factory=dict)
    differences: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.differences

    def __str__(self) -> str:
        if self.passed:
            return f"ca_dynsaved self-check passed on torch {self.torch_version}: {self.counts}"
        shown = "; ".join(self.differences[:3])
        more = f" (and {len(self.differences) - 3} more)" if len(self.differences) > 3 else ""
        return f"ca_dynsaved self-check failed on torch {self.torch_version}: {shown}{more}"


class _SelfCheckScale(torch.autograd.Function):
    """y = x * k * scale, ctx numbers used only in tensor math (traced, dynamic)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int, scale: float) -> torch.Tensor:
        ctx.k, ctx.scale = k, scale
        return x * k * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g * ctx.k * ctx.scale, None, None


def run(build_dir: str | os.PathLike[str] | None = None) -> SelfCheckResult:
    """Run the check with the plugin installed. It starts and ends from a fresh
    compile state (``ca_dynsaved.reset()``: ``torch._dynamo.reset()``, the plugin's
    caches and report), so call it before compiling anything; torch's counters and
    the global random state are left as they were."""

    result = SelfCheckResult(torch.__version__)
    saved_counters = copy.deepcopy(dict(counters))
    try:
        ext = build_extension(default_build_dir() if build_dir is None else build_dir)
    except Exception as e:  # noqa: BLE001 - no compiler, a failed build: a failed check
        result.differences.append(f"could not build its C++ extension ({exception_line(e)})")
        return result
    reset()
    counters.clear()
    try:
        with torch.random.fork_rng(devices=[]):
            _loop(ext, result)
    except Exception as e:  # noqa: BLE001 - whatever broke, the plugin must stay off
        tb = traceback.extract_tb(e.__traceback__)[-1]
        result.differences.append(
            f"the loop raised {exception_line(e)} (at {Path(tb.filename).name}:{tb.lineno})"
        )
    finally:
        reset()
        counters.clear()
        counters.update(saved_counters)
    return result


def _loop(ext: Any, result: SelfCheckResult) -> None:

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    params = list(lin.parameters())
    for step in range(STEPS):
        x = torch.randn(4, 8)
        beta, gain, k, scale = 0.5 + 0.25 * step, 1 + step, 2 + step, 0.5 + step / 8

        def loss() -> torch.Tensor:
            h = ext.gated_act_traceable(lin(x), beta, gain)
            h = _SelfCheckScale.apply(h, k, scale)
            return ext.gated_act(h, beta, gain).square().sum()

        with no_ca():
            want = torch.autograd.grad(loss(), params)
        for p in params:
            p.grad = None
        with enable(backend="aot_eager"):
            loss().backward()
        for name, p, w in zip(("weight", "bias"), params, want):
            if p.grad is None:
                result.differences.append(f"step {step}: the {name} gradient is None, eager's is not")
            elif not torch.allclose(p.grad, w, rtol=1e-5, atol=1e-6):
                err = (p.grad - w).abs().max().item()
                result.differences.append(f"step {step}: the {name} gradient differs from eager's (max error {err:.3g})")
    result.counts = {
        "captures": counters["compiled_autograd"]["captures"],
        "compiles": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    for what, want in EXPECTED.items():
        if result.counts[what] != want:
            result.differences.append(f"{what}: {result.counts[what]}, every tested release gives {want}")
    result.handling = {n.name: n.handling for n in report().nodes}
    for name, want in EXPECTED_HANDLING.items():
        got = result.handling.get(name, "not seen")
        if got != want:
            result.differences.append(f"{name} ran {got}, every tested release runs it {want}")


def decide_on_untested_torch() -> None:
    """At import, on a release the suite has not run on that the user allowed: the
    plugin stays on only if the check passes; either way a warning says what it saw."""
    import warnings

    from ._install import switch_off

    result = run()
    if result.passed:
        message = (
            f"ca_dynsaved: torch {torch.__version__} is not a tested release; the self-check "
            f"passed ({result.counts}), so the plugin is on"
        )
    else:
        switch_off(str(result))
        message = f"{result}. The plugin stays off: enable() and the config flag give stock compiled autograd."
    warnings.warn(message, UntestedTorchWarning, stacklevel=3)


def main(argv: list[str] | None = None) -> int:
    """``python -m ca_dynsaved selfcheck``: exit 0 when it passes."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ca_dynsaved selfcheck", description=__doc__)
    parser.add_argument("--build-dir", default=None, help="where the C++ extension is built (reused)")
    args = parser.parse_args(argv)
    result = run(args.build_dir)
    print(result)
    return 0 if result.passed else 1
