"""Every private torch symbol ca_dynsaved touches, one module per torch subsystem.

Compiled autograd (CA) has no public extension API, so the plugin reads and patches
internals. They all live in this package, so that a torch upgrade breaks here and
nowhere else, and each module opens with the internals it touches and the releases
they differ on:

* ``release``: the version gate, run first (below), before any other module reads
  a private symbol;
* ``capture``: what a capture uses of stock CA's module (the capture class, ``_enable``,
  its cache, its ops);
* ``layout``: how a node's call reaches the capture (C++ argument layouts, the
  metadata of incoming gradients and next edges);
* ``symbolic``: a private ShapeEnv for the probes, reading the capture's symbols;
* ``dynamo``: frames Dynamo skips, a backward traced alone, compile metrics;
* ``dynamic_state``: Dynamo's automatic-dynamic state (scalars dynamic from the
  first compile, resume functions included);
* ``runtime_wrapper``: the plugin's copy of stock CA's per-graph runtime wrapper;
* ``engine``: the autograd engine swap (final callbacks, the payoff gate), the
  caller's dispatch keys and autocast state;
* ``config``: the config entries on ``torch._dynamo.config``, the log;
* ``checkpoint``: ``torch.utils.checkpoint``'s unpack hook, frame and reentrant
  function (activation checkpointing in one CA graph).

Callers import what they use from the module that holds it (``from ._compat.layout
import CppCall``), so each import line says which torch subsystem a module leans on;
the version gate's names are also here, where ``import ca_dynsaved`` reads them.
"""

from __future__ import annotations

from .release import (  # noqa: F401  (the version check runs on this import)
    ALLOW_UNTESTED_ENV,
    TESTED_TORCH_RELEASES,
    UNTESTED_TORCH,
    UnsupportedTorchError,
    UntestedTorchWarning,
    check_torch_version,
    is_tested_release,
)
