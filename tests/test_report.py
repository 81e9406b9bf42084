"""The explain report, the counters, the log, and `python -m ca_dynsaved run`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ca_dynsaved
from helpers import leaf_grad_step, run_loop, scale_args
from test_hashed_values import _config_step
from test_python_ctx import BranchFn, pool_step

SCRIPT = Path(__file__).parent / "scripts" / "pool_train.py"
REPO = Path(__file__).resolve().parent.parent


def _scale_loop(ext, **options):
    step = leaf_grad_step(lambda x, i: ext.scale_traceable(x, *scale_args(i)))
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager", **options))


def test_cpp_lifted_values_of_an_opaque_node(ext):
    _scale_loop(ext, cpp_policy="opaque")  # the opaque op's reasons and counters
    (function,) = ca_dynsaved.report().functions.values()
    assert (function.name, function.kind, function.opaque) == (
        "torch::autograd::CppNode<ScaleFn<true> >", "C++", True
    )
    a, b, s, t = (function.keys[k] for k in "abst")
    # what ran: the opaque op, which reads them from the run (no recompile)
    assert [(k.type, k.handling, k.recompiles, k.compiles) for k in (a, b, s, t)] == [
        ("int", "opaque", 0, 0), ("int", "opaque", 0, 0),
        ("float", "opaque", 0, 0), ("float", "opaque", 0, 0),
    ]
    # 12 distinct values each: the first 8 kept, 4 more counted.
    assert a.values == list(range(8)) and a.more_values == 4
    assert s.values == [i / 2 for i in range(8)]
    assert "lifted" in a.reason and a.fix == ""
    plugin = torch._dynamo.utils.counters["ca_dynsaved"]
    assert (plugin["opaque_nodes"], plugin["lifted_ints"], plugin["lifted_floats"]) == (1, 2, 2)
    assert (plugin["reuse_misses"], plugin["first_eager_runs"]) == (1, 1)


def test_cpp_hashed_values_are_reused(ext):
    run_loop(_config_step(ext.config_opaque), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=8)
    (function,) = ca_dynsaved.report().functions.values()
    keys = function.keys
    assert {k: (v.type, v.handling) for k, v in keys.items()} == {
        "flip": ("bool", "reused"), "mode": ("str", "reused"),
        "dims": ("list", "reused"), "weights": ("dict", "reused"),
    }
    assert keys["flip"].values == [False, True]
    assert keys["mode"].values == ["square", "linear"]
    assert keys["dims"].values == [[1, 2], [3], [2, 2, 2]]
    assert keys["weights"].values == [{"a": 1.0, "b": 2.0}, {"a": 0.5, "b": 2.0}, {"a": 1.5, "b": -1.0}]
    assert keys["flip"].fix == ""  # the plugin handles it: no rewrite advised
    plugin = torch._dynamo.utils.counters["ca_dynsaved"]
    assert (plugin["hashed_values"], plugin["reuse_hits"], plugin["reuse_misses"]) == (16, 3, 1)


def test_stock_cpp_node_names_the_guarded_key(ext):
    _scale_loop(ext, exclude=["ScaleFn"])
    (function,) = ca_dynsaved.report().functions.values()
    assert (function.opaque, function.reason) == (False, "excluded by enable(exclude=...)")
    assert {k.handling for k in function.keys.values()} == {"stock"}
    # Every step changes all four values; each recompile's reason names the guard
    # that failed first, so the recompiles up to the limit spread over the keys.
    limit = torch._dynamo.config.recompile_limit
    keys = function.keys.values()
    assert sum(k.recompiles for k in keys) == limit - 1
    assert all(k.compiles == 1 + k.recompiles for k in keys)
    assert "toSymInt" in function.keys["a"].fix


@pytest.mark.every_release  # Report.to_json: no other test reaches it
def test_python_bool_report_says_two_compiles_and_why():
    run_loop(leaf_grad_step(lambda x, i: BranchFn.apply(x, i % 2 == 0)), lambda: ca_dynsaved.enable(backend="aot_eager"))
    rep = ca_dynsaved.report()
    flag = rep.functions["BranchFn"].keys["flag"]
    assert (flag.type, flag.handling, flag.values) == ("bool", "stock", [True, False])
    assert (flag.recompiles, flag.compiles) == (1, 2)
    assert flag.reason == "Dynamo guards on ctx.flag, as stock: one compile per distinct value"
    assert flag.fix == ""
    row = next(line for line in str(rep).splitlines() if line.startswith("BranchFn"))
    assert row.split() == ["BranchFn", "flag", "bool", "stock", "2", "True,", "False"]
    data = json.loads(rep.to_json())
    (entry,) = data["functions"]
    assert "hooks[0].flag" in entry["keys"][0]["guard"]
    assert entry["keys"][0] | {"reason": "", "fix": "", "guard": ""} == {
        "key": "flag", "kind": "Python", "type": "bool", "handling": "stock", "reason": "",
        "fix": "", "values": [True, False], "more_values": 0, "recompiles": 1, "compiles": 2,
        "guard": "",
    }


def test_python_opaque_values_seen():
    run_loop(pool_step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=3)
    keys = ca_dynsaved.report().functions["GeneratedBackwardFor_ca_dynsaved_tests_pool_default"].keys
    assert {k: (v.type, v.handling, v.values) for k, v in keys.items()} == {
        "scale": ("float", "opaque", [0.25, 0.75, 1.25]), "ratio": ("int", "opaque", [1, 2, 3]),
    }


def test_reset_report(ext):
    _scale_loop(ext)
    ca_dynsaved.reset_report()
    rep = ca_dynsaved.report()
    assert (rep.functions, list(rep.captures), rep.dropped_captures) == ({}, [], 0)


_LOG_SNIPPET = (
    "import sys; sys.path.insert(0, 'tests'); import torch, ca_dynsaved\n"
    "from test_python_ctx import pool_step, scale_step\n"
    "with ca_dynsaved.enable(backend='aot_eager'):\n"
    "    for i in range(2): pool_step(i)\n"
    "    scale_step(0)\n"
)


def _run_snippet(torch_logs: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    if torch_logs is not None:
        env["TORCH_LOGS"] = torch_logs
    out = subprocess.run([sys.executable, "-c", _LOG_SNIPPET], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return out.stderr


@pytest.mark.every_release  # a _compat path (README, "Supported torch releases")
@pytest.mark.slow  # fresh processes
def test_log_artifact():
    info = _run_snippet("ca_dynsaved")
    assert re.search(
        r"capture !0: GeneratedBackwardFor_ca_dynsaved_tests_pool_default opaque \(ctx.scale needs its "
        r"value \(guard Eq\(ctx.scale, 0.37\)\)\); saved scale: float, ratio: int",
        info,
    )
    assert "capture !0: first run done; compiled code" in info
    assert re.search(
        r"capture !1: ScaleFn traced-dynamic \(its ctx numbers only reach tensor math: ctx.k, "
        r"ctx.scale\); saved k: int, scale: float",
        info,
    )
    assert "graph:" not in info
    assert "def forward(self, inputs, sizes, scalars, hooks, packed_data)" in _run_snippet("+ca_dynsaved")
    assert "capture !" not in _run_snippet(None)


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ca_dynsaved", "run", *args], cwd=REPO, capture_output=True, text=True
    )


@pytest.mark.every_release  # run.py and __main__ on each release: no other test reaches them
@pytest.mark.slow  # the CLI: fresh processes
def test_run_compare_prints_both_columns():
    out = _run_cli("--backend", "aot_eager", "--compare", str(SCRIPT), "6")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("script done: grad sum 2576.0") == 2

    table = out.stdout.split("=== stock vs ca_dynsaved (backend=aot_eager) ===", 1)[1]

    def row(label: str) -> list[str]:
        (line,) = [line for line in table.splitlines() if line.startswith(label)]
        return line[len(label):].split()

    # Stock: one compile per (scale, ratio) value (6 < recompile limit); plugin: 1.
    # Two captures in both: w.grad is None on the first step only.
    assert row("Dynamo compiles") == ["6", "1"]
    assert row("CA captures") == ["2", "2"]
    assert row("graph breaks") == ["0", "0"]
    assert row("exit code") == ["0", "0"]
    assert len(row("wall seconds")) == 2


@pytest.mark.slow  # the CLI: fresh processes (the whole suite: plain Python, no torch internals)
def test_run_keeps_the_scripts_exit_code():
    out = _run_cli("--backend", "aot_eager", str(SCRIPT), "2", "3")
    assert out.returncode == 3
    assert "script done" in out.stdout
    assert "exited with code 3" in out.stderr
    out = _run_cli("--backend", "aot_eager", "--compare", str(SCRIPT), "2", "3")
    assert out.returncode == 3


@pytest.mark.slow  # the CLI: fresh processes (the whole suite: plain Python, no torch internals)
def test_run_reports_a_failing_script(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise ValueError('boom')\n")
    out = _run_cli("--backend", "aot_eager", str(bad))
    assert out.returncode == 1
    assert "ValueError: boom" in out.stderr and "exited with code 1" in out.stderr
    assert _run_cli(str(tmp_path / "missing.py")).returncode == 2


def test_values_seen_are_distinct_and_bounded():
    from ca_dynsaved.records import MAX_COUNTED, MAX_VALUES, KeyReport

    key = KeyReport("k", "C++", "int", "traced-dynamic", "", "")
    for _ in range(3):
        for v in range(20):
            key.see(v)
    assert (key.values, key.more_values) == (list(range(MAX_VALUES)), 20 - MAX_VALUES)
    for v in range(5 * MAX_COUNTED):
        key.see(v)
    assert key.more_values == MAX_COUNTED


@pytest.mark.every_release
def test_values_seen_in_bulk_match_one_by_one():
    """see_all (the runtime's batched path) records what see() would, value by value:
    the same values kept, the same count, NaN once, bools apart from ints."""
    from ca_dynsaved.records import MAX_COUNTED, MAX_VALUES, KeyReport

    stream = [float("nan"), True, 1, 1.0, *range(40), float("nan"), *range(2 * MAX_COUNTED)]
    one, bulk = (KeyReport("k", "C++", "int", "traced-dynamic", "", "") for _ in range(2))
    for v in stream:
        one.see(v)
    for start in range(0, len(stream), 64):
        bulk.see_all(stream[start : start + 64])
    assert repr(bulk.values) == repr(one.values) and len(one.values) == MAX_VALUES
    assert bulk.more_values == one.more_values == MAX_COUNTED


@pytest.mark.every_release
def test_observed_runs_are_seen_when_the_report_is_read():
    """CaptureRecord.observe keeps a run's plain values for a batched look, which any
    read of the report (or a full batch) makes first; any other ctx value is seen at
    once, not kept for later steps."""
    from ca_dynsaved import decision, records as rep

    record = rep.CaptureRecord(0, 0)
    record.scalars[0] = rep.KeyReport("s", "C++", "float", decision.TRACED, "", "")
    function = rep.FunctionReport("F", "Python", True, "")
    function.keys["k"] = rep.KeyReport("k", "Python", "int", decision.OPAQUE, "", "")
    function.keys["held"] = rep.KeyReport("held", "Python", "list", decision.OPAQUE, "", "")
    record.hooks[0] = function

    class Ctx:
        pass

    for step in range(3):
        ctx = Ctx()
        ctx.k, ctx.held = step, [torch.ones(1) * step]
        record.observe([0.5 * step], [ctx])
    assert function.keys["held"].values[2].__class__ is list  # seen at once
    assert record.scalars[0].values == [] and function.keys["k"].values == []  # not yet
    rep.flush_pending()
    assert record.scalars[0].values == [0.0, 0.5, 1.0] and function.keys["k"].values == [0, 1, 2]
    for step in range(3, 3 + rep._BATCH):
        record.observe([0.5 * step], [ctx])
    assert len(record.scalars[0].values) == rep.MAX_VALUES  # a full batch: seen


class ArrayCtxFn(torch.autograd.Function):
    """An int, a numpy array and a NaN on ctx: values whose == is no bool, or no
    equality at all."""

    @staticmethod
    def forward(ctx, x, k, weights):
        ctx.k, ctx.weights, ctx.nan = k, weights, float("nan")
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k * float(ctx.weights.sum()), None, None


@pytest.mark.every_release
def test_report_records_values_that_do_not_compare(ext):
    """The report compares the values it records without ever raising: an array's
    ``==`` gives an array (``in`` would raise "truth value ... is ambiguous" in the
    user's backward), and NaN is recorded once."""
    import numpy as np

    step = leaf_grad_step(lambda x, i: ArrayCtxFn.apply(x, i, np.full(3, float(i))))
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=10)
    keys = ca_dynsaved.report().functions["ArrayCtxFn"].keys
    assert [int(v.sum()) for v in keys["weights"].values] == [3 * i for i in range(8)]
    assert keys["weights"].more_values == 2
    assert keys["k"].values == list(range(8)) and keys["k"].more_values == 2
    assert len(keys["nan"].values) == 1 and keys["nan"].more_values == 0
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] == 1
