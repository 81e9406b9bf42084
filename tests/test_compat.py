"""The version gate: untested torch releases, and releases lacking an internal the
plugin uses, are refused at import with a clear error, and nothing is patched."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ca_dynsaved import _compat


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1", "2.14.1+cu130"])
def test_tested_release_accepted(version):
    _compat.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.12.1", "2.15.0+cu128", "3.0.0"])
def test_untested_release_refused(version):
    with pytest.raises(_compat.UnsupportedTorchError, match=f"found torch {version.replace('+', '[+]')}"):
        _compat.check_torch_version(version)


_IMPORT_AND_REPORT = (
    "try:\n"
    "    import ca_dynsaved\n"
    "except ImportError as e:\n"
    "    print(type(e).__name__, e)\n"
    "    import torch._dynamo.compiled_autograd as ca, torch._dynamo.config as c\n"
    "    print('patched' if ca._enable.__module__ != 'torch._dynamo.compiled_autograd'"
    " or hasattr(c, 'compiled_autograd_dynamic_saved_data') else 'untouched')\n"
)


def _import_after(setup: str) -> list[str]:
    """Run ``setup`` then import the plugin in a fresh interpreter: the import error
    (or nothing) and whether torch was patched."""
    code = f"import torch, torch._dynamo.compiled_autograd as ca\n{setup}\n{_IMPORT_AND_REPORT}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_import_on_untested_torch_fails_clearly():
    lines = _import_after("torch.__version__ = '2.99.0'")
    assert lines[0].startswith("UnsupportedTorchError ca_dynsaved supports torch 2.13, 2.14, found torch 2.99.0")
    assert lines[1] == "untouched"


@pytest.mark.parametrize(
    "missing",
    [
        "AutogradCompilerInstance.apply_functional",
        "AutogradCompilerInstance.validate_outputs",
        "AutogradCompilerInstance.proxy_call_backward",
        "active_disable_ctx",
    ],
)
def test_missing_internals_refused_at_import(missing):
    """A torch whose compiled-autograd module lacks what the plugin overrides or
    reads (simulated by deleting it): the import fails naming the version and the
    name, and patches nothing."""
    lines = _import_after(f"del ca.{missing}")
    assert lines[0].startswith(f"UnsupportedTorchError ca_dynsaved: torch {torch.__version__} lacks")
    assert missing in lines[0]
    assert lines[1] == "untouched"


def test_import_succeeds_on_this_torch():
    assert _import_after("") == []
