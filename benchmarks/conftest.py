"""Benchmark session: the extension, the mode, and the results file.

``pytest benchmarks/ --benchmark-only`` is the real run (inductor, 50 steps) and
writes ``benchmarks/results/latest.json``; any other run (the suite in CI) is the
quick mode: a few steps on aot_eager, checking compile counts, not timings.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import pytest
import torch

import ca_dynsaved

from harness import RESULTS, _fresh  # noqa: E402
_collected: list[dict] = []


@pytest.fixture(scope="session")
def bench_ext():
    from models import build_extension

    return build_extension()


@pytest.fixture(scope="session")
def full_run(request) -> bool:
    return bool(request.config.getoption("benchmark_only", False))


@pytest.fixture(autouse=True)
def _fresh_state():
    _fresh()
    yield
    ca_dynsaved.reset()


@pytest.fixture
def record():
    return _collected.append


def pytest_sessionfinish(session, exitstatus):
    if not _collected or not session.config.getoption("benchmark_only", False):
        return
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.processor() or 'cpu'}",
                "torch": torch.__version__,
                "results": _collected,
            },
            indent=1,
        )
    )
