"""The README's main job: the demo builds a real extension and prints both columns;
docs/report.md shows what it prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from ca_dynsaved import _docblocks, demo

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "report.md"
COMMAND = demo.MARKDOWN_COMMAND


#: The docs' command runs the demo on inductor (50-90 s here): the whole-suite
#: stages run that; the every-release subset runs the same demo on aot_eager (13 s),
#: whose counts and reasons are the same (the header and the seconds differ, and
#: neither is compared), so every release still checks the README's main job.
BACKENDS = [
    pytest.param("inductor", id="inductor"),
    pytest.param("aot_eager", id="aot_eager", marks=pytest.mark.every_release),
]


@pytest.fixture(scope="module", params=BACKENDS)
def printed(request) -> tuple[int, str]:
    """The demo's exit code and its Markdown, run once per backend as the docs'
    command runs it (default build directory, which the self-check's tests share:
    one build of the demo's extension per torch build)."""
    argv = ["--markdown"] if request.param == "inductor" else ["--markdown", "--backend", request.param]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = demo.main(argv)
    return rc, out.getvalue()


def _row(markdown: str, block: str, label: str) -> tuple[str, str]:
    section = markdown[markdown.index(f"| {block} |"):]
    return re.search(rf"\| {label} \| (\S+) \| (\S+) \|", section).groups()


@pytest.mark.slow  # the demo's run, and its extension's build
def test_demo_prints_stock_vs_plugin(printed):
    rc, out = printed
    assert rc == 0
    # stock: one compile per value until the recompile limit (8) / a split graph.
    assert _row(out, "traceable", "Dynamo compiles") == ("8", "1")
    assert _row(out, "non-traceable", "Dynamo compiles") == ("3", "1")
    assert _row(out, "non-traceable", "graph breaks") == ("2", "0")
    assert _row(out, "traceable", "CA captures") == ("1", "1")
    assert _row(out, "traceable", "grads == eager") == ("yes", "yes")
    assert _row(out, "non-traceable", "grads == eager") == ("yes", "yes")


def _without_timings(markdown: str) -> str:
    """Counts, handling and reasons: the header (torch build, date) and seconds dropped."""
    lines = markdown.strip().splitlines()[1:]
    return "\n".join(re.sub(r"\| total seconds \|.*", "| total seconds |", line) for line in lines)


@pytest.mark.slow
def test_docs_show_what_the_demo_prints(printed):
    committed = _docblocks.read(DOCS_PAGE, COMMAND)
    assert _without_timings(committed) == _without_timings(printed[1]), (
        f"docs/report.md's demo output is stale: run `{COMMAND} --into docs/report.md`"
    )


@pytest.mark.every_release
def test_plain_table_has_the_same_rows():
    results = {
        name: {mode: demo.Column(compiles=8 if mode == "stock" else 1, captures=1, graph_breaks=0, seconds=1.5, grads_equal=True)
               for mode in ("stock", "ca_dynsaved")}
        for name in ("traceable", "non-traceable")
    }
    table = demo.format_table(results)
    assert re.search(r"traceable\s+Dynamo compiles\s+8\s+1", table)
    assert re.search(r"total seconds\s+1.50\s+1.50", table)
    markdown = demo.format_markdown(results, "header", "the report")
    assert _row(markdown, "traceable", "Dynamo compiles") == ("8", "1")
    assert markdown.rstrip().endswith("the report\n```")


@pytest.mark.every_release
@pytest.mark.slow  # a fresh process
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
