"""ca_dynsaved: saved ints and floats of custom autograd functions as dynamic
inputs of the compiled-autograd backward, so new values never recompile it.

Three entry points, one behaviour::

    with ca_dynsaved.enable(backend="inductor"):
        loss.backward()

    @ca_dynsaved.enable(backend="inductor")
    def train_step(x): ...

    torch._dynamo.config.compiled_autograd = True
    torch._dynamo.config.compiled_autograd_dynamic_saved_data = True

Public names (each has its own ``help()``): ``enable`` (the entry point, options
and all), ``report()`` / ``reset_report()`` (what the plugin did with each custom
function, and why), ``reset()`` (a fresh process's compile state), ``self_check()``,
``off_reason()``, ``install()`` / ``uninstall()`` (done on import / undo it), the
``CONFIG_*`` names below, and the errors ``UndefinedGradError``,
``UnsupportedTorchError`` (at import: an untested torch) and the warning
``UntestedTorchWarning``.

Config entries, registered on ``torch._dynamo.config`` at import (settable and
patchable like torch's own; compile-ignored, so Dynamo's config hash is unchanged):

* ``torch._dynamo.config.compiled_autograd_dynamic_saved_data`` (``CONFIG_FLAG``;
  bool, default False): on, a CA context opened without ``enable`` (Dynamo's config
  path, a direct ``compiled_autograd._enable``) captures with the plugin; off,
  stock CA. Read each time such a context opens.
* ``torch._dynamo.config.compiled_autograd_dynamic_saved_data_python_policy``
  (``CONFIG_PYTHON_POLICY``; str, default "auto"): "auto", "opaque" or "stock", the
  policy for Python ``autograd.Function`` nodes there and for
  ``enable(python_policy=None)``.
* ``torch._dynamo.config.compiled_autograd_dynamic_saved_data_trace_cpp``
  (``CONFIG_TRACE_CPP``; tuple of str, default ()): C++ function-name substrings
  opted into tracing, as ``enable(trace_cpp=...)``; used for ``trace_cpp=None``.
* ``torch._dynamo.config.compiled_autograd_dynamic_saved_data_verify``
  (``CONFIG_VERIFY``; bool, default True): as ``enable(verify=...)``; used for
  ``verify=None``.
* ``torch._dynamo.config.compiled_autograd_dynamic_saved_data_cpp_policy``
  (``CONFIG_CPP_POLICY``; str, default "auto"): "auto", "opaque" or "stock", the
  policy for C++ ``torch::autograd::Function`` nodes there and for
  ``enable(cpp_policy=None)``.

Example::

    with torch._dynamo.config.patch(compiled_autograd_dynamic_saved_data_python_policy="opaque"):
        with ca_dynsaved.enable(backend="aot_eager"):
            loss.backward()
    print(ca_dynsaved.report())
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (version check first)

from . import selfcheck  # noqa: E402
from .caches import reset  # noqa: E402
from ._install import (  # noqa: E402
    CONFIG_CPP_POLICY,
    CONFIG_FLAG,
    CONFIG_PYTHON_POLICY,
    CONFIG_TRACE_CPP,
    CONFIG_VERIFY,
    install,
    off_reason,
    uninstall,
)
from ._compat import UnsupportedTorchError, UntestedTorchWarning  # noqa: E402
from .enable import enable  # noqa: E402
from .outputs import UndefinedGradError  # noqa: E402
from .scalars import SavedTypeChangedError  # noqa: E402
from .report import report, reset_report  # noqa: E402

__version__ = "0.5.0"
__all__ = [
    "enable",
    "report",
    "reset",
    "reset_report",
    "CONFIG_CPP_POLICY",
    "CONFIG_FLAG",
    "CONFIG_PYTHON_POLICY",
    "CONFIG_TRACE_CPP",
    "CONFIG_VERIFY",
    "install",
    "uninstall",
    "off_reason",
    "self_check",
    "UndefinedGradError",
    "SavedTypeChangedError",
    "UnsupportedTorchError",
    "UntestedTorchWarning",
]


def self_check() -> selfcheck.SelfCheckResult:
    """Run the self-check (``ca_dynsaved.selfcheck``) on this torch: four steps of a
    real training loop whose saved values change every step, through the demo's C++
    function (traceable and not) and a Python ``autograd.Function``, under
    ``enable(backend="aot_eager")``, compared with what every tested release gives
    (1 CA capture, 1 Dynamo compile, no graph break, eager's gradients, each node's
    handling). The first run on a torch build compiles the demo's C++ extension into
    ``~/.cache/ca_dynsaved`` (once per torch build; needs g++ and ninja). It resets compile
    state before and after (``reset()``): call it before training. Torch's counters
    and the global random state are left as they were. Takes no arguments.

    Returns:
        ``SelfCheckResult``: ``.passed``, ``.differences`` (empty when passed; a
        failed build or an exception in the loop is one), ``.counts``,
        ``.handling``, ``.torch_version``; ``str()`` gives a one-line verdict.

    Raises:
        RuntimeError: the plugin is off in this process (``off_reason()``).

    Example::

        result = ca_dynsaved.self_check()
        assert result.passed, str(result)
    """
    if off_reason():
        raise RuntimeError(f"ca_dynsaved is off in this process: {off_reason()}")
    return selfcheck.run()


install()
if _compat.UNTESTED_TORCH:  # allowed by CA_DYNSAVED_ALLOW_UNTESTED_TORCH=1
    selfcheck.decide_on_untested_torch()
