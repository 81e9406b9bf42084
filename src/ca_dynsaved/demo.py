"""The demo: a real C++ extension, stock compiled autograd vs ca_dynsaved.

A small MLP whose activation is a C++ ``torch::autograd::Function`` that saves a
double (``beta``, annealed every step) and an int (``gain``, cycling) in
``ctx->saved_data`` and reads them back with ``toDouble()`` / ``toInt()``. The same
training loop runs under stock compiled autograd and under the plugin; the table
shows torch's own counters for each.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from ._compat.capture import counters, no_ca, stock_ca
from . import _docblocks
from .enable import enable
from .report import report, reset_report

#: The command the docs name for the Markdown this prints (``--into`` finds its block by it).
MARKDOWN_COMMAND = "python -m ca_dynsaved demo --markdown"

#: What the C++ extensions here (the demo's, the tests', the benchmarks') include in
#: place of ``<torch/extension.h>``, which load_inline adds unless told not to: the
#: autograd Function, ATen's operators, torch's factories and pybind11's casters.
#: extension.h also pulls the C++ API these sources never use (nn, optim, data, jit),
#: which lengthens every build (docs/benchmarks.md, "Component costs").
EXTENSION_HEADERS = r"""
#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/generated/variable_factories.h>
#include <torch/csrc/utils/pybind.h>
"""

CPP_SOURCE = r"""
using namespace torch::autograd;

// y = gain * x * sigmoid(beta * x)   (a gated activation with a schedule)
template <bool TRACE>
struct GatedAct : public Function<GatedAct<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, double beta, int64_t gain) {
    ctx->saved_data["beta"] = beta;
    ctx->saved_data["gain"] = gain;
    ctx->save_for_backward({x});
    return x * at::sigmoid(x * beta) * static_cast<double>(gain);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    double beta = ctx->saved_data["beta"].toDouble();
    int64_t gain = ctx->saved_data["gain"].toInt();
    auto x = ctx->get_saved_variables()[0];
    auto s = at::sigmoid(x * beta);
    auto dx = (s + x * beta * s * (1 - s)) * static_cast<double>(gain);
    return {grad[0] * dx, at::Tensor(), at::Tensor()};
  }
};

at::Tensor gated_act_traceable(at::Tensor x, double beta, int64_t gain) {
  return GatedAct<true>::apply(x, beta, gain);
}
at::Tensor gated_act(at::Tensor x, double beta, int64_t gain) {
  return GatedAct<false>::apply(x, beta, gain);
}
"""


def default_build_dir() -> Path:
    """Where the demo and the self-check build this extension, once per torch build
    (its commit and CUDA version; a nightly's version string names no build): one
    build serves both commands."""
    build = f"{torch.version.git_version[:12]}-{torch.version.cuda or 'cpu'}"
    return Path.home() / ".cache" / "ca_dynsaved" / f"demo_ext-{build}"


def load_cpp(
    name: str, source: str, functions: list[str], build_dir: str | os.PathLike[str], verbose: bool = False
) -> ModuleType:
    """Build (or reuse: load_inline keys a build by its source) and import an extension
    whose ``source`` needs :data:`EXTENSION_HEADERS` and no more."""
    from torch.utils.cpp_extension import load_inline

    os.makedirs(build_dir, exist_ok=True)
    return load_inline(
        name=name,
        cpp_sources=EXTENSION_HEADERS + source,
        functions=functions,
        build_directory=str(build_dir),
        verbose=verbose,
        no_implicit_headers=True,
    )


def build_extension(build_dir: str | os.PathLike[str], verbose: bool = False) -> ModuleType:
    return load_cpp("ca_dynsaved_demo_ext", CPP_SOURCE, ["gated_act_traceable", "gated_act"], build_dir, verbose)


@dataclass
class Column:
    compiles: int
    captures: int
    graph_breaks: int
    seconds: float
    grads_equal: bool


def _train(act: Callable[..., torch.Tensor], steps: int, ctx: Callable[[], object]) -> Column:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 1)
    grads_equal = True
    start = time.perf_counter()
    for step in range(steps):
        x = torch.randn(16, 32)
        beta, gain = 1.0 + 0.1 * step, 1 + step % 3  # change every step

        def loss() -> torch.Tensor:
            return lin2(act(lin1(x), beta, gain)).square().mean()

        for p in (*lin1.parameters(), *lin2.parameters()):
            p.grad = None
        with ctx():
            loss().backward()
        got = [p.grad.clone() for p in (*lin1.parameters(), *lin2.parameters())]
        with no_ca():
            want = torch.autograd.grad(loss(), [*lin1.parameters(), *lin2.parameters()])
        grads_equal &= all(torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want))
    seconds = time.perf_counter() - start
    return Column(
        compiles=counters["stats"]["unique_graphs"],
        captures=counters["compiled_autograd"]["captures"],
        graph_breaks=sum(counters["graph_break"].values()),
        seconds=seconds,
        grads_equal=grads_equal,
    )


def run_demo(backend: str, steps: int, build_dir: str | os.PathLike[str]) -> dict[str, dict[str, Column]]:
    """Run every (function, mode) pair; return the columns, keyed by function then mode."""
    ext = build_extension(build_dir)
    reset_report()

    def stock() -> object:
        return stock_ca(lambda gm: torch.compile(gm, backend=backend))

    def plugin() -> object:
        return enable(backend=backend)

    results = {}
    for name, fn in (("traceable", ext.gated_act_traceable), ("non-traceable", ext.gated_act)):
        results[name] = {"stock": _train(fn, steps, stock), "ca_dynsaved": _train(fn, steps, plugin)}
    torch._dynamo.reset()
    return results


#: The table's rows: a label and how a column shows it.
_ROWS: tuple[tuple[str, Callable[[Column], str]], ...] = (
    ("Dynamo compiles", lambda c: str(c.compiles)),
    ("CA captures", lambda c: str(c.captures)),
    ("graph breaks", lambda c: str(c.graph_breaks)),
    ("total seconds", lambda c: f"{c.seconds:.2f}"),
    ("grads == eager", lambda c: "yes" if c.grads_equal else "NO"),
)


def format_table(results: dict[str, dict[str, Column]]) -> str:
    header = f"{'C++ function':<15}{'':<18}{'stock':>10}{'ca_dynsaved':>13}"
    lines = [header, "-" * len(header)]
    for name, cols in results.items():
        for i, (label, cell) in enumerate(_ROWS):
            lines.append(
                f"{name if i == 0 else '':<15}{label:<18}"
                f"{cell(cols['stock']):>10}{cell(cols['ca_dynsaved']):>13}"
            )
        lines.append("")
    return "\n".join(lines)


def format_markdown(results: dict[str, dict[str, Column]], header: str, report_text: str) -> str:
    """The same table as ``format_table`` and the report, as Markdown: what the docs
    show (``docs/report.md``) is this output, and ``tests/test_demo.py`` checks that
    its counts, handling and reasons are what the demo prints now."""
    lines = [
        f"`{MARKDOWN_COMMAND}` ({header}):",
        "",
        "| C++ function | | stock | ca_dynsaved |",
        "|---|---|---|---|",
    ]
    for name, cols in results.items():
        for i, (label, cell) in enumerate(_ROWS):
            lines.append(f"| {name if i == 0 else ''} | {label} | {cell(cols['stock'])} | {cell(cols['ca_dynsaved'])} |")
    lines += ["", "`print(ca_dynsaved.report())` after the plugin's runs:", "", "```text", report_text.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ca_dynsaved demo", description=__doc__)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--build-dir",
        default=str(default_build_dir()),
        help="where the C++ extension is built (reused when unchanged)",
    )
    parser.add_argument(
        "--markdown", action="store_true",
        help="print the table and the report as Markdown (what docs/report.md shows)",
    )
    parser.add_argument(
        "--into", metavar="PAGE",
        help="with --markdown: also rewrite PAGE's block generated by this command (docs/report.md)",
    )
    args = parser.parse_args(argv)
    header = (f"torch {torch.__version__}, backend={args.backend}, {args.steps} steps; "
              "saved double and int change every step")
    if not args.markdown:
        print(header + "\n", flush=True)
    results = run_demo(args.backend, args.steps, args.build_dir)
    if args.markdown:
        markdown = format_markdown(results, header, str(report()))
        print(markdown, end="")
        if args.into:
            _docblocks.write(args.into, MARKDOWN_COMMAND, markdown)
    else:
        print(format_table(results))
        print("ca_dynsaved.report() of the plugin runs:\n")
        print(report())
    ok = all(c.grads_equal for cols in results.values() for c in cols.values())
    return 0 if ok else 1
