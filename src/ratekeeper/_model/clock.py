"""Where time comes from.

By default every decision uses the store's clock (Redis ``TIME``; the process clock for the
memory backend), so hosts with skewed clocks agree. A ``clock`` passed to a limiter replaces it
with client time: for managed servers that forbid ``TIME`` in scripts, and for tests, which move
a :class:`ManualClock` instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Clock", "ManualClock", "system_clock"]

#: A clock returns seconds since the Unix epoch, like ``time.time``.
Clock = Callable[[], float]


def system_clock() -> float:
    """The host's wall clock."""
    return time.time()


class ManualClock:
    """A clock that moves only when told to. Thread-safe.

    >>> clock = ManualClock(1_700_000_000.0)
    >>> clock.advance(1.5)
    >>> clock()
    1700000001.5
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move forward by ``seconds`` (>= 0)."""
        if seconds < 0:
            raise ValueError("a ManualClock never goes backwards")
        with self._lock:
            self._now += seconds

    def set(self, now: float) -> None:
        """Jump to ``now`` seconds since the epoch."""
        with self._lock:
            self._now = now
