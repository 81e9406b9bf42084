"""What the plugin did at each capture, for tests and diagnostics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeRecord:
    """One C++ custom-function node of one CA capture."""

    name: str  # C++ node name, e.g. "torch::autograd::CppNode<ScaleFn>"
    opaque: bool  # True: run through the opaque op; False: stock tracing
    keys: tuple[str, ...]  # saved_data keys
    kinds: tuple[str, ...]  # per key: "int"/"float" (lifted, dynamic) or a type name
    reason: str = ""  # why the node kept stock behaviour


@dataclass
class Report:
    captures: list[list[NodeRecord]] = field(default_factory=list)

    @property
    def nodes(self) -> list[NodeRecord]:
        return [n for capture in self.captures for n in capture]


_REPORT = Report()


def record_capture(records: list[NodeRecord]) -> None:
    _REPORT.captures.append(list(records))


def report() -> Report:
    """The records of every capture made with the plugin since the last reset."""
    return _REPORT


def reset_report() -> None:
    _REPORT.captures.clear()
