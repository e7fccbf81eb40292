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


class Throttle:
    """Admits the first event of a kind, then at most one per interval, counting what it held back.

    The one rate limiter: RateLimitedLog (call sites that name their event)
    and FloodGuard (a filter under every handler) both count with it.  At
    most ``max_kinds`` kinds are remembered, whatever the events carry.
    """

    def __init__(self, interval: float = 10.0, max_kinds: int = 10_000):
        self.interval = interval
        self.max_kinds = max_kinds
        self._last: dict = {}
        self._suppressed: dict = {}
        self._lock = threading.Lock()

    def admit(self, kind) -> "int | None":
        """None: hold this event back; otherwise how many of its kind were held back since the last one."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return None
            if len(self._last) >= self.max_kinds:
                self._last.clear()
                self._suppressed.clear()
            self._last[kind] = now
            return self._suppressed.pop(kind, 0)

    def forget(self, kind) -> None:
        with self._lock:
            self._last.pop(kind, None)
            self._suppressed.pop(kind, None)


class RateLimitedLog:
    """Logs the first event of a kind, then at most one summary per interval.

    A dead daemon fails every call of a busy engine; operators need one line
    that says so and how often, not thousands.  interval=math.inf logs each
    kind once.
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0):
        self.logger = logger
        self._throttle = Throttle(interval)

    def warning(self, kind: str, msg: str, *args) -> None:
        suppressed = self._throttle.admit(kind)
        if suppressed is None:
            return
        if suppressed:
            msg += f" ({suppressed} similar events suppressed)"
        self.logger.warning(msg, *args)

    def clear(self, kind: str) -> None:
        self._throttle.forget(kind)


class FloodGuard(logging.Filter):
    """Passes the first warning or error of a kind, then at most one per interval with a count.

    A safety net under call sites without a RateLimitedLog: a failure that
    repeats on every request (a broken store, a client reconnecting in a loop)
    must not flood the journal.  The kind is (logger, message, arguments).
    """

    def __init__(self, interval: float = 10.0):
        super().__init__()
        self._throttle = Throttle(interval)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        suppressed = self._throttle.admit((record.name, str(record.msg), repr(record.args)))
        if suppressed is None:
            return False
        if suppressed:
            record.msg = f"{record.msg} ({suppressed} similar events suppressed)"
        return True
