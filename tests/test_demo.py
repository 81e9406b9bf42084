"""The README's main job: the demo builds a real extension and prints both columns."""

from __future__ import annotations

import re

import cpp_ext
from ca_dynsaved import demo


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
