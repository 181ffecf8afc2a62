"""Log lines for bad input, at most one per reason per interval, with the
count of what was suppressed, so that a flood cannot flood the log."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 1.0):
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, reason: str, fmt: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(reason, -1e9) < self.interval:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        self._last[reason] = now
        extra = self._suppressed.pop(reason, 0)
        if extra:
            fmt += f" (and {extra} more like it)"
        self.logger.warning(fmt, *args)
