"""Torch's configuration: the plugin's entries on ``torch._dynamo.config``, its log.

Touches: ``torch.utils._config_module`` (``_Config``, ``_ConfigEntry``, the module's
``_config``, ``_compile_ignored_keys`` and its cached hash), ``torch._logging._internal``
(``register_log``, ``_init_logs``), ``torch._dynamo.eval_frame.OptimizeContext``,
``torch._dynamo.config.specialize_float``, ``torch._inductor.config.triton.cudagraphs``,
and torch's loggers (``torch`` and below: non-propagating, each with its own stderr
handler, so a filter must sit on the logger that makes a record). Releases:
``_ConfigEntry`` takes the entry's name on 2.12+, not on 2.11; the cached
hash lives in two ContextVars on 2.13+, in two module attributes on 2.11 / 2.12.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from typing import Any, Iterator

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


def is_config_entry(name: str) -> bool:
    """Whether ``torch._dynamo.config.<name>`` is registered."""
    return name in torch._dynamo.config._config


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


#: torch's loggers, refreshed when the logging manager has registered new ones.
_torch_loggers: tuple[int, list[logging.Logger]] = (-1, [])


def _loggers_of_torch() -> list[logging.Logger]:
    global _torch_loggers
    known = logging.Logger.manager.loggerDict
    if _torch_loggers[0] != len(known):
        found = [
            log for name, log in list(known.items())
            if isinstance(log, logging.Logger) and (name == "torch" or name.startswith("torch."))
        ]
        _torch_loggers = (len(known), found)
    return _torch_loggers[1]


@contextlib.contextmanager
def torch_warnings_to(log: logging.Logger) -> Iterator[None]:
    """While on, a WARNING or ERROR record a torch logger makes in this thread goes to
    ``log`` at DEBUG instead of the user's log. The probes run a backward on stand-in
    values (a symbolic dim that may be out of range) and expect some runs to fail:
    fake tensor mode logs each such failure with its traceback at ERROR before
    raising, which would read as torch's error in the user's log. Other threads'
    records pass untouched."""
    thread = threading.get_ident()

    def demote(record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or threading.get_ident() != thread:
            return True
        if log.isEnabledFor(logging.DEBUG):
            error = record.exc_info[1] if record.exc_info else None
            tail = f" ({type(error).__name__}: {error})" if error is not None else ""
            log.debug("a probe made torch log at %s (%s): %s%s", record.levelname, record.name, record.getMessage(), tail)
        return False

    loggers = _loggers_of_torch()
    for logger in loggers:
        logger.addFilter(demote)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(demote)
