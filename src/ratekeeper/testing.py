"""Helpers for testing code that uses ratekeeper; the project's own tests use them too.

* :class:`ManualClock`: time that moves only when told to, for a limiter's ``clock=`` (epoch
  seconds) or a :class:`~ratekeeper.CircuitBreaker`'s ``clock=`` (any monotonic seconds).
* :class:`FlakyStorage` / :class:`AsyncFlakyStorage`: the in-process store behind a switch, to
  test what your code does when the store fails (``down = True``) without a server.
* :class:`RecordingMetrics`: a metrics hook that keeps everything it is told.
* :func:`decision`: a :class:`~ratekeeper.Decision`, to test a 429 handler, headers or a
  ``wait()`` loop without a limiter.

>>> from ratekeeper import Limiter, Policy
>>> store = FlakyStorage(clock=ManualClock())
>>> limiter = Limiter(store, clock=store.clock, failure_mode="closed")
>>> limiter.hit(Policy("api", "2/minute"), "alice").allowed
True
>>> store.down = True
>>> limiter.hit(Policy("api", "2/minute"), "alice").reason
'unavailable/closed'
"""

from __future__ import annotations

from ._algorithms.policy import Policy
from ._algorithms.scripts import Script
from ._engine.breaker import BreakerState
from ._engine.metrics import Metrics
from ._model.clock import ManualClock
from ._model.decision import Decision
from ._model.errors import StorageError, StorageUnavailable
from ._model.rates import Rate, parse_rates
from ._storage.memory import AsyncMemoryStorage, MemoryStorage

__all__ = ["AsyncFlakyStorage", "FlakyStorage", "ManualClock", "RecordingMetrics", "decision"]


class FlakyStorage(MemoryStorage):
    """The in-process store (``memory://``) behind a switch: while ``down`` is set, every call
    fails with ``fail_with`` (a :class:`~ratekeeper.StorageUnavailable` by default) and changes
    nothing. ``calls`` counts the script calls that reached it, failed or not."""

    def __init__(
        self, *, clock: ManualClock | None = None, fail_with: StorageError | None = None
    ) -> None:
        #: The clock the store keeps time by: give the limiter the same one (``clock=``).
        self.clock = clock if clock is not None else ManualClock()
        super().__init__(clock=self.clock)
        self.fail_with = fail_with if fail_with is not None else StorageUnavailable("store down")
        self.down = False
        self.calls = 0

    def run(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> list[int]:
        self.calls += 1
        if self.down:
            raise self.fail_with
        return super().run(script, keys, args)

    def delete(self, keys: tuple[str, ...]) -> int:
        if self.down:
            raise self.fail_with
        return super().delete(keys)


class AsyncFlakyStorage(AsyncMemoryStorage):
    """:class:`FlakyStorage` for an :class:`~ratekeeper.AsyncLimiter`; ``down``, ``fail_with``
    and ``calls`` are those of ``.sync``."""

    def __init__(
        self, *, clock: ManualClock | None = None, fail_with: StorageError | None = None
    ) -> None:
        self.sync: FlakyStorage = FlakyStorage(clock=clock, fail_with=fail_with)
        self.clock = self.sync.clock


class RecordingMetrics(Metrics):
    """Keeps every decision, every store call (seconds, ok) and every breaker transition
    (node, old, new; node ``""`` for the store's one breaker)."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self.store_calls: list[tuple[float, bool]] = []
        self.transitions: list[tuple[str, BreakerState, BreakerState]] = []
        self.nodes: list[str] = []

    def decision(self, decision: Decision) -> None:
        self.decisions.append(decision)

    def store_call(self, seconds: float, ok: bool) -> None:
        self.store_calls.append((seconds, ok))

    def breaker_transition(self, old: BreakerState, new: BreakerState) -> None:
        self.transitions.append(("", old, new))

    def node_breaker_added(self, node: str) -> None:
        self.nodes.append(node)

    def node_breaker_transition(self, node: str, old: BreakerState, new: BreakerState) -> None:
        self.transitions.append((node, old, new))

    @property
    def reasons(self) -> list[str | None]:
        """Each decision's ``reason`` (None: decided by the store)."""
        return [d.reason for d in self.decisions]


def decision(
    allowed: bool = True,
    *,
    rate: str | Rate = "10/minute",
    remaining: int | None = None,
    reset_after: float = 0.0,
    retry_after: float | None = None,
    policy: str | Policy = "test",
    degraded: bool = False,
    reason: str | None = None,
) -> Decision:
    """A decision under ``rate`` (a Rate, or one rate as ``Policy`` parses it) of ``policy``
    (a Policy or its name): by default an admission with the whole limit left, or with
    ``allowed=False`` a denial with nothing left and a ``retry_after`` of the rate's period."""
    if isinstance(rate, Rate):
        parsed = rate
    else:
        (parsed,) = parse_rates(rate)
    if isinstance(policy, Policy):
        policy = policy.name
    if remaining is None:
        remaining = parsed.limit - 1 if allowed else 0
    if retry_after is None and not allowed:
        retry_after = float(parsed.period)
    return Decision(
        allowed=allowed,
        limit=parsed.limit,
        remaining=remaining,
        reset_after=reset_after,
        retry_after=retry_after,
        policy=policy,
        rate=parsed,
        degraded=degraded,
        reason=reason,
    )
