"""Every public name documents itself: ``help(ca_dynsaved.enable)`` alone is enough
to use it. A str config constant cannot carry a docstring, so each config entry is
documented in ``enable``'s docstring and the package's. No compiling here."""

from __future__ import annotations

import inspect

import pytest

import ca_dynsaved
from ca_dynsaved import _compat, outputs, scalars
from ca_dynsaved.report import Report

CONFIG_NAMES = [name for name in ca_dynsaved.__all__ if name.startswith("CONFIG_")]
DOCUMENTED = [name for name in ca_dynsaved.__all__ if not isinstance(getattr(ca_dynsaved, name), str)]


def _parameters(obj) -> list[str]:
    """The named parameters of ``obj``'s signature (none for a class torch or C
    gives no signature, such as an exception); catch-alls excluded."""
    try:
        signature = inspect.signature(obj)
    except ValueError:
        return []
    catch_alls = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in signature.parameters.values() if p.name != "self" and p.kind not in catch_alls]


def test_public_names_listed():
    assert set(ca_dynsaved.__all__) >= {
        "enable", "report", "reset", "reset_report", "install", "uninstall", "off_reason", "self_check",
        "CONFIG_FLAG", "CONFIG_PYTHON_POLICY", "CONFIG_TRACE_CPP", "CONFIG_VERIFY", "CONFIG_CPP_POLICY",
        "UndefinedGradError", "UnsupportedTorchError", "UntestedTorchWarning", "SavedTypeChangedError",
    }
    assert len(CONFIG_NAMES) == 5
    for name in ca_dynsaved.__all__:
        assert hasattr(ca_dynsaved, name), name


def test_errors_exported_as_themselves():
    assert ca_dynsaved.UndefinedGradError is outputs.UndefinedGradError
    assert ca_dynsaved.SavedTypeChangedError is scalars.SavedTypeChangedError
    assert ca_dynsaved.UnsupportedTorchError is _compat.UnsupportedTorchError
    assert ca_dynsaved.UntestedTorchWarning is _compat.UntestedTorchWarning


@pytest.mark.parametrize("name", DOCUMENTED)
def test_docstring_names_every_parameter_and_has_example(name):
    obj = getattr(ca_dynsaved, name)
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    assert "Example" in doc, f"{name}'s docstring has no Example section"
    # Each parameter gets its own "name: meaning" entry (Args), not a passing mention.
    entries = {line.strip().split(":", 1)[0] for line in doc.splitlines() if ":" in line}
    missing = [p for p in _parameters(obj) if p not in entries]
    assert not missing, f"{name}'s docstring has no entry for {missing}"


def test_enable_parameters_checked():
    """enable's signature is the one the test above walks (not (*args, **kwargs))."""
    assert _parameters(ca_dynsaved.enable) == [
        "compiler_fn", "backend", "mode", "options", "dynamic", "fullgraph",
        "exclude", "python_policy", "trace_cpp", "verify", "cpp_policy",
    ]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_entry_documented(name):
    entry = getattr(ca_dynsaved, name)
    assert entry.startswith("compiled_autograd_dynamic_saved_data")
    assert f"torch._dynamo.config.{entry}" in inspect.getdoc(ca_dynsaved.enable)
    assert f"torch._dynamo.config.{entry}" in inspect.getdoc(ca_dynsaved)


def test_report_class_documents_its_methods():
    assert isinstance(ca_dynsaved.report(), Report)
    doc = inspect.getdoc(Report)
    assert doc and "Example" in doc
    methods = [
        name
        for name, member in vars(Report).items()
        if (not name.startswith("_") or name == "__str__") and (callable(member) or isinstance(member, property))
    ]
    assert {"to_dict", "to_json", "__str__", "nodes"} <= set(methods)
    missing = [m for m in methods if m not in doc]
    assert not missing, f"Report's docstring does not name {missing}"
    for attribute in ("functions", "captures", "dropped_captures", "uncaptured", "handling", "reason"):
        assert attribute in doc, attribute
