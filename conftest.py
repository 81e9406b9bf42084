"""How the suite shares a machine under pytest-xdist (``-n 2``, the README's command).

* Modules, not tests, are the unit of work: a module-scoped fixture here is often
  a launch (the distributed ranks, the demo run) that several tests read, and with
  xdist's default ``load`` scheduling each worker that got one of its tests would
  run it again. ``-n N`` alone therefore schedules as ``--dist loadscope``: the
  modules with a ``slow`` test first, so the short ones even out the workers' ends,
  and those with a ``serial`` one last (each group in collection order).
* A test marked ``serial`` (it spawns ranks of its own) runs while no other test
  runs: every test holds a shared lock for its setup, call and teardown, a
  ``serial`` one an exclusive lock, so ranks never compete with another worker's
  compiles for the cores, and their timeouts only see their own load.
* The benchmarks time nothing under xdist: their quick mode (the suite) checks
  counts and runs each measured function once (pytest-benchmark disabled, as it
  would disable itself, without its warning); the timed run (``--benchmark-only``)
  refuses xdist (pytest-benchmark).

Without xdist none of this does anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

import pytest


def pytest_xdist_make_scheduler(config: pytest.Config, log):  # type: ignore[no-untyped-def]
    """``load`` (what ``-n`` picks when ``--dist`` is not given) → ``loadscope``, in
    the workers' collection order (see pytest_collection_modifyitems)."""
    if config.getvalue("dist") == "load":
        from xdist.scheduler import LoadScopeScheduling

        config.option.loadscopereorder = False  # xdist would order modules by test count
        return LoadScopeScheduling(config, log)
    return None


def _module_rank(items: list[pytest.Item]) -> int:
    """0: a ``slow`` module, 1: the rest, 2: a ``serial`` one. The ``serial`` ones
    last: the other worker waits while they run wherever they are, and by then the
    session's C++ builds (which a first module pays, one core busy) are done."""
    if any(item.get_closest_marker("serial") for item in items):
        return 2
    return 0 if any(item.get_closest_marker("slow") for item in items) else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In xdist's workers (each collects, all alike): the long modules first."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(modules.values(), key=_module_rank)  # stable: collection order within a rank
    items[:] = [item for module in ordered for item in module]


class _SerialLock:
    """A readers-writer lock between the workers of one xdist run, on two files:
    a turnstile, taken briefly by every test and held by a ``serial`` one while it
    waits, so a waiting ``serial`` test is not starved by the other workers' next
    tests; and the lock itself, shared or exclusive."""

    def __init__(self, directory: Path) -> None:
        self._turnstile = open(directory / "serial.turnstile", "a")  # noqa: SIM115 - held for the session
        self._lock = open(directory / "serial.lock", "a")  # noqa: SIM115

    @contextlib.contextmanager
    def held(self, exclusive: bool) -> Iterator[None]:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)


_lock: _SerialLock | None = None


def pytest_configure(config: pytest.Config) -> None:
    in_xdist = bool(os.environ.get("PYTEST_XDIST_WORKER")) or config.getoption("dist", "no") != "no"
    if in_xdist and not config.getoption("benchmark_only", False):
        config.option.benchmark_disable = True  # read by pytest-benchmark's configure (trylast)


def pytest_sessionstart(session: pytest.Session) -> None:
    global _lock
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # A worker's base temp is popen-gwN inside the run's: the files live, and
        # are cleaned up, with the run's temporary directories.
        _lock = _SerialLock(session.config._tmp_path_factory.getbasetemp().parent)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    if _lock is None:
        return (yield)
    with _lock.held(exclusive=item.get_closest_marker("serial") is not None):
        return (yield)
