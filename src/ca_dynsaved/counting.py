"""The plugin's own counters, in torch's ``counters["ca_dynsaved"]``: every name it
bumps, with what it counts.

One table, so that a counter cannot go undocumented: ``count()`` refuses a name that
is not in it, docs/report.md's list is generated from it (``python -m ca_dynsaved
counters --markdown --into docs/report.md``), and tests/test_docs.py checks that every
``count()`` in the package names an entry and every entry is counted somewhere.
"""

from __future__ import annotations

import sys

from ._compat.capture import counters
from . import _docblocks

#: name -> what one count means (in the order docs/report.md lists them).
COUNTERS: dict[str, str] = {
    # what each capture decided, a node at a time
    "traced_python_nodes": "a Python node traced into the compiled backward",
    "traced_cpp_nodes": "a C++ node traced into the compiled backward",
    "sentinel_cpp_nodes": "of those, a `toInt()` / `toDouble()` reader traced with sentinels",
    "optin_cpp_nodes": "of those, one named in `trace_cpp=`",
    "opaque_nodes": "a node run by the opaque op",
    "stock_nodes": "a node left as stock compiled autograd has it",
    "lifted_ints": "a C++ node's saved int made an input of the graph",
    "lifted_floats": "a C++ node's saved double made an input of the graph",
    "hashed_values": "a C++ node's saved bool, str, list or dict, kept as stock keeps it",
    "fused_opaque_nodes": "an opaque op folded into its neighbour's call (one dispatch for a chain)",
    # the probes behind those decisions (each once per function and layout)
    "probes": "a Python backward's ctx read under the probe",
    "dynamo_probes": "a Python backward traced by Dynamo alone, to see whether it breaks",
    "cpp_probes": "a C++ backward run under the probe: how it reads its saved values",
    "sentinel_plans": "a C++ backward traced twice, with two sentinel values, and the traces compared",
    "differential_checks": "a traced C++ node's graph run against its own backward, at capture",
    "differential_refusals": "of those, one that differed: the node runs opaque",
    # how the runs went
    "verify_traces": "a new tuple of values recorded and compared with the traced template",
    "verify_fallbacks": "a run whose values a check refused: the refused nodes ran their own backward",
    "first_eager_runs": "a capture's first run, uncompiled, before its opaque ops' outputs are known",
    "held_eager_runs": "a run of a tiered capture's opaque graph while it is held uncompiled",
    "create_graph_eager_runs": "a run with create_graph=True, uncompiled (gradients of every order as eager)",
    "guarded_opaque_runs": "a run whose Python bools / strs form a combination past the cap, on the capture's opaque graph",
    "guarded_eager_runs": "the same where a node has no opaque op, run uncompiled",
    "specialised_captures": "a tiered capture switched to its own traced graph, after enough runs",
    "unpack_stock_runs": "a run whose checkpoint unpack hooks the graph cannot take, run as stock made it",
    "reuse_hits": "a capture's graph equal to one compiled before (same compiler): that code reused",
    "reuse_misses": "a capture's graph met for the first time: its own compiled code kept for reuse",
    "reuse_evictions": "compiled code dropped from the reuse cache (least recently used)",
    "passthrough_outputs": "an opaque op's output found to be its incoming gradient, wired past it",
    "uncaptured_backwards": "a backward run as plain autograd while its graph does not pay to capture",
    "uncollectable_backwards": "a backward stock compiled autograd cannot collect, run as plain autograd",
    "cache_clears": "compiled autograd's cache cleared: its graphs were captured in another mode",
}


def count(name: str, by: int = 1) -> None:
    """Add ``by`` to the plugin's counter ``name``, which must be in ``COUNTERS``."""
    if name not in COUNTERS:
        raise KeyError(f"ca_dynsaved counts only the counters it documents: {name!r} is not in COUNTERS")
    counters["ca_dynsaved"][name] += by


#: The command that writes docs/report.md's block (``_docblocks``).
MARKDOWN_COMMAND = "python -m ca_dynsaved counters --markdown"


def markdown() -> str:
    """The block docs/report.md holds: each counter and what one count is."""
    rows = "".join(f"| `{name}` | {meaning} |\n" for name, meaning in COUNTERS.items())
    return f"`{MARKDOWN_COMMAND}`:\n\n| counter | one count is |\n|---|---|\n{rows}"


def main(argv: list[str]) -> int:
    """``ca-dynsaved counters [--markdown [--into PAGE]]``: what each counter counts;
    ``--markdown`` prints docs/report.md's block, ``--into`` rewrites it there."""
    if argv[:1] == ["--markdown"] and len(argv) in (1, 3) and argv[1:2] in ([], ["--into"]):
        print(markdown(), end="")
        if len(argv) == 3:
            _docblocks.write(argv[2], MARKDOWN_COMMAND, markdown())
        return 0
    if argv:
        print("usage: ca-dynsaved counters [--markdown [--into PAGE]]", file=sys.stderr)
        return 2
    width = max(map(len, COUNTERS))
    for name, meaning in COUNTERS.items():
        print(f"{name:<{width}}  {meaning}")
    return 0
