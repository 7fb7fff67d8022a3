"""Warnings that cannot flood vLLM's log: at most one per cause per interval.

Why: a fault that hits every row of every step (a full disk, a store that is down, a bug in
a load path) would otherwise write thousands of identical lines per second, hide the first
(the useful) one and slow the engine down. Each :class:`RateLimitedLog` keeps, per cause,
when it last logged and how many lines it has held back since; the next line that gets
through says how many were suppressed, so nothing is lost from the count.

``interval_s=math.inf`` logs each cause once for the life of the object ("once per cause").
Not for per-layer hot paths: it takes a lock and reads the clock; faults are rare.
"""

from __future__ import annotations

import logging
import math
import threading
import time


class RateLimitedLog:
    """Log through ``logger`` at most once per ``interval_s`` seconds for each cause."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.logger = logger
        self.interval_s = interval_s
        self._lock = threading.Lock()
        # cause -> [monotonic time of the last line logged, lines suppressed since]
        self._state: dict[object, list[float]] = {}
        #: cause -> how many times it was reported (logged or suppressed).
        self.counts: dict[object, int] = {}

    def log(self, level: int, cause: object, msg: str, *args: object, **kwargs: object) -> bool:
        """Log ``msg % args`` unless ``cause`` was logged less than ``interval_s`` ago.

        Returns True when the line was written. ``cause`` is any hashable value naming the
        kind of fault (an errno, an exception type, a (row, errno) pair ...).
        """
        now = time.monotonic()
        with self._lock:
            self.counts[cause] = self.counts.get(cause, 0) + 1
            state = self._state.get(cause)
            if state is not None and (
                math.isinf(self.interval_s) or now - state[0] < self.interval_s
            ):
                state[1] += 1
                return False
            suppressed = int(state[1]) if state is not None else 0
            self._state[cause] = [now, 0]
        if suppressed:
            held = f"{suppressed} similar message(s) suppressed in the last {self.interval_s:g} s"
            msg = f"{msg} ({held})"
        self.logger.log(level, msg, *args, **kwargs)  # type: ignore[arg-type]
        return True

    def warning(self, cause: object, msg: str, *args: object, **kwargs: object) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, cause, msg, *args, **kwargs)

    def error(self, cause: object, msg: str, *args: object, **kwargs: object) -> bool:
        """:meth:`log` at ERROR."""
        return self.log(logging.ERROR, cause, msg, *args, **kwargs)


__all__ = ["RateLimitedLog"]
