"""The plugin's vocabulary, in one place: how a node or key is handled, the user's
policies, and the reasons given for fixed choices (the report prints them as they
are; ``explain`` looks a key's words up by its handling).

Each is a ``str`` enum: a member equals, prints and serialises as its value, so the
report, its JSON and the user's comparisons (``node.handling == "opaque"``) read
plain strings; the enum names the set, so a typo is an ``AttributeError`` here
rather than a silently different string.
"""

from __future__ import annotations

import enum


class _Name(str, enum.Enum):
    """A name that is its value: ``str()``, f-strings and ``==`` see the string."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Handling(_Name):
    """How the plugin handled a node (``TRACED``, ``OPAQUE``, ``STOCK``) or one of its
    saved keys, in the same words: a key is its node's handling, except that a hashed
    value of a traced node is ``STOCK`` (a constant of the graph, as stock has it) and
    one of an opaque C++ node ``REUSED`` (its captures share compiled code). OPAQUE
    and STOCK are spelled as the policies of the same names, which are the user's
    choice, not a handling."""

    TRACED = "traced-dynamic"
    OPAQUE = "opaque"
    STOCK = "stock"
    REUSED = "reused"


class Policy(_Name):
    """What the user picked for Python (``python_policy``) or C++ (``cpp_policy``)
    functions (``policies``)."""

    AUTO = "auto"
    OPAQUE = "opaque"
    STOCK = "stock"


class Reason(_Name):
    """The fixed reasons a decision gives (others carry the probe's own words)."""

    EXCLUDED = "excluded by enable(exclude=...)"
    #: a traceable C++ function with no saved numbers (hashed values only, or nothing)
    HASHED_ONLY = "no saved ints or doubles: traced as stock traces it, its hashed values constants of the graph"
    HASHED_ONLY_LATER = "no saved ints or doubles"
    LATER_COMBINATION = "its hashed values are a combination first met after the function's first capture"
    #: a C++ function, or a Python one with ctx numbers, whose saved tensors a hook unpacks
    UNPACKED_AT_RUN_TIME = (
        "its saved tensors are unpacked by a saved-tensor hook (activation checkpointing) when the "
        "backward runs, so the capture has no shapes to probe it with (one compile, whatever its numbers)"
    )
    REENTRANT = (
        "torch.utils.checkpoint's reentrant backward (CheckpointFunction), which Dynamo skips: "
        "a graph break under stock; its recomputation and nested backward run in the op"
    )
