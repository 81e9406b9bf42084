"""The words of the report: each key's reason and fix, the recompiles its guards
caused, and the table ``print(report())`` shows.

A key's reason says how the plugin handles it (from its node's ``decision``); its
fix says what the user could change. A recompile of a CA graph is attributed to the
key or ctx attribute its failed guard names (``scalars[i]``, ``hooks[i].attr``),
which Dynamo's compilation metrics give.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from ._compat.dynamo import compilation_metrics
from .names import Handling
from .records import CaptureRecord, FunctionReport, UncapturedRecord


#: A key's (reason, fix) by its handling and its node's kind ("C++", "Python"; None:
#: either), where the words need nothing of the key or node; ``reason_and_fix``
#: words the others.
_WORDS: dict[tuple[str, str | None], tuple[str, str]] = {
    (Handling.TRACED, "C++"): (
        "traced with the backward: an int is a symbolic graph input from the first "
        "compile (or, cast to double, read from the packed int64 tensor), a double "
        "is read from the packed float64 tensor",
        "",
    ),
    (Handling.TRACED, "Python"): (
        "traced with the backward, a symbolic number from the first compile (the "
        "backward fuses with its neighbours)",
        "",
    ),
    (Handling.REUSED, None): (
        "hashed into CA's cache key: each new value is a new capture, whose graph "
        "shares the compiled code of an equal graph",
        "",
    ),
}


def reason_and_fix(kind: str, key: str, type_: str, handling: str, node_reason: str, chosen: bool) -> tuple[str, str]:
    """(reason, fix) for one key; ``chosen``: its node is traced, or stock by the
    plugin's choice (no saved numbers), not by the user's options."""
    scalar = type_ in ("int", "float")
    words = _WORDS.get((handling, kind)) or _WORDS.get((handling, None))
    if words is not None:
        return words
    if handling == Handling.OPAQUE:
        if kind == "C++" and scalar:
            return "lifted by CA into the graph's scalars; the opaque op reads it at run time", ""
        return "read from the real ctx when the backward runs in the opaque op", ""
    # stock: the node's, or a hashed value of a traced node, which Dynamo or CA
    # specialises on as under stock CA (the plugin changes only what recompiles for
    # numbers, and handles these combinations: docs/cpp.md, "Hashed values")
    if kind == "C++":
        if scalar:
            return (
                f"the node kept stock tracing ({node_reason}): Dynamo specialises on the "
                "value toInt()/toDouble() returns, one compile per value",
                "read ints with toSymInt(), or let the plugin run the node opaque",
            )
        if chosen:
            return (
                "hashed into CA's cache key, a constant of the node's traced graph, as under stock: "
                "a new combination is a new capture, opaque until it repeats",
                "",
            )
        return (
            f"hashed into CA's cache key and the node kept stock tracing ({node_reason}): "
            "one capture and one compile per value",
            "",
        )
    if scalar:
        return (
            f"the function kept stock tracing ({node_reason}): Dynamo guards on ctx.{key}",
            'use python_policy="auto" or "opaque" and do not exclude the function',
        )
    return f"Dynamo guards on ctx.{key}, as stock: one compile per distinct value", ""


# --- recompiles ----------------------------------------------------------------------
_GUARD = re.compile(r"\b(?:hooks\[(\d+)\]\.(\w+)|scalars\[(\d+)\])")


def attribute_recompiles(functions: Mapping[str, FunctionReport], captures: Iterable[CaptureRecord]) -> None:
    """Count, for each key, Dynamo's recompiles of CA graphs whose failed guard names it."""
    captures = list(captures)
    for function in functions.values():
        for key in function.keys.values():
            key.recompiles, key.guard = 0, ""
    for metric in compilation_metrics():
        compile_id = str(metric.compile_id or "")
        reason = (metric.recompile_reason or "").split("\n", 1)[0]
        if not compile_id.startswith("!") or not reason or metric.fail_reason:
            continue  # not a CA graph, not a recompile, or a compile that failed
        ca_id = int(compile_id[1:].split("/", 1)[0])
        # The newest capture with that id made before this compile: ids restart
        # with torch._dynamo.reset().
        candidates = [
            c for c in captures if c.ca_id == ca_id and c.start_time_us <= (metric.start_time_us or 0)
        ]
        if not candidates:
            continue
        capture = candidates[-1]
        match = _GUARD.search(reason.split(":", 1)[-1])
        if match is None:
            continue
        hook, attribute, scalar = match.groups()
        key = None
        if scalar is not None and int(scalar) in capture.scalars:
            key = capture.scalars[int(scalar)]
        elif hook is not None and int(hook) in capture.hooks:
            key = capture.hooks[int(hook)].keys.get(attribute)
        if key is not None:
            key.recompiles += 1
            key.guard = reason.split(":", 1)[-1].split("#", 1)[0].strip()


def format_table(
    functions: Mapping[str, FunctionReport], captures: Iterable[CaptureRecord], uncaptured: Iterable[UncapturedRecord]
) -> str:
    """The table ``print(report())`` shows, then a line per function and key (its
    reason, fix and the guard Dynamo named) and per combination or structure run
    another way."""
    header = ("function", "key", "type", "handling", "compiles", "values seen")
    rows = []
    notes = []
    for function in functions.values():
        if function.reason:
            notes.append(f"{function.name}: {function.handling}, {function.reason}")
        if not function.keys:
            rows.append((function.name, "-", "-", function.handling, "-", "-"))
        for key in function.keys.values():
            values = ", ".join(f"{v:.6g}" if isinstance(v, float) else repr(v) for v in key.values)
            if key.more_values:
                values += f", ... (+{key.more_values})"
            rows.append((function.name, key.key, key.type, key.handling, str(key.compiles), values))
            guard = f"; Dynamo recompiled on {key.guard}" if key.guard and key.compiles else ""
            notes.append(f"{function.name}.{key.key}: {key.reason}{guard}" + (f"; fix: {key.fix}" if key.fix else ""))
    for capture in captures:
        for name, values, reason in capture.refused:
            notes.append(f"{name}: verify ran it opaque for saved {values}: {reason}")
        for values, reason in capture.eager_combinations:
            notes.append(f"capture !{capture.ca_id}: {values} run its graph uncompiled: {reason}")
        for values, reason in capture.opaque_combinations:
            notes.append(f"capture !{capture.ca_id}: {values} run its opaque graph: {reason}")
    for record in uncaptured:
        notes.append(f"backward of {', '.join(dict.fromkeys(record.nodes)) or 'a graph'}: {record.reason}")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines + [""] + notes)
