"""Logging: one line per event with level and component, and no flooding."""
from __future__ import annotations

import logging
import sys
import threading
import time

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "info") -> None:
    """Configure the root logger once (the CLI's --log-level)."""
    logging.basicConfig(level=getattr(logging, level.upper()), format=FORMAT, stream=sys.stderr, force=True)


class RateLimitedLog:
    """Logs the first event of a kind, then at most one summary per interval.

    A dead daemon fails every call of a busy engine; operators need one line
    that says so and how often, not thousands.
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0):
        self.logger = logger
        self.interval = interval
        self._last: dict = {}
        self._suppressed: dict = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            suppressed = self._suppressed.pop(kind, 0)
            self._last[kind] = now
        if suppressed:
            msg += f" ({suppressed} similar events suppressed)"
        self.logger.warning(msg, *args)

    def clear(self, kind: str) -> None:
        with self._lock:
            self._last.pop(kind, None)
            self._suppressed.pop(kind, None)
