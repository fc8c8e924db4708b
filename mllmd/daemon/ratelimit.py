"""Rate-limited logging: an error that repeats (a flood of bad connections, a loop that keeps failing)
is logged once with its traceback, then at most once per interval with the count of the ones not
logged, so the journal stays bounded whatever a client does."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any


class RateLimitedLog:
    """`log(key, ...)`: the first message of a key is logged (with `exc_info` if given); later ones of
    that key within `interval` seconds are counted, and the next one logged after it says how many were
    left out. At most `max_keys` keys are remembered (the oldest forgotten first)."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0, max_keys: int = 256) -> None:
        self.logger = logger
        self.interval = interval
        self.max_keys = max_keys
        self._seen: OrderedDict[str, list[float]] = OrderedDict()  # key -> [last logged at, suppressed]

    def log(self, key: str, level: int, msg: str, *args: Any, exc_info: Any = None) -> bool:
        """Log unless rate-limited; True if this one was logged."""
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            return False
        suppressed = int(entry[1]) if entry is not None else 0
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        if suppressed:
            msg += f" (and {suppressed} more like it in the last {self.interval:.0f} s, not logged)"
        # a traceback only the first time: the repeats add lines, not information
        self.logger.log(level, msg, *args, exc_info=exc_info if entry is None else None)
        return True

    def exception(self, key: str, msg: str, *args: Any) -> bool:
        """`log` at ERROR with the current exception's traceback (the first time)."""
        return self.log(key, logging.ERROR, msg, *args, exc_info=True)


class RateLimitFilter(logging.Filter):
    """A logging filter for a library's logger (uvicorn's "Invalid HTTP request received.", once per
    bad request): each distinct message passes once per `interval` seconds."""

    def __init__(self, interval: float = 10.0, max_keys: int = 256) -> None:
        super().__init__()
        self.interval = interval
        self.max_keys = max_keys
        self._last: OrderedDict[str, float] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.levelno}:{record.msg}"
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            return False
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return True
