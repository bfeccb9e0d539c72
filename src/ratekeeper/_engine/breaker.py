"""A circuit breaker for the store: stop calling a store that fails or is slow, probe, recover.

States::

    closed ──(errors or slow calls over threshold)──▶ open ──(open_for elapsed)──▶ half_open
      ▲                                               ▲                              │
      └──────────(probes calls in a row succeed)──────┼──────────────────────────────┘
                                                      └──(a probe fails or is slow)──┘

* **one fault, one failure**: a failure is counted only if its call was sent after the last
  counted failure became known (``record``'s ``sent``). The timeouts of calls in flight together
  during one stall, or every call of one failed batch, are one failure, not one per caller; a
  store that stays down fails the next calls too, and those count.
* **closed**: every call goes to the store. Outcomes are counted in a sliding window of
  ``window`` seconds (ten buckets). The breaker opens when at least ``min_calls`` calls are in
  the window and the share of failures reaches ``failure_ratio`` or the share of calls slower
  than ``slow_call`` reaches ``slow_ratio``; or at once after ``consecutive_failures`` failures
  in a row (a dead store is seen within a few timeouts, not after a window).
* **open**: no store calls at all for ``open_for`` seconds.
* **half_open**: one probe at a time. ``probes`` good calls in a row close the breaker; a failed
  or slow probe opens it again.
* **hysteresis**: each re-opening within ``window`` of the last closing doubles ``open_for``, up
  to ``max_open_for``, so a flapping store causes at most one open/close cycle per interval; a
  breaker that stays closed for ``window`` forgets the back-off.

The clock is injected (``time.monotonic`` by default) so tests move time instead of sleeping.
Thread-safe; no I/O, so the asyncio limiter uses it as is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

from .._model.errors import ConfigError

__all__ = ["BreakerState", "CircuitBreaker"]

_BUCKETS = 10


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    def __str__(self) -> str:
        return self.value


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"breaker {name} must be a positive number, got {value!r}")
    return float(value)


def _ratio(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"breaker {name} must be in (0, 1], got {value!r}")
    return float(value)


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"breaker {name} must be an int >= 1, got {value!r}")
    return value


class CircuitBreaker:
    """Decides whether a call may go to the store, from the outcomes of recent calls."""

    def __init__(
        self,
        *,
        window: float = 10.0,
        min_calls: int = 20,
        failure_ratio: float = 0.5,
        slow_call: float = 0.020,
        slow_ratio: float = 0.8,
        consecutive_failures: int = 5,
        open_for: float = 0.5,
        max_open_for: float = 1.0,
        probes: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window = _positive("window", window)
        self.min_calls = _count("min_calls", min_calls)
        self.failure_ratio = _ratio("failure_ratio", failure_ratio)
        self.slow_call = _positive("slow_call", slow_call)
        self.slow_ratio = _ratio("slow_ratio", slow_ratio)
        self.consecutive_failures = _count("consecutive_failures", consecutive_failures)
        self.base_open_for = _positive("open_for", open_for)
        self.max_open_for = _positive("max_open_for", max_open_for)
        if self.max_open_for < self.base_open_for:
            raise ConfigError("breaker max_open_for must be >= open_for")
        self.probes = _count("probes", probes)
        self._clock = clock
        self._settings: dict[str, Any] = {
            "window": window,
            "min_calls": min_calls,
            "failure_ratio": failure_ratio,
            "slow_call": slow_call,
            "slow_ratio": slow_ratio,
            "consecutive_failures": consecutive_failures,
            "open_for": open_for,
            "max_open_for": max_open_for,
            "probes": probes,
            "clock": clock,
        }
        self._lock = threading.Lock()
        self._delivering = threading.RLock()
        self._listeners: list[Callable[[BreakerState, BreakerState], None]] = []
        self._events: list[tuple[BreakerState, BreakerState]] = []
        self._state = BreakerState.CLOSED
        #: Whether the state is closed (every call goes to the store): read without a lock.
        self.closed = True
        self._open_for = self.base_open_for
        self._opened_at = 0.0
        self._closed_at = -float("inf")
        self._probe_in_flight = False
        self._probe_started = 0.0
        self._good_probes = 0
        self._streak = 0
        #: When the last counted failure became known, in the callers' ``sent`` time.
        self._fault_known = -float("inf")
        self._bucket_span = self.window / _BUCKETS
        self._bucket_index = 0
        self._buckets = [[0, 0, 0] for _ in range(_BUCKETS)]  # calls, failures, slow
        self._totals = [0, 0, 0]  # the same, summed over the buckets

    # -- public --------------------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        """The current state (an open breaker whose time is up reads as half_open)."""
        with self._lock:
            self._tick(self._clock())
            state = self._state
        self._flush()
        return state

    @property
    def open_for(self) -> float:
        """How long the next opening lasts, in seconds (grows with flapping)."""
        with self._lock:
            self._tick(self._clock())
            open_for = self._open_for
        self._flush()
        return open_for

    def retry_after(self) -> float:
        """Seconds until the breaker lets a probe through (0 unless open)."""
        with self._lock:
            now = self._clock()
            self._tick(now)
            wait = 0.0
            if self._state is BreakerState.OPEN:
                wait = max(self._opened_at + self._open_for - now, 0.0)
        self._flush()
        return wait

    def like(self) -> CircuitBreaker:
        """A new breaker, closed, with this one's settings and clock (no history, no
        listeners): one per failure domain, configured once."""
        return CircuitBreaker(**self._settings)

    def add_listener(self, listener: Callable[[BreakerState, BreakerState], None]) -> None:
        """Call ``listener(old, new)`` on every transition."""
        self._listeners.append(listener)

    def allow(self) -> bool:
        """Whether a call may go to the store now. In half_open, admits one probe at a time."""
        if self._state is BreakerState.CLOSED:
            # Closed lets every call through; the lock would only order this read against a
            # concurrent opening, which may as well have happened a moment later.
            return True
        with self._lock:
            now = self._clock()
            self._tick(now)
            # half_open: one probe in flight; a probe that never reported (its caller died)
            # stops blocking others after open_for.
            probing = self._probe_in_flight and now - self._probe_started < self._open_for
            state: BreakerState = self._state  # another thread may have closed it meanwhile
            if state is BreakerState.CLOSED:
                allowed = True
            elif state is BreakerState.OPEN or probing:
                allowed = False
            else:
                self._probe_in_flight = True
                self._probe_started = now
                allowed = True
        if self._events:
            self._flush()
        return allowed

    def record(self, ok: bool, latency: float, sent: float | None = None) -> None:
        """Report a call's outcome: ``ok`` is False for errors and timeouts. ``sent``: when the
        call was sent, on any clock of the caller's that moves with real time (``latency``
        after it, its outcome was known). A failed call sent before the last counted failure
        was known is part of that fault, and is not counted again (None: always counted)."""
        slow = latency > self.slow_call
        if not ok and sent is not None:
            known = sent + latency
            with self._lock:
                if sent < self._fault_known:
                    return  # in flight when the fault was seen: the same fault
                self._fault_known = known
        with self._lock:
            now = self._clock()
            if self._state is not BreakerState.CLOSED or self._open_for > self.base_open_for:
                self._tick(now)  # nothing to do while closed at the base wait
            if self._state is BreakerState.HALF_OPEN:
                self._probe_in_flight = False
                if ok and not slow:
                    self._good_probes += 1
                    if self._good_probes >= self.probes:
                        self._move(BreakerState.CLOSED, now)
                else:
                    self._move(BreakerState.OPEN, now)
            elif self._state is BreakerState.CLOSED and self._counts_open(now, ok, slow):
                self._move(BreakerState.OPEN, now)
            # OPEN: a late reply from a call made before opening; it changes nothing.
        if self._events:
            self._flush()

    def reset(self) -> None:
        """Close the breaker and forget all history."""
        with self._lock:
            self._move(BreakerState.CLOSED, self._clock())
            self._open_for = self.base_open_for
            self._closed_at = -float("inf")
        self._flush()

    # -- internals (lock held) -----------------------------------------------------------

    def _tick(self, now: float) -> None:
        if self._state is BreakerState.OPEN and now - self._opened_at >= self._open_for:
            self._state = BreakerState.HALF_OPEN
            self.closed = False
            self._good_probes = 0
            self._probe_in_flight = False
            self._events.append((BreakerState.OPEN, BreakerState.HALF_OPEN))
        elif (
            self._state is BreakerState.CLOSED
            and self._open_for > self.base_open_for
            and now - self._closed_at >= self.window
        ):
            self._open_for = self.base_open_for

    def _rotate(self, now: float) -> list[int]:
        index = int(now // self._bucket_span)
        if index != self._bucket_index:
            stale = min(index - self._bucket_index, _BUCKETS)
            totals = self._totals
            for step in range(1, stale + 1):
                slot = (self._bucket_index + step) % _BUCKETS
                old = self._buckets[slot]
                totals[0] -= old[0]
                totals[1] -= old[1]
                totals[2] -= old[2]
                self._buckets[slot] = [0, 0, 0]
            self._bucket_index = index
        return self._buckets[index % _BUCKETS]

    def _counts_open(self, now: float, ok: bool, slow: bool) -> bool:
        """Count a call of the closed state; whether the breaker must open now."""
        bucket, totals = self._rotate(now), self._totals
        bucket[0] += 1
        totals[0] += 1
        if not ok:
            bucket[1] += 1
            totals[1] += 1
            self._streak += 1
            if self._streak >= self.consecutive_failures:
                return True
        else:
            self._streak = 0
        if slow:
            bucket[2] += 1
            totals[2] += 1
        calls, failures, slow_calls = totals
        if calls < self.min_calls:
            return False
        return failures >= self.failure_ratio * calls or slow_calls >= self.slow_ratio * calls

    def _move(self, new: BreakerState, now: float) -> None:
        old = self._state
        if new is BreakerState.OPEN:
            # Hysteresis: a failed probe, or an opening soon after closing, doubles the wait.
            if old is BreakerState.HALF_OPEN or now - self._closed_at < self.window:
                self._open_for = min(self._open_for * 2, self.max_open_for)
            self._opened_at = now
        elif new is BreakerState.CLOSED:
            self._closed_at = now
        self._state = new
        self.closed = new is BreakerState.CLOSED
        self._streak = 0
        self._good_probes = 0
        self._probe_in_flight = False
        self._buckets = [[0, 0, 0] for _ in range(_BUCKETS)]
        self._totals = [0, 0, 0]
        if old is not new:
            self._events.append((old, new))

    def _flush(self) -> None:
        """Tell listeners about transitions, in the order they happened; called with the lock
        released. One thread delivers at a time (a listener may read the breaker again on its
        own thread): two threads that each took their events could otherwise tell them out of
        order."""
        with self._delivering:
            with self._lock:
                events, self._events = self._events, []
            for old, new in events:
                for listener in self._listeners:
                    listener(old, new)
