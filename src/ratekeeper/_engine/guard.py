"""Resilience around every store call, without I/O: breaker, failure modes, deny cache, metrics.

The decision path (``_path``) asks it at each step: ``before`` the store call (a cached
denial or an open breaker answers), then ``succeeded``, ``failed`` (the failure mode, or raises)
or ``rejected``; the ``beat_*`` methods for fleet heartbeats.

One breaker per failure domain: a storage that can tell which server serves a key (a cluster's
primaries, the primary Sentinel names) has ``node_of(key)``, and each node gets a breaker made
``like`` the configured one, so a slow or dead node degrades only the keys it serves.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .._algorithms import CONSUMES, REFUND, RELEASE, SETTLES
from .._algorithms.policy import FAILURE_MODES, Policy
from .._model.clock import Clock
from .._model.decision import Decision
from .._model.errors import (
    ConfigError,
    RequestRejected,
    StorageError,
    StorageFull,
    StorageResponseError,
    StorageTimeout,
    StorageUnavailable,
)
from .._model.options import AutoShare, check_local_share
from .._model.rates import Rate
from .._storage.base import ROUND_TRIP
from .breaker import BreakerState, CircuitBreaker
from .core import _TOKENS, Call, Core
from .denycache import DenyCache, micros
from .fallback import LocalFallback
from .fleet import Fleet
from .metrics import Metrics

__all__ = ["DEFAULT_DENY_CACHE_SIZE", "Guard"]

log = logging.getLogger("ratekeeper")

DEFAULT_DENY_CACHE_SIZE = 10_000
#: Seconds a cached denial answers without asking the store again (``deny_cache_max_age``):
#: a reset or a changed limit elsewhere reaches this process within this time.
DEFAULT_DENY_CACHE_MAX_AGE = 1.0

#: Algorithms whose retry_after is a lower bound of the true wait whatever other clients do
#: (they can only add load), and exact when no one else hits the key. Concurrency leases can
#: be released early, so a cached denial could outlast the real one there. Only denials of
#: cost 1 are cached: until such a hit fits, nothing about its decision changes but the clock
#: (a larger cost's ``remaining`` can grow while it still does not fit).
_CACHEABLE = frozenset({"sliding_log", "sliding_window", "fixed_window", "gcra", "token_bucket"})


def _round_trip(started: float, now: float) -> tuple[float, float]:
    """When the store call that began at ``started`` (and ended for us at ``now``) was sent and
    answered, as the storage tells (``ROUND_TRIP``): its last round trip, from the write to the
    reply's arrival in this process. Whatever the storage does not say is ``started`` and
    ``now``; a round trip that began before ``started`` is another call's."""
    trip = ROUND_TRIP.get()
    if trip is None or trip.sent < started:
        return started, now
    sent, answered = trip.sent, trip.answered
    if not answered:  # the storage did not say
        return sent, now
    return sent, min(max(answered, sent), now)


class _Throttled:
    """Logs a warning per reason at most once per ``interval`` seconds, counting the rest."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, reason: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(reason)
            if last is not None and now - last < self.interval:
                self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
                return
            self._last[reason] = now
            suppressed = self._suppressed.pop(reason, 0)
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        log.warning("%s%s", message, more)


class Guard:
    """Everything a limiter does around a store call, shared by the sync and async limiters."""

    def __init__(
        self,
        core: Core,
        *,
        failure_mode: str = "open",
        local_share: float | str | AutoShare = 1.0,
        breaker: CircuitBreaker | None = None,
        deny_cache: int = DEFAULT_DENY_CACHE_SIZE,
        deny_cache_max_age: float = DEFAULT_DENY_CACHE_MAX_AGE,
        metrics: Metrics | None = None,
        clock: Clock | None = None,
        node_of: Callable[[str], str | None] | None = None,
    ) -> None:
        if failure_mode not in FAILURE_MODES:
            raise ConfigError(
                f"failure_mode {failure_mode!r} is unknown: "
                f"choose one of {', '.join(FAILURE_MODES)}"
            )
        share = check_local_share(local_share)
        if isinstance(deny_cache, bool) or not isinstance(deny_cache, int) or deny_cache < 0:
            raise ConfigError(
                f"deny_cache must be an int >= 0 (0 turns it off), got {deny_cache!r}"
            )
        if (
            isinstance(deny_cache_max_age, bool)
            or not isinstance(deny_cache_max_age, (int, float))
            or not 0 < deny_cache_max_age < math.inf
        ):
            raise ConfigError(
                f"deny_cache_max_age must be a number of seconds > 0, got {deny_cache_max_age!r}"
            )
        if breaker is not None and not isinstance(breaker, CircuitBreaker):
            raise ConfigError(f"breaker must be a CircuitBreaker, got {type(breaker).__name__}")
        self.core = core
        self.failure_mode = failure_mode
        self.local_share = share
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.metrics = metrics if metrics is not None else Metrics()
        #: Whether the metrics hook counts anything (the default one does not: not called on
        #: the hot path).
        self._counting = type(self.metrics) is not Metrics
        #: The hook's ``loop_lag``, if it has one (an object with Metrics' older methods may not).
        self._lag: Callable[[float], None] | None = getattr(self.metrics, "loop_lag", None)
        self.breaker.add_listener(self.metrics.breaker_transition)
        self.breaker.add_listener(self._log_transition)
        #: Which node serves a key (None: the storage has one server, or cannot tell yet).
        self._node_of = node_of
        #: One breaker for every call (a single server, ``memory://``): ``breaker``.
        self.one_breaker = node_of is None
        self._nodes: dict[str, CircuitBreaker] = {}
        self._nodes_lock = threading.Lock()
        self._clock_us = micros(clock if clock is not None else time.monotonic)
        self._deny = (
            DenyCache(deny_cache, self._clock_us, deny_cache_max_age) if deny_cache else None
        )
        #: The algorithms whose denials are cached here (none without a deny cache).
        self.cacheable = _CACHEABLE if self._deny is not None else frozenset()
        self._log = _Throttled()
        #: The ``local`` failure mode's in-process limiter, made when first needed.
        self.local: LocalFallback | None = None
        #: With ``local_share="auto"``: this limiter's heartbeats and the fleet count.
        self.fleet: Fleet | None = None
        if isinstance(share, AutoShare):
            self.fleet = Fleet(
                core.keys.fleet_key(),
                share,
                clock_us=self._clock_us,
                client_time=clock is not None,
                new_id=_TOKENS.next,
            )

    # -- the flow ------------------------------------------------------------------------

    def breaker_of(self, key: str) -> CircuitBreaker:
        """The breaker of the node that serves ``key``: the store's one breaker on a single
        server (or while the storage cannot tell), else that node's."""
        if self._node_of is None:
            return self.breaker
        node = self._node_of(key)
        if node is None:
            return self.breaker
        breaker = self._nodes.get(node)
        return breaker if breaker is not None else self._add_node(node)

    @property
    def nodes(self) -> dict[str, CircuitBreaker]:
        """The breaker of each node seen so far, by ``host:port``."""
        return dict(self._nodes)

    def _add_node(self, node: str) -> CircuitBreaker:
        with self._nodes_lock:
            breaker = self._nodes.get(node)
            if breaker is not None:
                return breaker
            breaker = self.breaker.like()
            metrics: Any = self.metrics  # an object with Metrics' methods; older ones lack these
            added = getattr(metrics, "node_breaker_added", None)
            moved = getattr(metrics, "node_breaker_transition", None)

            def transition(old: BreakerState, new: BreakerState) -> None:
                if moved is not None:
                    moved(node, old, new)
                else:
                    metrics.breaker_transition(old, new)
                self._log_transition(old, new, node)

            breaker.add_listener(transition)
            if added is not None:
                added(node)
            self._nodes[node] = breaker
            return breaker

    def cached(self, key: str, cost: int = 1) -> Decision | None:
        """A cached denial of a hit of ``cost`` on ``key``, before any call is built; or
        None."""
        if self._deny is None:
            return None
        cached = self._deny.lookup(key, cost)
        if cached is not None and self._counting:
            self.metrics.decision(cached)
        return cached

    def before(
        self, call: Call, breaker: CircuitBreaker, cache_asked: bool = False
    ) -> Decision | None:
        """A decision made without the store, or None to ask the store. ``breaker``: the
        call's (``breaker_of``). ``cache_asked``: the caller already asked ``cached`` for this
        call (the deny cache is not asked twice)."""
        if not cache_asked and self._deny is not None and call.mode in CONSUMES:
            cached = self._deny.lookup(call.keys[0], call.cost)
            if cached is not None:
                self.metrics.decision(cached)
                return cached
        if breaker.allow():
            return None
        return self._fallback(call, "breaker_open", None, breaker)

    def succeeded(
        self, call: Call, reply: list[int], started: float, breaker: CircuitBreaker
    ) -> Decision:
        now = time.perf_counter()
        elapsed = now - started
        counting = self._counting
        if elapsed > breaker.slow_call or counting:
            # Maybe not the store's time: the storage says when the call's last round trip
            # began (after a queue, a new connection or a script load) and when its reply
            # arrived (a busy event loop may have read it, and resumed us, much later).
            sent, answered = _round_trip(started, now)
            elapsed = answered - sent
            if counting:
                self.metrics.store_call(elapsed, True)
                if self._lag is not None:
                    self._lag(now - answered)
        breaker.record(True, elapsed)
        decision = self.core.decision_of(call, reply)
        mode = call.mode
        if mode in SETTLES:  # not a decision of a request: settling one made earlier
            if mode == REFUND and self._deny is not None:
                self._deny.discard(call.keys[0])  # the refund may have made room
            return decision
        if self._deny is not None and decision.allowed and mode in CONSUMES:
            self._deny.discard(call.keys[0])
        elif (
            self._deny is not None
            and not decision.allowed
            and mode in CONSUMES
            and call.cost == 1
            and call.policy.algorithm in _CACHEABLE
        ):
            # With client time the decision was made at the time we sent; with the store's
            # clock, after we sent: either way the true wait ends no earlier than this.
            given = int(call.args[0])
            sent = given if given > 0 else self._clock_us() - round(elapsed * 1_000_000)
            self._deny.store(call.keys[0], call.cost, decision, sent)
        if counting:
            self.metrics.decision(decision)
        return decision

    def failed(
        self, call: Call, exc: StorageError, started: float, breaker: CircuitBreaker
    ) -> Decision:
        started, answered = _round_trip(started, time.perf_counter())  # as in succeeded
        elapsed = answered - started
        if isinstance(exc, StorageResponseError):
            # The store answered (OOM, READONLY, CLUSTERDOWN, LOADING, ...): it is up, so the
            # breaker counts an answer, not an outage, and what the store can still deny (a
            # denial writes nothing) stays denied. Only this call is degraded; the next ones
            # go on asking, and are decided by the store the moment it can again.
            breaker.record(True, elapsed)
            self.metrics.store_call(elapsed, True)
            reason = "store_full" if isinstance(exc, StorageFull) else "store_error"
            return self._fallback(call, reason, exc, breaker)
        breaker.record(False, elapsed, started)
        self.metrics.store_call(elapsed, False)
        if isinstance(exc, StorageTimeout):
            reason = "timeout"
        elif isinstance(exc, StorageUnavailable):
            reason = "unavailable"
        else:  # a storage of the user's own raising StorageError itself
            reason = "store_error"
        return self._fallback(call, reason, exc, breaker)

    def rejected(self, started: float, breaker: CircuitBreaker) -> None:
        """The store refused the request itself (RequestRejected): it is up and answering, so
        the call counts as a good one for the breaker (and ends a half-open probe)."""
        sent, answered = _round_trip(started, time.perf_counter())
        elapsed = answered - sent
        breaker.record(True, elapsed)
        self.metrics.store_call(elapsed, True)

    # -- fleet heartbeats (local_share="auto"; their steps are ``_path``'s) --------------------

    def beat_allowed(self, breaker: CircuitBreaker) -> bool:
        """Heartbeats go only to a node the breaker trusts: never as a half-open probe."""
        return breaker.state is BreakerState.CLOSED

    def beat_succeeded(self, started: float, breaker: CircuitBreaker) -> None:
        sent, answered = _round_trip(started, time.perf_counter())
        elapsed = answered - sent
        breaker.record(True, elapsed)
        self.metrics.store_call(elapsed, True)

    def beat_failed(
        self,
        exc: StorageError | RequestRejected,
        started: float,
        breaker: CircuitBreaker,
        what: str = "a fleet heartbeat",
    ) -> None:
        """A failed heartbeat (or another call in the background, ``what``): one failed store
        call for the breaker and the metrics, logged at the bounded rate; never raised (the
        caller's decision is already made). A rejected one (someone wrote another type to the
        fleet key) means the store is up: logged as an error, and the count stays as it
        was."""
        started, answered = _round_trip(started, time.perf_counter())
        elapsed = answered - started
        rejected = isinstance(exc, (RequestRejected, StorageResponseError))
        breaker.record(rejected, elapsed, None if rejected else started)
        self.metrics.store_call(elapsed, rejected)
        if rejected:
            log.error("ratekeeper: the store rejected %s: %s", what, exc)
        else:
            self._log.warn(what, f"ratekeeper: {what} failed: {exc}")

    def forget(self, keys: tuple[str, ...]) -> None:
        """After a reset: drop cached denials of these keys, here and in the local fallback."""
        if self._deny is not None:
            self._deny.forget(keys)
        if self.local is not None:
            self.local.forget(keys)

    # -- failure modes -------------------------------------------------------------------

    def _fallback(
        self, call: Call, reason: str, exc: StorageError | None, breaker: CircuitBreaker
    ) -> Decision:
        if self._deny is not None and call.mode in CONSUMES:
            # A denial the store made, past its freshness but not its wait: still a denial.
            cached = self._deny.lookup(call.keys[0], call.cost, stale=True)
            if cached is not None:
                self.metrics.decision(cached)
                return cached
        policy = call.policy
        mode = policy.failure_mode or self.failure_mode
        if mode == "raise":
            if exc is None:
                exc = StorageUnavailable(
                    f"the circuit breaker is open: the store is not asked for "
                    f"{breaker.retry_after():.3f} s more"
                )
            raise exc
        rate = policy.rates[0]
        if call.mode in SETTLES:
            # A settle the store did not record: a refund's estimate stays counted (never
            # more admitted), a charge is lost; the failure mode's answer stands for the state.
            self._log.warn(
                reason, f"ratekeeper: a reservation could not be settled ({reason}): {exc}"
            )
            return self._degraded(policy, rate, mode == "open", None, f"{reason}/{mode}")
        if call.mode == RELEASE:
            # A lease whose release could not be recorded expires on its own.
            decision = self._degraded(policy, rate, False, None, f"{reason}/{mode}")
        elif mode == "open":
            decision = self._degraded(policy, rate, True, None, f"{reason}/open")
        elif mode == "closed":
            wait = breaker.retry_after() or breaker.open_for
            decision = self._degraded(policy, rate, False, wait, f"{reason}/closed")
        else:
            if self.local is None:
                self.local = LocalFallback(self.core, self.local_share, self.fleet)
            local = self.local.answer(call)
            if local is None:  # no fleet count yet, or a share of 0: deny, as closed does
                wait = breaker.retry_after() or breaker.open_for
                decision = self._degraded(policy, rate, False, wait, f"{reason}/local")
            else:
                decision = replace(local, degraded=True, reason=f"{reason}/local")
        self._log.warn(
            reason,
            f"ratekeeper: the store could not decide ({reason}"
            + (f": {exc}" if exc is not None else "")
            + f"); the {mode!r} failure mode did",
        )
        self.metrics.decision(decision)
        return decision

    @staticmethod
    def _degraded(
        policy: Policy, rate: Rate, allowed: bool, retry: float | None, reason: str
    ) -> Decision:
        return Decision(
            allowed=allowed,
            limit=rate.limit,
            remaining=rate.limit if allowed else 0,
            reset_after=0.0,
            retry_after=retry,
            policy=policy.name,
            rate=rate,
            degraded=True,
            reason=reason,
        )

    def _log_transition(self, old: object, new: object, node: str | None = None) -> None:
        if node is None:
            log.warning("ratekeeper: circuit breaker %s -> %s", old, new)
        else:
            log.warning("ratekeeper: circuit breaker of %s %s -> %s", node, old, new)
