"""The version gate: untested torch releases are refused with a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ca_dynsaved import _compat


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1", "2.14.1+cu130"])
def test_tested_release_accepted(version):
    _compat.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.12.1", "2.15.0+cu128", "3.0.0"])
def test_untested_release_refused(version):
    with pytest.raises(_compat.UnsupportedTorchError, match=f"found torch {version.replace('+', '[+]')}"):
        _compat.check_torch_version(version)


def test_import_on_untested_torch_fails_clearly():
    code = (
        "import torch; torch.__version__ = '2.99.0'\n"
        "try:\n"
        "    import ca_dynsaved\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
        "    import torch._dynamo.compiled_autograd as ca, torch._dynamo.config as c\n"
        "    print('patched' if ca._enable.__module__ != 'torch._dynamo.compiled_autograd'"
        " or hasattr(c, 'compiled_autograd_dynamic_saved_data') else 'untouched')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("UnsupportedTorchError ca_dynsaved supports torch 2.13, 2.14, found torch 2.99.0")
    assert lines[1] == "untouched"
