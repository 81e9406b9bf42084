"""Torch's configuration: the plugin's entries on ``torch._dynamo.config``, its log.

Touches: ``torch.utils._config_module`` (``_Config``, ``_ConfigEntry``, the module's
``_config``, ``_compile_ignored_keys`` and its cached hash), ``torch._logging._internal``
(``register_log``, ``_init_logs``), ``torch._dynamo.eval_frame.OptimizeContext``,
``torch._dynamo.config.specialize_float``, ``torch._inductor.config.triton.cudagraphs``.
Releases: ``_ConfigEntry`` takes the entry's name on 2.12+, not on 2.11; the cached
hash lives in two ContextVars on 2.13+, in two module attributes on 2.11 / 2.12.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch


def register_config_entry(name: str, default: Any, value_type: type) -> None:
    """Add ``torch._dynamo.config.<name>``: settable, patchable, saved by save_config.
    Compile-ignored: the forward graphs do not depend on it, so Dynamo's config
    hash stays unchanged."""
    from torch.utils._config_module import _Config, _ConfigEntry

    config = torch._dynamo.config
    if name not in config._config:
        # torch 2.12+: _ConfigEntry(config, name); 2.11: _ConfigEntry(config).
        named = "name" in inspect.signature(_ConfigEntry.__init__).parameters
        config._config[name] = _ConfigEntry(_Config(default=default, value_type=value_type), *([name] if named else []))
        config._compile_ignored_keys.add(name)
        _mark_config_dirty(config)


def unregister_config_entry(name: str) -> None:
    config = torch._dynamo.config
    if config._config.pop(name, None) is not None:
        config._compile_ignored_keys.discard(name)
        _mark_config_dirty(config)


def _mark_config_dirty(config: Any) -> None:
    # ConfigModule caches get_config_copy()/save_config()/get_hash(). torch 2.13+:
    # per context, in two ContextVars; 2.11 / 2.12: in two module attributes.
    if hasattr(config, "_hash_dirty_var"):
        config._hash_dirty_var.set(True)
        config._get_dict_dirty_keys_var.set(None)
    else:
        config._is_dirty = True
        config._hash_digest = None


def is_dynamo_config_compiler(compiler_fn: Any) -> bool:
    """Whether ``compiler_fn`` is the one Dynamo's config path passes to ``_enable``."""
    from torch._dynamo.eval_frame import OptimizeContext

    return isinstance(compiler_fn, OptimizeContext)


def register_torch_log(name: str) -> None:
    """Let ``TORCH_LOGS="+<name>"`` (debug) / ``"<name>"`` (info) control the
    logger ``<name>``, as torch's own logs are controlled."""
    from torch._logging import _internal

    _internal.register_log(name, [name])
    if name in os.environ.get("TORCH_LOGS", ""):
        # torch parsed TORCH_LOGS at import, before this log existed.
        _internal._init_logs()


def dynamo_specializes_floats() -> bool:
    """Whether Dynamo specialises every float it reads (it does while inductor's
    global CUDA-graphs flag is on, or when asked to), whatever automatic dynamic says."""
    return bool(torch._dynamo.config.specialize_float or torch._inductor.config.triton.cudagraphs)
