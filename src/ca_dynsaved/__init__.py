"""ca_dynsaved: saved ints and floats of custom autograd functions as dynamic
inputs of the compiled-autograd backward, so new values never recompile it.

Three entry points, one behaviour::

    with ca_dynsaved.enable(backend="inductor"):
        loss.backward()

    @ca_dynsaved.enable(backend="inductor")
    def train_step(x): ...

    torch._dynamo.config.compiled_autograd = True
    torch._dynamo.config.compiled_autograd_dynamic_saved_data = True
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (version check first)

import torch  # noqa: E402

from . import cpptrace, opaque, probe, reuse, sentinel  # noqa: E402
from ._install import CONFIG_FLAG, CONFIG_PYTHON_POLICY, CONFIG_TRACE_CPP, CONFIG_VERIFY, install, uninstall  # noqa: E402
from .enable import enable  # noqa: E402
from .report import report, reset_report  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "enable",
    "report",
    "reset",
    "reset_report",
    "CONFIG_FLAG",
    "CONFIG_PYTHON_POLICY",
    "CONFIG_TRACE_CPP",
    "CONFIG_VERIFY",
    "install",
    "uninstall",
]


def reset() -> None:
    """Return to a fresh process's state: ``torch._dynamo.reset()`` (which drops
    every cached CA graph), then the plugin's registry, probe verdicts,
    compiled-graph cache and report."""
    torch._dynamo.reset()
    opaque.clear()
    probe.clear()
    cpptrace.clear()
    sentinel.clear()
    reuse.clear()
    reset_report()


install()
