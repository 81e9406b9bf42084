"""The README's main job: the demo builds a real extension and prints both columns."""

from __future__ import annotations

import re

import cpp_ext
import pytest
from ca_dynsaved import demo

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release


def test_demo_prints_stock_vs_plugin(capsys):
    rc = demo.main(
        ["--backend", "aot_eager", "--steps", "10", "--build-dir", str(cpp_ext.BUILD_DIR / "demo")]
    )
    out = capsys.readouterr().out
    assert rc == 0

    def row(block: str, label: str) -> list[str]:
        section = out.split(block, 1)[1]
        return re.search(rf"{label}\s+(\S+)\s+(\S+)", section).groups()

    # stock: one compile per value until the recompile limit (8) / a split graph.
    assert row("traceable", "Dynamo compiles") == ("8", "1")
    assert row("non-traceable", "Dynamo compiles") == ("3", "1")
    assert row("non-traceable", "graph breaks") == ("2", "0")
    assert row("traceable", "CA captures") == ("1", "1")
    assert row("traceable", "grads == eager") == ("yes", "yes")
    assert row("non-traceable", "grads == eager") == ("yes", "yes")


def test_first_run_prints_no_numpy_warning():
    """torch.compile imports torch._subclasses.functional_tensor, which without numpy
    warns "Failed to initialize NumPy" on every first compile: the package requires
    numpy, and a fresh process that compiles through the plugin prints no such line."""
    import subprocess
    import sys
    from importlib.metadata import requires

    assert any(r.split(";")[0].strip() == "numpy" for r in requires("ca_dynsaved") or [])
    script = (
        "import torch, ca_dynsaved\n"
        "x = torch.ones(4, requires_grad=True)\n"
        "with ca_dynsaved.enable(backend='aot_eager'):\n"
        "    (x * 2).sum().backward()\n"
        "assert x.grad.eq(2).all()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "NumPy" not in done.stderr
