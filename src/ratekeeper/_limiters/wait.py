"""Waiting until a limit admits a request: the rule, written once.

:func:`next_sleep` is the whole rule and does no I/O: given the last decision, the time and the
deadline, it says "return it" (``None``), "sleep this long, then hit again" (seconds), or
raises :class:`RateLimited`. :func:`wait_sync` and :func:`wait_async` only drive it, with
``time.sleep`` or ``asyncio.sleep``; ``Limiter.wait`` and ``AsyncLimiter.wait`` call them.

The rule:

* An allowed decision is returned, degraded ones included (the failure mode admitted it).
* A denial sleeps its exact ``retry_after`` plus jitter, so a fleet denied together does not
  wake together: a random extra of up to 10% of the wait, and never more than 1 s
  (``JITTER``, ``MAX_JITTER``), then hits again. A degraded denial (the ``closed`` failure
  mode) waits its ``retry_after`` like any other.
* It raises :class:`RateLimited` with the denial as soon as the next try would come after the
  deadline: at once when ``retry_after`` exceeds the time left, never after a sleep in vain.
  The jitter is cut so the last try still happens by the deadline.
* ``retry_after == math.inf`` (the cost exceeds a limit) raises at once, whatever the timeout.
* ``timeout=None`` waits as long as it takes; ``timeout=0`` is a hit that raises when denied.

Time for the deadline comes from a monotonic clock, never from the limiter's ``clock`` (that is
epoch time for the store). ``sleep``, ``monotonic`` and ``rand`` are seams for tests.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from .._algorithms.policy import Policy
from .._engine.keys import Identity
from .._model.decision import Decision
from .._model.errors import ConfigError, RateLimited

__all__ = [
    "JITTER",
    "MAX_JITTER",
    "MIN_SLEEP",
    "check_timeout",
    "jitter",
    "next_sleep",
    "timeout_of",
    "wait_async",
    "wait_sync",
]

#: The most jitter added to a wait, as a share of the wait.
JITTER = 0.1
#: The most jitter added to any wait, in seconds (a one-hour wait gets at most 1 s more).
MAX_JITTER = 1.0
#: The shortest sleep after a denial, so a denial with ``retry_after == 0`` cannot spin.
MIN_SLEEP = 0.001

Sleep = Callable[[float], object]
AsyncSleep = Callable[[float], Awaitable[object]]
Monotonic = Callable[[], float]
#: A random number in [0, 1), like ``random.random``.
Random = Callable[[], float]


class _Hits(Protocol):
    def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision: ...


class _AsyncHits(Protocol):
    def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Awaitable[Decision]: ...


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` as seconds, or None for no deadline (``math.inf`` is None too).

    Raises ConfigError for anything but None or a number >= 0.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ConfigError(f"timeout must be None or seconds >= 0, got {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ConfigError(f"timeout must be None or seconds >= 0, got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def timeout_of(wait: bool | float) -> float | None:
    """The ``wait=`` option of the decorator and the httpx transports, as a ``timeout``:
    ``False`` is 0 (hit once, raise RateLimited when denied), ``True`` is None (as long as it
    takes) and a number is the timeout in seconds. Raises ConfigError for anything else."""
    if wait is True:
        return None
    if wait is False:
        return 0.0
    try:
        if wait is None:
            raise ConfigError("None")
        return check_timeout(wait)
    except ConfigError:
        raise ConfigError(
            f"wait must be True, False or a timeout in seconds >= 0, got {wait!r}"
        ) from None


def jitter(wait: float, rand: Random) -> float:
    """The random extra added to a sleep of ``wait`` seconds: in [0, min(10% of wait, 1 s))."""
    return min(wait * JITTER, MAX_JITTER) * rand()


def next_sleep(
    decision: Decision, now: float, deadline: float | None, rand: Random
) -> float | None:
    """What to do after ``decision``, at monotonic time ``now``.

    Returns None to return the decision (it admits), or the seconds to sleep before the next
    hit; raises :class:`RateLimited` carrying ``decision`` when the next try would come after
    ``deadline`` (None: no deadline) or can never pass.
    """
    if decision.allowed:
        return None
    wait = decision.retry_after
    if wait is None or math.isinf(wait) or (deadline is not None and now + wait > deadline):
        raise RateLimited(decision)
    pause = max(wait + jitter(wait, rand), MIN_SLEEP)
    if deadline is not None:
        pause = min(pause, deadline - now)
    return pause


class _Waiter:
    """One wait: its deadline on the monotonic clock, and the seams."""

    __slots__ = ("deadline", "monotonic", "rand")

    def __init__(
        self, timeout: float | None, monotonic: Monotonic | None, rand: Random | None
    ) -> None:
        self.monotonic = time.monotonic if monotonic is None else monotonic
        self.rand = random.random if rand is None else rand
        seconds = check_timeout(timeout)
        self.deadline = None if seconds is None else self.monotonic() + seconds

    def pause(self, decision: Decision) -> float | None:
        return next_sleep(decision, self.monotonic(), self.deadline, self.rand)


def wait_sync(
    limiter: _Hits,
    policy: Policy,
    identity: Identity,
    cost: int = 1,
    timeout: float | None = None,
    *,
    sleep: Sleep | None = None,
    monotonic: Monotonic | None = None,
    rand: Random | None = None,
) -> Decision:
    """Hit until admitted, sleeping (``time.sleep`` by default) as :func:`next_sleep` says."""
    waiter = _Waiter(timeout, monotonic, rand)
    sleep = time.sleep if sleep is None else sleep
    while True:
        decision = limiter.hit(policy, identity, cost)
        pause = waiter.pause(decision)
        if pause is None:
            return decision
        sleep(pause)


async def wait_async(
    limiter: _AsyncHits,
    policy: Policy,
    identity: Identity,
    cost: int = 1,
    timeout: float | None = None,
    *,
    sleep: AsyncSleep | None = None,
    monotonic: Monotonic | None = None,
    rand: Random | None = None,
) -> Decision:
    """:func:`wait_sync` on asyncio (``asyncio.sleep`` by default)."""
    waiter = _Waiter(timeout, monotonic, rand)
    sleep = asyncio.sleep if sleep is None else sleep
    while True:
        decision = await limiter.hit(policy, identity, cost)
        pause = waiter.pause(decision)
        if pause is None:
            return decision
        await sleep(pause)
