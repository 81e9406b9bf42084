"""Memory: long runs with a new saved value at every step stay bounded."""

from __future__ import annotations

import gc
import os

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import opaque, reuse, sentinel
from ca_dynsaved.ways import verify
from ca_dynsaved.records import MAX_CAPTURES, MAX_COUNTED, MAX_VALUES
from helpers import Counts, assert_grads_equal, counts
from test_python_ctx import ScaleFn

#: Bounded state over long runs, on every release (the report's and the registry's caps).
pytestmark = pytest.mark.every_release

MIB = 2**20


def _rss() -> int:
    """Resident set size of this process now (not the peak)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _assert_keys_bounded(distinct: int, new_every_step: set[str]) -> None:
    """Every key keeps at most MAX_VALUES values and counts at most MAX_COUNTED
    more; the keys new at every step hit exactly those bounds."""
    seen = set()
    for function in ca_dynsaved.report().functions.values():
        for key in function.keys.values():
            assert len(key.values) <= MAX_VALUES and key.more_values <= MAX_COUNTED
            if key.key in new_every_step:
                seen.add(key.key)
                assert len(key.values) == MAX_VALUES
                assert key.more_values == min(distinct - MAX_VALUES, MAX_COUNTED)
    assert seen == new_every_step


def test_thousand_steps_of_new_ints_and_floats(ext):
    """1,000 steps, every saved int and float new at each step, on a C++ function
    of each kind and a Python one in one graph: one capture, one compile, the
    plugin's registries do not grow, and RSS grows by less than 16 MiB between
    step 100 and step 1,000 (measured here: under 1 MiB)."""

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, 16, requires_grad=True)
        y = ext.scale_opaque(x * 2, i, -3 * i, i / 7, 1.0 / (i + 1))
        y = ext.scale_traceable(y, 2 * i, i + 1, 0.5 + i, -i / 3)
        ScaleFn.apply(y, i + 5, 1.0 / (i + 2)).sum().backward()
        return (x.grad,)

    sizes = None
    for i in range(1000):
        with ca_dynsaved.enable(backend="aot_eager"):
            got = step(i)
        assert_grads_equal(got, step(i))
        if i == 1:
            sizes = (opaque.registry_size(), reuse.cache_size())
        if i == 100:
            rss_at_100 = _rss()
    growth = _rss() - rss_at_100
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    # One C++ node spec (scale_traceable and the Python function are traced: no
    # spec), one compiled graph; verify's results for scale_traceable: the newest
    # CHECKED_LIMIT tuples.
    assert sizes == (opaque.registry_size(), reuse.cache_size()) == (1, 1)
    (plan,) = [p for p in sentinel._CACHE.values() if p.traced]
    assert len(plan.checked) == verify.CHECKED_LIMIT
    assert len(ca_dynsaved.report().captures) == 1
    _assert_keys_bounded(1000, {"a", "b", "s", "t", "k", "scale"})
    assert growth < 16 * MIB, f"RSS grew {growth / MIB:.1f} MiB over 900 steps"


def test_new_string_at_every_step(ext):
    """300 steps, a saved string new at each step: CA hashes it, so each step is a
    new CA capture, as under stock (which would also compile each one). Each capture
    runs once, and its first run is eager, so nothing compiles. The plugin keeps one
    node spec, compiles nothing, keeps the newest 256 captures in its report, and
    adds less than 0.4 MiB of RSS per capture after the first 50 (CA's own cache
    holds each capture's graph: stock CA's captures cost 0.14 MiB each here, the
    plugin's 0.16 MiB). The recompile limit is raised past the steps: at the default
    (8) the plugin would stop capturing this graph after 8 captures and run it as
    plain autograd (test_payoff); here every step must capture."""
    steps, warmup = 300, 50
    with torch._dynamo.config.patch(recompile_limit=steps + 1):
        for i in range(steps):
            if i == warmup:
                rss_at_warmup = _rss()

            def step():
                x = torch.linspace(-1.0, 1.0, 16, requires_grad=True)
                ext.config_opaque(x * 2, i % 2 == 0, f"mode-{i}", [1, i], 0.5, 1.5).sum().backward()
                return (x.grad,)

            with ca_dynsaved.enable(backend="aot_eager"):
                got = step()
            assert_grads_equal(got, step())
    growth = _rss() - rss_at_warmup
    assert counts() == Counts(captures=steps, compiles=0, graph_breaks=0)
    assert torch._dynamo.utils.counters["ca_dynsaved"]["first_eager_runs"] == steps
    assert (opaque.registry_size(), reuse.cache_size()) == (1, 0)
    rep = ca_dynsaved.report()
    assert (len(rep.captures), rep.dropped_captures) == (MAX_CAPTURES, steps - MAX_CAPTURES)
    _assert_keys_bounded(steps, {"mode", "dims"})
    captures = steps - warmup
    assert growth < captures * MIB * 0.4, f"RSS grew {growth / MIB:.1f} MiB over {captures} captures"
