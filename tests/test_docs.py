"""Docs that cannot go stale: the README stays short, every link resolves, every Python
block of README.md and docs/ runs as written (or says why it cannot run here), and the
tables a project command generates are what it prints for the committed results.

The demo's block (docs/report.md) is checked by tests/test_demo.py, which runs the demo.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ca_dynsaved
from ca_dynsaved import _docblocks, counting, demo

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
sys.path.insert(0, str(ROOT / "benchmarks"))

import report as bench_report  # noqa: E402  (benchmarks/report.py)

#: The pages the README promises, each linked from it.
TOPICS = (
    "usage.md", "how-it-works.md", "python.md", "cpp.md", "report.md",
    "benchmarks.md", "gpu.md", "distributed.md", "compatibility.md", "guarantees.md",
    "contributing.md", "checkpointing.md", "troubleshooting.md",
)
#: Commands whose blocks this file checks; the demo's is test_demo's.
CHECKED_HERE = {
    bench_report.COMMAND, bench_report.SUMMARY_COMMAND, bench_report.REAL_MODEL_COMMAND, bench_report.DOMINANCE_COMMAND,
    counting.MARKDOWN_COMMAND,
}
DEMO_COMMAND = demo.MARKDOWN_COMMAND
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not run: (.*?) -->\s*$")


def _python_blocks() -> list[tuple[Path, int, str, str | None]]:
    """(page, line, code, why it is not run or None) of every ```python block."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for m in _FENCE.finditer(text):
            if m.group(1) != "python":
                continue
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = _NOT_RUN.search(before)
            blocks.append((page, text.count("\n", 0, m.start()) + 1, m.group(2), skip and skip.group(1).strip()))
    return blocks


BLOCKS = _python_blocks()


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 12_000, f"README.md is {len(text)} characters (at most 12,000: the depth goes in docs/)"
    # the two set-up commands come first, pinned
    first = text.split("\n## ", 1)[0]
    assert "pip install torch==2.13.0 -e . && .venv/bin/python -m ca_dynsaved demo" in first
    assert (
        "pip install torch==2.13.0 torchvision==0.28.0 -e '.[test]' -c .ci/constraints.txt "
        "&& .venv/bin/python -m pytest tests benchmarks -q -n 2"
    ) in first
    for topic in TOPICS:
        assert (ROOT / "docs" / topic).is_file(), topic
        assert f"(docs/{topic})" in text, f"README.md does not link docs/{topic}"


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    for page in DOCS:
        assert page.name == "README.md" or f"]({page.name})" in index, f"docs/README.md does not list {page.name}"


def test_readme_test_command_is_what_ci_runs():
    """CI runs "exactly the test command the README gives" (.ci/run's FULL), on the
    release the README installs, with what it pins."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"-m pytest ([^`]+)`", readme).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'FULL="{command}"' in ci
    pins = re.search(r"pip install torch==(\S+) torchvision==(\S+) -e '\.\[test\]' -c (\S+) ", readme).groups()
    assert f'"{pins[0]} python3 .venv pip FULL {pins[1]}"' in ci
    # the exact versions of the test extra: the same constraints file, for every stage
    assert ci.count(f"-e '.[test]' -c {pins[2]}") == 2  # pip's install and uv's


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    text = _FENCE.sub("", page.read_text())
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if re.match(r"https?://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link} (no {path})"
        if anchor:
            assert anchor in _anchors(path), f"{page.name}: {link} (no heading #{anchor} in {path.name})"


def test_every_page_opens_with_what_a_user_does():
    for page in DOCS:
        opening = page.read_text().split("\n## ", 1)[0]
        assert opening.startswith("# "), page.name
        assert "What you" in opening, f"{page.name} should open with what a user does and sees"


@pytest.mark.slow  # a fresh process per block
@pytest.mark.parametrize(
    "page,line,code,not_run", BLOCKS, ids=[f"{p.name}:{line}" for p, line, _, _ in BLOCKS]
)
def test_python_block_runs_as_written(page, line, code, not_run, tmp_path):
    if not_run is not None:
        # the page says why; an empty reason is not one
        assert len(not_run) > 20, f"{page.name}:{line}: 'not run' needs its reason"
        compile(code, f"{page.name}:{line}", "exec")  # still valid Python
        return
    script = tmp_path / "block.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{page.name}:{line} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def test_unrun_blocks_name_the_test_that_runs_them():
    """A block is left unrun only where it needs what one process here lacks (ranks), and
    its reason names the test that runs the same code: that test must exist."""
    unrun = [(p, line, why) for p, line, _, why in BLOCKS if why is not None]
    assert len(unrun) < len(BLOCKS) / 2
    for page, line, why in unrun:
        named = re.search(r"(tests/\w+\.py)(?:::(\w+))?", why)
        assert named, f"{page.name}:{line}: the reason names no test: {why!r}"
        source = (ROOT / named.group(1)).read_text()
        assert named.group(2) is None or f"def {named.group(2)}(" in source, f"{page.name}:{line}: {why!r}"


@pytest.mark.every_release  # _docblocks' reader, on every release
def test_generated_blocks_are_what_their_commands_print():
    data = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    real = json.loads(bench_report.REAL_MODEL_RESULTS.read_text())
    expected = {
        bench_report.COMMAND: bench_report.table(data),
        bench_report.SUMMARY_COMMAND: bench_report.summary(data),
        bench_report.REAL_MODEL_COMMAND: bench_report.real_model_table(real),
        bench_report.DOMINANCE_COMMAND: bench_report.dominance_table(json.loads(bench_report.DOMINANCE_RESULTS.read_text())),
        counting.MARKDOWN_COMMAND: counting.markdown(),
    }
    seen = []
    for page in PAGES:
        for command in _docblocks.commands(page.read_text()):
            assert command in CHECKED_HERE | {DEMO_COMMAND}, f"{page.name}: no test checks {command!r}"
            seen.append(command)
            if command in expected:
                assert _docblocks.read(page, command) == expected[command].rstrip("\n") + "\n", (
                    f"{page.name}: the block of {command!r} is stale: run `python benchmarks/report.py`"
                )
    assert sorted(seen) == sorted([*expected, DEMO_COMMAND])


def test_benchmark_report_draws_its_plot(tmp_path):
    data = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    out = tmp_path / "plot.png"
    assert bench_report.plot(data, out) is True  # matplotlib is in the test extra
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert bench_report.PLOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({bench_report.PLOT.name})" in (ROOT / "docs" / "benchmarks.md").read_text()


# A commit hash: 7 to 40 hex digits with at least one letter and one digit (a plain
# number such as 1000000 is none); an issue or pull request by its number; a run letter.
_HISTORY = re.compile(
    r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
    r"|\b(?:issue|issues|PR|pull request)s? #?\d+|(?<![\w&])#\d+\b|\bruns [A-Z]\s*[–-]\s*[A-Z]\b",
    re.I,
)


@pytest.mark.parametrize("page", [*PAGES, ROOT / "CHANGELOG.md"], ids=lambda p: p.name)
def test_docs_state_facts_not_our_history(page):
    """The docs say what is, not which issue or commit made it so: no issue numbers,
    commit hashes or run letters (CHANGELOG.md says what changed, release by release)."""
    text = page.read_text()
    found = [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in _HISTORY.finditer(text)]
    assert not found, f"{page.name} names our history (line, text): {found}"


def _results(expr: ast.AST, where: str) -> list[str]:
    """The names an argument of ``count()`` can be: a string, or a conditional's branches."""
    if isinstance(expr, ast.IfExp):
        return _results(expr.body, where) + _results(expr.orelse, where)
    assert isinstance(expr, ast.Constant) and isinstance(expr.value, str), f"{where}: count({ast.unparse(expr)})"
    return [expr.value]


def _counted_names() -> tuple[set[str], list[str]]:
    """The string constants every ``count(...)`` call of the package can pass (both
    branches of a conditional name included), and the places that write torch's
    ``counters["ca_dynsaved"]`` other than ``counting.count``."""
    names: set[str] = set()
    direct = []
    for path in sorted((ROOT / "src" / "ca_dynsaved").rglob("*.py")):
        tree = ast.parse(path.read_text())
        assigned: dict[str, ast.AST] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                assigned[node.targets[0].id] = node.value
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "count":
                arg = node.args[0]
                if isinstance(arg, ast.Name):  # count(what), what = "a" if ... else "b"
                    arg = assigned[arg.id]
                names.update(_results(arg, f"{path.name}:{node.lineno}"))
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and node.slice.value == "ca_dynsaved"
                and (getattr(node.value, "id", None) or getattr(node.value, "attr", None)) == "counters"
                and path.name != "counting.py"
            ):
                direct.append(f"{path.name}:{node.lineno}")
    return names, direct


def test_every_counter_the_code_bumps_is_documented():
    """docs/report.md's counter list is generated from ``counting.COUNTERS`` (the
    generated-blocks test compares it); here: every ``count()`` names an entry, every
    entry is counted somewhere, and nothing bumps torch's counters past ``count()``."""
    names, direct = _counted_names()
    assert not direct, f"counters['ca_dynsaved'] written outside counting.count: {direct}"
    assert names - set(counting.COUNTERS) == set(), "counted but not in COUNTERS"
    assert set(counting.COUNTERS) - names == set(), "in COUNTERS (and documented) but never counted"
    with pytest.raises(KeyError, match="not_a_counter"):
        counting.count("not_a_counter")


def test_every_public_name_has_an_entry():
    """Each name ``from ca_dynsaved import *`` gives has a row in usage.md's table."""
    usage = (ROOT / "docs" / "usage.md").read_text()
    table = usage.split("\n## Every public name\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    assert set(ca_dynsaved.__all__) - named == set(), "public names without an entry in docs/usage.md"
    assert named - set(ca_dynsaved.__all__) == set(), "entries in docs/usage.md that are not public names"


def test_the_changelog_opens_with_this_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\d+\.\d+\.\d+) \(\d{4}-\d{2}-\d{2}\)$", changelog, re.M)
    assert releases and releases[0] == ca_dynsaved.__version__, (releases[:1], ca_dynsaved.__version__)
    assert releases == sorted(releases, key=lambda v: tuple(map(int, v.split("."))), reverse=True)


def test_a_negative_difference_is_never_printed_as_a_cost():
    assert bench_report.cost(-179.4, " µs") == "within noise (< 0)"
    assert bench_report.cost(126.2, " µs") == "126 µs"
