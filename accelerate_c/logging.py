"""`get_logger`: a standard `logging` logger that knows about processes, as accelerate.logging's.

Each call takes two extra keywords: `main_process_only` (default True: only the main process
emits) and `in_order` (every process emits, one after the other by rank, with a barrier
between turns; `main_process_only` is then ignored). Messages carry a `[RANK i] ` prefix, as
accelerate 1.15 writes them. Nothing is configured on the process beyond what the caller asks:
`log_level` (or ACCELERATE_LOG_LEVEL) sets the level of this logger and of the root logger, as
accelerate does; no handler is added.
"""
from __future__ import annotations

import functools
import logging
import os

from .state import PartialState


class MultiProcessAdapter(logging.LoggerAdapter):
    """A LoggerAdapter whose `log` (and so debug/info/warning/...) takes `main_process_only`
    and `in_order`. The process layout is read when a message is logged, so the logger can be
    made at import time, before any Accelerator exists."""

    @staticmethod
    def _should_log(main_process_only: bool) -> bool:
        return not main_process_only or PartialState().is_main_process

    def process(self, msg, kwargs):
        msg, kwargs = super().process(msg, kwargs)
        # the caller's frame, not this adapter's, is the record's origin (unless the caller chose)
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    def log(self, level, msg, *args, **kwargs):
        if not PartialState.exists():
            raise RuntimeError("accelerate_c.logging: create an Accelerator() or a PartialState() before logging "
                               "through get_logger(): whether this process logs depends on its rank")
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        if in_order:
            state = PartialState()
            for turn in range(state.num_processes):
                if turn == state.process_index:
                    self.logger.log(level, msg, *args, **kwargs)
                state.wait_for_everyone()
        elif self._should_log(main_process_only):
            self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)
    def warning_once(self, *args, **kwargs):
        """`warning`, once per distinct arguments (the cache is keyed on them, as accelerate's)."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger `name` wrapped for several processes. `log_level` (else the
    ACCELERATE_LOG_LEVEL variable) sets this logger's level and the root logger's."""
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logging.getLogger().setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
