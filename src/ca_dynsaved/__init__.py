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
from ._install import CONFIG_FLAG, CONFIG_PYTHON_POLICY, install, uninstall
from .enable import enable
from .report import report, reset_report


def reset() -> None:
    """Return to a fresh process's state: ``torch._dynamo.reset()`` (which drops
    every cached CA graph), then the plugin's registry, compiled-graph cache and
    report."""
    import torch

    from . import opaque, reuse

    torch._dynamo.reset()
    opaque.clear()
    reuse.clear()
    reset_report()

__version__ = "0.1.0"

install()

__all__ = ["enable", "report", "reset", "reset_report", "CONFIG_FLAG", "CONFIG_PYTHON_POLICY", "install", "uninstall"]
