"""The version gate: which torch releases the plugin runs on, checked at import.

Touches: ``torch.__version__``; the names of ``torch._dynamo.compiled_autograd`` and
of its capture class that the plugin uses (``REQUIRED_CA_NAMES``,
``REQUIRED_CAPTURE_METHODS``), only to check that they exist. Releases: the same on
2.11 to 2.15; any other is refused unless the user allows it (then ``selfcheck``
decides). Imported first by the package, before any other private symbol is read.
"""

from __future__ import annotations

import os
import re

import torch


#: Releases (major.minor) the test suite passes on, CI runs it on each (README,
#: "Supported torch releases"). Where they differ in what the plugin touches, the
#: difference is detected below, next to the use, with the releases named.
TESTED_TORCH_RELEASES: tuple[str, ...] = ("2.11", "2.12", "2.13", "2.14", "2.15")

#: Set to 1 to try the plugin on a release not in TESTED_TORCH_RELEASES (a nightly):
#: the import then runs ``ca_dynsaved.selfcheck`` first, and the plugin switches on
#: only if it passes.
ALLOW_UNTESTED_ENV = "CA_DYNSAVED_ALLOW_UNTESTED_TORCH"


class UnsupportedTorchError(ImportError):
    """torch is a release whose compiled-autograd internals were never verified.

    Raised by ``import ca_dynsaved``, before anything is patched, when torch is not
    a tested release (2.11 to 2.15; a nightly or a pre-release is not) and
    ``CA_DYNSAVED_ALLOW_UNTESTED_TORCH=1`` is not set, or when torch lacks a
    compiled-autograd name the plugin uses. The message names the version (and the
    missing names). An ``ImportError``: the import fails, so catch it as that.
    Takes the message as its one argument.

    Example::

        try:
            import ca_dynsaved
        except ImportError as e:  # UnsupportedTorchError: run without the plugin
            ca_dynsaved = None
    """


class UntestedTorchWarning(UserWarning):
    """An untested release the user allowed: what the self-check found.

    Warned once by ``import ca_dynsaved`` on a torch that is not a tested release
    when ``CA_DYNSAVED_ALLOW_UNTESTED_TORCH=1`` is set: the import runs the
    self-check, and the plugin switches on if it passes; if not, it stays off
    (``enable()`` and the config flag give stock compiled autograd) and the message
    names what differed, as ``off_reason()`` does. Takes the message as its one
    argument.

    Example::

        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import ca_dynsaved
        untested = [w for w in caught if issubclass(w.category, ca_dynsaved.UntestedTorchWarning)]
    """


def _release(version: str) -> str | None:
    """``"2.15"`` for a final release ``2.15.x`` (a local tag such as ``+cu130``
    allowed); None for a pre-release (``2.16.0.dev20261130``, ``2.15.0a0+git...``,
    ``2.15.0rc1``), which is not the release it precedes."""
    found = re.fullmatch(r"(\d+)\.(\d+)\.\d+(\+[\w.]+)?", version)
    return f"{found.group(1)}.{found.group(2)}" if found else None


def is_tested_release(version: str | None = None) -> bool:
    version = torch.__version__ if version is None else version
    return _release(version) in TESTED_TORCH_RELEASES


def untested_allowed() -> bool:
    return os.environ.get(ALLOW_UNTESTED_ENV, "") == "1"


def check_torch_version(version: str | None = None) -> None:
    """Raise UnsupportedTorchError unless ``version`` is a tested release, or the
    user asked to try an untested one (then the import runs the self-check)."""
    version = torch.__version__ if version is None else version
    if not is_tested_release(version) and not untested_allowed():
        raise UnsupportedTorchError(
            f"ca_dynsaved supports torch {', '.join(TESTED_TORCH_RELEASES)}, "
            f"found torch {version}: its compiled-autograd internals are private "
            "and change between releases, so the plugin refuses to patch them. To try "
            f"it anyway, set {ALLOW_UNTESTED_ENV}=1: the import then runs a self-check "
            "(a real capture of a C++ and a Python function, compared with eager and "
            "with the expected compile counts) and leaves the plugin off if it fails."
        )


check_torch_version()
#: The running torch is not a tested release (the user allowed it: see above).
UNTESTED_TORCH = not is_tested_release()


# Imported only after the version check: on an untested release it may not exist.
import torch._dynamo.compiled_autograd as ca  # noqa: E402

#: What the plugin uses of torch._dynamo.compiled_autograd, and of the capture class
#: (C++ calls the hooks by name; compiler.py overrides and calls them).
REQUIRED_CA_NAMES = ("AutogradCompilerInstance", "_enable", "_disable", "ops", "active_disable_ctx")
REQUIRED_CAPTURE_METHODS = (
    "begin_capture", "bind_function", "apply_functional", "proxy_call_backward",
    "validate_outputs", "end_capture", "create_graph_module", "allocate_dummy",
    "to_proxy", "bind_objects_to_proxies",
)


def missing_internals() -> list[str]:
    """The names above that this torch lacks."""
    missing = [name for name in REQUIRED_CA_NAMES if not hasattr(ca, name)]
    capture = getattr(ca, "AutogradCompilerInstance", None)
    missing += [
        f"AutogradCompilerInstance.{name}"
        for name in REQUIRED_CAPTURE_METHODS
        if capture is not None and not callable(getattr(capture, name, None))
    ]
    return missing


_missing = missing_internals()
if _missing:
    raise UnsupportedTorchError(
        f"ca_dynsaved: torch {torch.__version__} lacks compiled-autograd internals the "
        f"plugin relies on: {', '.join(_missing)}; nothing was patched."
    )
