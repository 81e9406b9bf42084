from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch._dynamo.utils import counters

import ca_dynsaved

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpp_ext  # noqa: E402


@pytest.fixture(scope="session")
def ext() -> ModuleType:
    """The C++ test extension, compiled once per session into .ext_build/."""
    return cpp_ext.load()


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts from a fresh process's compile state."""
    ca_dynsaved.reset()
    counters.clear()
    with torch._dynamo.config.patch(
        compiled_autograd=False, **{ca_dynsaved.CONFIG_FLAG: False}
    ):
        yield
    ca_dynsaved.reset()
    counters.clear()
