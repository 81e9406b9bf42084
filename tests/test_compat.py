"""The version gate: untested torch releases, and releases lacking an internal the
plugin uses, are refused at import with a clear error, and nothing is patched."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import ca_dynsaved
from ca_dynsaved import _compat, compiler, selfcheck
from ca_dynsaved._compat import runtime_wrapper as wrapper_compat

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release


@pytest.mark.parametrize(
    "version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0", "2.13.0+cpu", "2.14.1+cu130", "2.15.0", "2.15.0+cu132"]
)
def test_tested_release_accepted(version):
    assert _compat.is_tested_release(version)
    _compat.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.16.0+cu132", "2.16.0.dev20261130", "2.15.0a0+gitabc123", "2.15.0rc1", "3.0.0"])
def test_untested_release_refused(version, monkeypatch):
    monkeypatch.delenv(_compat.ALLOW_UNTESTED_ENV, raising=False)
    assert not _compat.is_tested_release(version)
    with pytest.raises(_compat.UnsupportedTorchError, match=f"found torch {re.escape(version)}"):
        _compat.check_torch_version(version)
    monkeypatch.setenv(_compat.ALLOW_UNTESTED_ENV, "1")
    _compat.check_torch_version(version)  # allowed: the import runs the self-check


def test_this_torch_is_a_tested_release():
    """CI runs the suite on tested releases only: an untested one here is a CI error."""
    assert not _compat.UNTESTED_TORCH, torch.__version__


_IMPORT_AND_REPORT = (
    "try:\n"
    "    import ca_dynsaved\n"
    "except ImportError as e:\n"
    "    print(type(e).__name__, e)\n"
    "    import torch._dynamo.compiled_autograd as ca, torch._dynamo.config as c\n"
    "    print('patched' if ca._enable.__module__ != 'torch._dynamo.compiled_autograd'"
    " or hasattr(c, 'compiled_autograd_dynamic_saved_data') else 'untouched')\n"
)


def _python(setup: str, then: str, allow_untested: bool = False) -> subprocess.CompletedProcess:
    """A fresh interpreter running ``setup`` (with torch and CA imported), then
    ``then``; the user's opt-in for untested releases set only if ``allow_untested``."""
    code = f"import torch, torch._dynamo.compiled_autograd as ca\n{setup}\n{then}"
    env = {k: v for k, v in os.environ.items() if k != _compat.ALLOW_UNTESTED_ENV}
    if allow_untested:
        env[_compat.ALLOW_UNTESTED_ENV] = "1"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def _import_after(setup: str) -> list[str]:
    """Run ``setup`` then import the plugin in a fresh interpreter: the import error
    (or nothing) and whether torch was patched."""
    out = _python(setup, _IMPORT_AND_REPORT)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_import_on_untested_torch_fails_clearly():
    lines = _import_after("torch.__version__ = '2.99.0'")
    assert lines[0].startswith(
        "UnsupportedTorchError ca_dynsaved supports torch 2.11, 2.12, 2.13, 2.14, 2.15, found torch 2.99.0"
    )
    assert f"set {_compat.ALLOW_UNTESTED_ENV}=1" in lines[0]
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


def test_every_hook_the_plugin_overrides_is_one_this_torch_calls():
    """Each method of the plugin's capture class that replaces one of stock's is
    marked ``@override`` and names a method stock's class has on this release: a
    hook torch renames (so C++ would no longer call the plugin's) fails here."""
    stock = compiler.StockCompilerInstance
    ours = {name: fn for name, fn in vars(compiler.DynSavedCompilerInstance).items() if callable(fn)}
    marked = {name for name, fn in ours.items() if getattr(fn, "__override__", False)}
    assert marked == set(ours) - {"__init__"}
    assert marked >= {
        "begin_capture", "bind_function", "apply_functional", "proxy_call_backward", "validate_outputs",
        "create_graph_module", "end_capture", "unpack_hook", "allocate_dummy_like",
    }
    missing = {name for name in marked if not callable(getattr(stock, name, None))}
    # torch 2.13 added allocate_dummy_like (a leaf gradient's dummy, in its dtype): the
    # releases before it never call it; every other hook is on every tested release
    later = {"allocate_dummy_like"} if torch.torch_version.TorchVersion(torch.__version__) < "2.13" else set()
    assert missing == later


# --- an untested release the user allows: the self-check decides ----------------------
_NIGHTLY = "torch.__version__ = '2.16.0.dev20261130'"

# Scalars stuck at the first run's values: what a torch whose CA passed lifted values
# some other way would do to the plugin (a wrong gradient from step 1 on). Frozen
# where CA hands them to the plugin: around the runtime wrapper its capture class
# returns (any subclass of the stock class, the plugin's included).
_FROZEN_SCALARS = """
def _frozen_scalars(end_capture):
    def wrapped(self, outputs):
        wrapper, fn = end_capture(self, outputs)
        first = []
        def frozen(compiled_fn, inputs, sizes, scalars, hooks, packed):
            first.append(list(scalars)) if not first else None
            return wrapper(compiled_fn, inputs, sizes, first[0], hooks, packed)
        return frozen, fn
    return wrapped
def _init_subclass(cls, **kwargs):
    cls.end_capture = _frozen_scalars(cls.end_capture)
ca.AutogradCompilerInstance.__init_subclass__ = classmethod(_init_subclass)
"""

_STATE_AFTER_IMPORT = """
import warnings, json
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import ca_dynsaved
from ca_dynsaved import _install
import torch._dynamo.config as c
x = torch.ones(4, requires_grad=True)
# a Python function whose ctx holds a str and a float: two compiles for three floats
# under stock CA (the first value a constant, then automatic dynamic), one in all under
# the plugin (the float a graph input, the str, the same each step, guarded as stock)
class Mode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n):
        ctx.mode, ctx.n = "a", n
        return x * 1.0
    @staticmethod
    def backward(ctx, g):
        return g * (ctx.n if ctx.mode == "a" else 3.0), None
for n in (2.0, 3.0, 4.5):
    x.grad = None
    with ca_dynsaved.enable(backend="eager"):
        Mode.apply(x, n).sum().backward()
from torch._dynamo.utils import counters
print(json.dumps({
    "warnings": [str(w.message) for w in caught if w.category.__name__ == "UntestedTorchWarning"],
    "hook": ca._enable is _install._enable_hook,
    "flag": hasattr(c, ca_dynsaved.CONFIG_FLAG),
    "off": ca_dynsaved.off_reason(),
    "compiles": counters["stats"]["unique_graphs"],
}))
"""


def _untested_import(setup: str) -> dict:
    out = _python(setup, _STATE_AFTER_IMPORT, allow_untested=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow  # a fresh process and the self-check (the demo's extension)
def test_untested_torch_allowed_runs_the_self_check_and_switches_on():
    state = _untested_import(_NIGHTLY)
    (warning,) = state["warnings"]
    assert "torch 2.16.0.dev20261130 is not a tested release; the self-check passed" in warning
    assert state["hook"] and state["flag"] and state["off"] == ""
    assert state["compiles"] == 1  # the plugin at work: one compile for three values


@pytest.mark.slow
def test_untested_torch_failing_the_self_check_stays_off_and_says_why():
    state = _untested_import(_NIGHTLY + _FROZEN_SCALARS)
    (warning,) = state["warnings"]
    assert "self-check failed on torch 2.16.0.dev20261130: step 1: the weight gradient differs from eager's" in warning
    assert "The plugin stays off" in warning
    assert state["off"].startswith("ca_dynsaved self-check failed")
    # Off: torch unpatched but for the inert config entries; enable() is stock CA,
    # which compiles for the first value of the ctx float and once more when Dynamo's
    # automatic dynamic makes it a symbol.
    assert not state["hook"] and state["flag"]
    assert state["compiles"] == 2


def test_self_check_passes_on_this_torch():
    torch._dynamo.utils.counters["user"]["mark"] = 3
    rng = torch.random.get_rng_state()
    result = ca_dynsaved.self_check()
    assert result.passed, str(result)
    # The caller's counters and random state are as they were.
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert dict(torch._dynamo.utils.counters) == {"user": {"mark": 3}}
    assert result.counts == selfcheck.EXPECTED
    assert result.handling == selfcheck.EXPECTED_HANDLING


def test_self_check_names_what_differed(monkeypatch):
    """The comparison itself: a count or a handling other than every tested
    release's is named (simulated by asking for other numbers)."""
    monkeypatch.setitem(selfcheck.EXPECTED, "compiles", 2)
    monkeypatch.setitem(selfcheck.EXPECTED_HANDLING, "_SelfCheckScale", "opaque")
    result = ca_dynsaved.self_check()
    assert result.differences == [
        "compiles: 1, every tested release gives 2",
        "_SelfCheckScale ran traced-dynamic, every tested release runs it opaque",
    ]


def test_runtime_wrapper_copy_is_active_and_follows_sizes(ext, monkeypatch):
    """On every tested release the plugin's copy of stock CA's runtime wrapper
    (``_compat.runtime_wrapper.sizes_made_once``) is the one that runs (stock's source matches), and
    a batch size that changes gets a size tensor of its own: gradients equal eager's;
    one recompile when the leaf's size first changes (its shape is a graph input:
    automatic dynamic, as under stock), none after."""
    from helpers import Counts, counts, scale_args

    matched: list[bool] = []
    made = wrapper_compat.sizes_made_once

    def spy(runtime_wrapper):  # type: ignore[no-untyped-def]
        matched.append(wrapper_compat._is_stock_runtime_wrapper(runtime_wrapper.__code__))
        return made(runtime_wrapper)

    monkeypatch.setattr(compiler, "sizes_made_once", spy)

    def grads(ctx_factory):  # type: ignore[no-untyped-def]
        out = []
        for k, n in enumerate((8, 12, 8, 16, 3, 12)):
            x = torch.linspace(-1.0, 1.0, n, requires_grad=True)
            with ctx_factory():
                ext.scale_opaque(x * 2.0, *scale_args(k)).sum().backward()
            out.append(x.grad)
        return out

    plugin = grads(lambda: ca_dynsaved.enable(backend="aot_eager"))
    for got, want in zip(plugin, grads(torch._dynamo.compiled_autograd._disable), strict=True):
        torch.testing.assert_close(got, want)
    assert matched == [True]
    assert counts() == Counts(captures=1, compiles=2, graph_breaks=0)
