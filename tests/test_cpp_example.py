"""docs/cpp.md's opening example, as the page shows it: its C++ block built with the
page's own load_inline call, its training loop under the plugin and under stock with
every step's gradient checked against eager's, the flip of its bool, and its Python
block run as written in a process of its own, printing what the page says it prints.

One build serves the fixture and the page's block: the block's ``load_inline`` (no
``build_directory``) builds under ``TORCH_EXTENSIONS_DIR``/its name, where the
fixture's call, with the same name, source and functions, built it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.cpp_extension import load_inline

import ca_dynsaved
from ca_dynsaved import tiers
from cpp_ext import BUILD_DIR
from helpers import Counts, counts, stock_enable

#: Builds a C++ extension (about 30 s) and runs the page's block in a process of its
#: own: the whole suite runs it, the quick loop leaves it out.
pytestmark = pytest.mark.slow

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cpp.md"
#: TORCH_EXTENSIONS_DIR for the page's block, and the fixture's build_directory's parent.
EXTENSIONS_DIR = BUILD_DIR / "cpp_page"
NAME, FUNCTIONS, SOURCE_FILE = "scaled_ext", ["scaled"], "scaled.cpp"
#: The page's block builds exactly what the fixture builds.
LOAD = 'load_inline(name="scaled_ext", cpp_sources=Path("scaled.cpp").read_text(), functions=["scaled"])'
FUNCTION = "torch::autograd::CppNode<ScaledFn>"
STEPS = 6  # the page's loop
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _opening_block(language: str) -> str:
    """The page's one ```language block before its first "## " section."""
    opening = PAGE.read_text().split("\n## ", 1)[0]
    found = [m.group(2) for m in _FENCE.finditer(opening) if m.group(1) == language]
    assert len(found) == 1, f"docs/cpp.md's opening has {len(found)} ```{language} blocks, not 1"
    return found[0]


@pytest.fixture(scope="module")
def page_ext() -> ModuleType:
    """The page's C++ block, built (or reused: load_inline keys a build by its source)
    with the page's call, into the directory the page's block will look in."""
    assert LOAD in _opening_block("python")
    build = EXTENSIONS_DIR / NAME
    os.makedirs(build, exist_ok=True)
    return load_inline(name=NAME, cpp_sources=_opening_block("cpp"), functions=FUNCTIONS, build_directory=str(build))


class Loop:
    """The page's training loop, a step at a time: its weights, optimizer and schedule
    (``k``, ``s`` new every step), the bool given per step; each step's gradient is
    checked against eager's for the same weights and values."""

    def __init__(self, ext: ModuleType) -> None:
        torch.manual_seed(0)
        self.ext, self.step = ext, 0
        self.w = torch.randn(64, requires_grad=True)
        self.opt = torch.optim.SGD([self.w], lr=0.01)

    def run(self, ctx: Callable[[], Any], quadratic: list[bool]) -> None:
        for q in quadratic:
            k, s = self.step + 1, 0.5 + 0.25 * self.step
            loss = self.ext.scaled(self.w, k, s, q).square().mean()
            self.opt.zero_grad()
            with ctx():
                loss.backward()
            with torch._dynamo.compiled_autograd._disable():
                (want,) = torch.autograd.grad(self.ext.scaled(self.w, k, s, q).square().mean(), self.w)
            torch.testing.assert_close(self.w.grad, want)
            self.opt.step()
            self.step += 1


def plugin() -> Any:
    return ca_dynsaved.enable(backend="inductor")


def stock() -> Any:
    return stock_enable("inductor")


@pytest.mark.parametrize("quadratic", [True, False], ids=["quadratic", "linear"])
def test_the_backward_is_the_forward_s_derivative(page_ext, quadratic):
    """The example is correct: its C++ backward is its forward's derivative (the tests
    below compare compiled with eager, which runs the same backward)."""
    x = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: page_ext.scaled(x, 3, 0.75, quadratic), (x,))


def test_plugin_compiles_the_backward_once(page_ext):
    """k and s new every step: one capture, one compile; k and s traced with
    sentinels, each new pair verified; the bool a constant of the graph."""
    Loop(page_ext).run(plugin, [True] * STEPS)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (function,) = ca_dynsaved.report().functions.values()
    assert (function.name, function.handling) == (FUNCTION, "traced-dynamic")
    assert function.reason.startswith("traced with sentinels: ")
    assert function.reason.endswith("; each new value verified; its hashed values (quadratic) constants of this graph")
    assert {key: (k.type, k.handling) for key, k in function.keys.items()} == {
        "k": ("int", "traced-dynamic"), "s": ("float", "traced-dynamic"), "quadratic": ("bool", "stock"),
    }
    assert function.keys["k"].values == list(range(1, STEPS + 1))
    assert counters["ca_dynsaved"]["verify_traces"] == STEPS  # each new (k, s) recorded
    assert counters["ca_dynsaved"]["verify_fallbacks"] == 0


def test_stock_compiles_once_per_value(page_ext):
    """The page's "stock compiled autograd: 6": a compile per step (below the limit)."""
    assert STEPS < torch._dynamo.config.recompile_limit
    Loop(page_ext).run(stock, [True] * STEPS)
    assert counts() == Counts(captures=1, compiles=STEPS, graph_breaks=0)


def test_a_new_bool_runs_opaque_until_its_16th_run(page_ext):
    """quadratic=False after a first capture with True: stock captures and compiles it
    at once; the plugin captures it, runs it opaque and uncompiled, and compiles its own
    traced graph at that capture's run 16. Every step equals eager."""
    assert tiers.SPECIALISE_AFTER_RUNS == 16  # the page's number
    Loop(page_ext).run(stock, [True, True, False])
    assert counts() == Counts(captures=2, compiles=3, graph_breaks=0)
    ca_dynsaved.reset()
    counters.clear()

    loop = Loop(page_ext)
    loop.run(plugin, [True, True, False])
    assert counts() == Counts(captures=2, compiles=1, graph_breaks=0)
    report = ca_dynsaved.report()
    first, later = (capture.nodes[0] for capture in report.captures)
    assert (first.handling, later.handling) == ("traced-dynamic", "opaque")
    assert later.reason.endswith(
        "a combination first met after the function's first capture: "
        "opaque and uncompiled until the capture's run 16, then its own traced graph"
    )
    # the table shows the newest capture's handling
    assert report.functions[FUNCTION].handling == "opaque"
    loop.run(plugin, [False] * 14)  # its runs 2 to 15
    assert counts() == Counts(captures=2, compiles=1, graph_breaks=0)
    loop.run(plugin, [False, True])  # its run 16: its own graph; True: the first graph
    assert counts() == Counts(captures=2, compiles=2, graph_breaks=0)
    assert [c.specialised for c in ca_dynsaved.report().captures] == [0, 16]
    assert counters["ca_dynsaved"]["verify_fallbacks"] == 0


def test_the_cpp_page_example_compiles_once(page_ext, tmp_path):
    """The page's Python block, as written, in a fresh process, next to its C++ block
    saved as scaled.cpp: it reuses the fixture's build and prints the lines the page
    shows (one compile, the report's table)."""
    (tmp_path / SOURCE_FILE).write_text(_opening_block("cpp"))
    script = tmp_path / "train.py"
    script.write_text(_opening_block("python"))
    library = Path(page_ext.__file__)
    built = library.stat().st_mtime_ns
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_DIR)},
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert library.stat().st_mtime_ns == built  # no second build
    printed = done.stdout.splitlines()
    shown = _opening_block("text").splitlines()
    assert shown[0] == "backward compiles: 1"
    missing = [line for line in shown if line not in printed]
    assert not missing, f"the page shows lines the block does not print: {missing}\nit printed:\n{done.stdout}"


def _migration_block() -> str:
    """The page's ```cpp block of "Migrating to toSymInt() and toSymFloat()", after
    the opening block's includes and using-declarations (it replaces ``ScaledFn`` and
    ``scaled`` in scaled.cpp)."""
    section = PAGE.read_text().split("\n## Migrating to toSymInt() and toSymFloat()\n", 1)[1].split("\n## ", 1)[0]
    (block,) = [m.group(2) for m in _FENCE.finditer(section) if m.group(1) == "cpp"]
    opening = _opening_block("cpp")
    return opening[: opening.index("\nstruct ScaledFn")] + "\n" + block


@pytest.fixture(scope="module")
def migrated_ext() -> ModuleType:
    build = EXTENSIONS_DIR / "scaled_sym_ext"
    os.makedirs(build, exist_ok=True)
    return load_inline(name="scaled_sym_ext", cpp_sources=_migration_block(), functions=FUNCTIONS, build_directory=str(build))


def test_the_migrated_example_is_traced_symbolically(migrated_ext):
    """The page's migration: the same loop, one compile under the plugin and no verify
    run; stock still 6; the first quadratic=False step traced and compiled at once."""
    x = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64, requires_grad=True)
    for quadratic in (True, False):
        assert torch.autograd.gradcheck(lambda x: migrated_ext.scaled(x, 3, 0.75, quadratic), (x,))
    Loop(migrated_ext).run(stock, [True] * STEPS)
    assert counts() == Counts(captures=1, compiles=STEPS, graph_breaks=0)
    ca_dynsaved.reset()
    counters.clear()

    loop = Loop(migrated_ext)
    loop.run(plugin, [True] * STEPS)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    (function,) = ca_dynsaved.report().functions.values()
    assert function.handling == "traced-dynamic"
    assert "reads its saved numbers symbolically (toSymInt/toSymFloat): k, s" in function.reason, function.reason
    assert counters["ca_dynsaved"]["verify_traces"] == 0
    loop.run(plugin, [False])
    assert counts() == Counts(captures=2, compiles=2, graph_breaks=0)
    assert [capture.nodes[0].handling for capture in ca_dynsaved.report().captures] == ["traced-dynamic"] * 2
