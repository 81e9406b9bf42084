"""``python -m ca_dynsaved run [--backend B] [--compare] script.py [args]``.

Runs an unmodified training script with compiled autograd and the plugin on:
the config flags are set (so frames the script ``torch.compile``s use the plugin)
and a plugin context encloses the script (so its plain ``.backward()`` calls do
too). The report prints at exit. ``--compare`` runs the script twice, each in a
fresh process (plugin, then stock compiled autograd), and prints both columns.
The script's own output and exit code are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

PLUGIN, STOCK = "plugin", "stock"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ca_dynsaved run", description=__doc__)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--compare", action="store_true", help="also run with stock compiled autograd")
    parser.add_argument("--mode", choices=(PLUGIN, STOCK), default=PLUGIN, help=argparse.SUPPRESS)
    parser.add_argument("--summary", help=argparse.SUPPRESS)  # where a child writes its numbers
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def _ca_context(mode: str, backend: str) -> Any:
    import torch

    import ca_dynsaved
    from ca_dynsaved._compat.capture import stock_ca

    flags = {"compiled_autograd": True, ca_dynsaved.CONFIG_FLAG: mode == PLUGIN}
    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(**flags))
    if mode == PLUGIN:
        stack.enter_context(ca_dynsaved.enable(backend=backend))
    else:
        stack.enter_context(stock_ca(lambda gm: torch.compile(gm, backend=backend)))
    return stack


def _run_script(script: str, args: list[str], mode: str, backend: str) -> tuple[int, float]:
    """Run ``script`` as ``__main__``; return its exit code and wall seconds."""
    sys.argv = [script, *args]
    start = time.perf_counter()
    code = 0
    try:
        with _ca_context(mode, backend):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    return code, time.perf_counter() - start


def _numbers(seconds: float, code: int) -> dict[str, Any]:
    from ca_dynsaved._compat.capture import counters

    return {
        "Dynamo compiles": counters["stats"]["unique_graphs"],
        "CA captures": counters["compiled_autograd"]["captures"],
        "graph breaks": sum(counters["graph_break"].values()),
        "wall seconds": round(seconds, 2),
        "exit code": code,
    }


def _single(opts: argparse.Namespace) -> int:
    import ca_dynsaved

    code, seconds = _run_script(opts.script, opts.args, opts.mode, opts.backend)
    numbers = _numbers(seconds, code)
    if opts.summary:
        with open(opts.summary, "w") as f:
            json.dump(numbers, f)
    print(f"\n=== ca_dynsaved run ({opts.mode}, backend={opts.backend}) ===", flush=True)
    print("  ".join(f"{k}: {v}" for k, v in numbers.items()))
    if opts.mode == PLUGIN:
        print(ca_dynsaved.report())
    if code:
        print(f"ca_dynsaved run: {opts.script} exited with code {code}", file=sys.stderr)
    sys.stdout.flush()
    return code


def _compare(opts: argparse.Namespace) -> int:
    columns: dict[str, dict[str, Any]] = {}
    code = 0
    with tempfile.TemporaryDirectory() as tmp:
        for mode in (PLUGIN, STOCK):
            summary = os.path.join(tmp, f"{mode}.json")
            cmd = [
                sys.executable, "-m", "ca_dynsaved", "run", "--backend", opts.backend,
                "--mode", mode, "--summary", summary, opts.script, *opts.args,
            ]
            rc = subprocess.call(cmd)
            code = code or rc
            if os.path.exists(summary):
                with open(summary) as f:
                    columns[mode] = json.load(f)
    if len(columns) == 2:
        rows = list(columns[PLUGIN])
        width = max(map(len, rows))
        print(f"\n=== stock vs ca_dynsaved (backend={opts.backend}) ===")
        print(f"{'':<{width}}  {'stock':>10}  {'ca_dynsaved':>12}")
        for row in rows:
            print(f"{row:<{width}}  {columns[STOCK][row]!s:>10}  {columns[PLUGIN][row]!s:>12}")
    else:
        print("ca_dynsaved run --compare: a run did not finish; no comparison", file=sys.stderr)
        code = code or 1
    return code


def main(argv: list[str]) -> int:
    opts = _parse(argv)
    if not os.path.exists(opts.script):
        print(f"ca_dynsaved run: no such script: {opts.script}", file=sys.stderr)
        return 2
    return _compare(opts) if opts.compare else _single(opts)
