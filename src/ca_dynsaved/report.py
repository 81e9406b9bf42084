"""What the plugin did at each capture, recorded so tests and users can inspect it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeRecord:
    """One custom-function node of one CA capture."""

    name: str  # "torch::autograd::CppNode<ScaleFn>", or a Python Function's name
    opaque: bool  # True: run through an opaque op; False: stock tracing
    keys: tuple[str, ...]  # saved_data keys, or ctx attribute names
    kinds: tuple[str, ...]  # per key: "int"/"float" (lifted, dynamic) or a type name
    reason: str = ""  # why the node kept stock behaviour


@dataclass
class CaptureRecord:
    """One CA capture made with the plugin."""

    nodes: list[NodeRecord]
    # How its graph got compiled code: "" until its first run is done, then
    # "compiled" (a new structure) or "reused" (the code of an equal graph).
    compiled: str = ""


@dataclass
class Report:
    captures: list[CaptureRecord] = field(default_factory=list)

    @property
    def nodes(self) -> list[NodeRecord]:
        return [n for capture in self.captures for n in capture.nodes]


_REPORT = Report()


def record_capture(nodes: list[NodeRecord]) -> CaptureRecord:
    record = CaptureRecord(list(nodes))
    _REPORT.captures.append(record)
    return record


def report() -> Report:
    """The records of every capture made with the plugin since the last reset."""
    return _REPORT


def reset_report() -> None:
    _REPORT.captures.clear()
