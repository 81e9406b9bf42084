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

from . import cpptrace, graphbreak, opaque, payoff, probe, reuse, selfcheck, sentinel  # noqa: E402
from ._install import (  # noqa: E402
    CONFIG_FLAG,
    CONFIG_PYTHON_POLICY,
    CONFIG_TRACE_CPP,
    CONFIG_VERIFY,
    install,
    off_reason,
    uninstall,
)
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
    "off_reason",
    "self_check",
]


def self_check() -> selfcheck.SelfCheckResult:
    """Run the self-check (``ca_dynsaved.selfcheck``) on this torch. It resets
    compile state before and after (``reset()``): call it before training."""
    if off_reason():
        raise RuntimeError(f"ca_dynsaved is off in this process: {off_reason()}")
    return selfcheck.run()


def reset() -> None:
    """Return to a fresh process's state: ``torch._dynamo.reset()`` (which drops
    every cached CA graph), then the plugin's registry, probe verdicts,
    compiled-graph cache and report."""
    torch._dynamo.reset()
    _compat.clear_dynamic_scalars()
    opaque.clear()
    payoff.clear()
    probe.clear()
    graphbreak.clear()
    cpptrace.clear()
    sentinel.clear()
    reuse.clear()
    reset_report()


install()
if _compat.UNTESTED_TORCH:  # allowed by CA_DYNSAVED_ALLOW_UNTESTED_TORCH=1
    selfcheck.decide_on_untested_torch()
