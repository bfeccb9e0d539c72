"""The decision path, written once and without I/O: deny cache, breaker, store call, decide,
heartbeat, metrics.

Each method returns the steps of one operation: a generator that yields what the store must do
and returns the result (or, for ``hit``, a cached denial at once: no step at all). A driver runs
the steps on its storage and sends each outcome back (the reply, or the StorageError or
RequestRejected raised) until the generator returns. ``Limiter`` and ``AsyncLimiter`` are the
two drivers; nothing but moving outcomes lives in them, so the blocking and asyncio limiters
cannot decide apart.

The steps:

* a ``Call`` (or a fleet heartbeat's ``Run``): run ``script`` on ``keys`` with ``args``; the
  reply is sent back, or the StorageError or RequestRejected the storage raised (a store
  fault is an outcome the path decides on; anything else the storage raises is a bug, and
  reaches the caller through the driver);
* a ``Later``: steps of their own that the caller's result does not wait for (a fleet
  heartbeat, after the decision is made). The blocking driver runs them in place, the asyncio
  driver in a task; nothing is sent back.

One call's path::

    breaker of the key's node -> cached denial or open breaker answers?    (no store call)
    -> the store call -> its outcome to the breaker and the metrics -> the decision
    -> a fleet heartbeat if one is due -> the decision
"""

from __future__ import annotations

from collections.abc import Generator
from time import perf_counter
from typing import Any, NamedTuple

from .._algorithms.policy import Policy
from .._algorithms.scripts import Script
from .._model.decision import Decision
from .._model.errors import RequestRejected, StorageError
from .breaker import CircuitBreaker
from .core import Call, Core
from .fleet import Fleet
from .guard import Guard
from .keys import Identity
from .top import TopOffenders

__all__ = ["Later", "Path", "Run", "Steps"]

#: What a storage raises that the path decides on: a store fault, or a refused request.
_FAULTS = (StorageError, RequestRejected)


class Run(NamedTuple):
    """A store call that decides nothing (a fleet heartbeat)."""

    script: Script
    keys: tuple[str, ...]
    args: tuple[int | str, ...]


class Later:
    """Steps the caller's result does not wait for: run in place (blocking) or in a task."""

    __slots__ = ("fleet", "steps")

    def __init__(self, steps: Steps, fleet: Fleet) -> None:
        self.steps = steps
        self.fleet = fleet  # tracks the asyncio driver's task (``Fleet.join``)


#: The steps of one operation: yields ``Call``, ``Run`` or ``Later``, is sent store replies.
Steps = Generator["Call | Run | Later", Any, Any]


class Path:
    """Builds the steps of every limiter operation from the core (calls, replies) and the
    guard (cache, breakers, failure modes, metrics)."""

    __slots__ = ("core", "guard", "top")

    def __init__(self, core: Core, guard: Guard, top: TopOffenders | None = None) -> None:
        self.core = core
        self.guard = guard
        self.top = top

    def hit(self, policy: Policy, identity: Identity, cost: int) -> Decision | Steps:
        """A cached denial, or the steps of a hit."""
        core = self.core
        guard = self.guard
        if (
            cost == 1
            and type(cost) is int
            and type(policy) is Policy
            and policy.algorithm in guard.cacheable
        ):
            keys = core.keys_of(policy, identity)
            cached = guard.cached(keys[0])
            if cached is not None:  # a flood on a denied key: no call is even built
                if self.top is not None:
                    self.top.record(policy, identity, 1)
                return cached
            return self.steps_of(core.hit_call(policy, identity, 1, keys), True, identity)
        return self.steps_of(core.hit_call(policy, identity, cost), False, identity)

    def peek(self, policy: Policy, identity: Identity, cost: int) -> Steps:
        return self.steps_of(self.core.peek_call(policy, identity, cost))

    def acquire(self, policy: Policy, identity: Identity, cost: int) -> Call:
        """The call that takes a lease (checked now): ``decide`` it, and give it to
        ``release`` later."""
        return self.core.acquire_call(policy, identity, cost)

    def release(self, acquired: Call, identity: Identity) -> Steps:
        """The steps of giving back the lease ``acquired`` took (``allowed``: it was still
        held)."""
        return self.steps_of(self.core.release_call(acquired, identity))

    def reserve(self, call: Call) -> Steps:
        """The steps of the reservation ``call`` (from ``core.reserve_call``, checked already):
        its decision and its stamp (None when the store reserved nothing)."""
        decide = self.steps_of(call)
        stamp: int | None = None
        try:
            step = next(decide)
            while True:
                outcome = yield step
                if step is call and isinstance(outcome, list):
                    stamp = self.core.stamp(call, outcome)
                step = decide.send(outcome)
        except StopIteration as done:
            decision: Decision = done.value
            return decision, stamp if decision.allowed and not decision.degraded else None

    @staticmethod
    def resumed(call: Call) -> Decision:
        """The decision a resumed reservation stands for: admitted (it was, where it was
        made); the settle says where the identity stands."""
        rate = call.policy.rates[0]
        return Decision(
            allowed=True,
            limit=rate.limit,
            remaining=0,
            reset_after=0.0,
            retry_after=None,
            policy=call.policy.name,
            rate=rate,
        )

    def settle(self, reserved: Call, stamp: int | None, actual: int) -> Steps:
        """The steps of settling the reservation ``reserved`` for ``actual``."""
        return self.steps_of(self.core.settle_call(reserved, stamp, actual))

    def charge(self, policy: Policy, identity: Identity, cost: int) -> Steps:
        """The steps of charging ``cost`` whatever the limit."""
        return self.steps_of(self.core.charge_call(policy, identity, cost))

    def reset(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        """The keys to delete, with every local trace of them forgotten first."""
        keys = self.core.reset_keys(policy, identity)
        self.guard.forget(keys)
        return keys

    def steps_of(
        self, call: Call, cache_asked: bool = False, identity: Identity | None = None
    ) -> Steps:
        """The steps of one decision (``cache_asked``: the deny cache was asked already;
        ``identity``: a hit's, counted among the top offenders when the store denies it)."""
        guard = self.guard
        breaker = guard.breaker if guard.one_breaker else guard.breaker_of(call.keys[0])
        if not (cache_asked and breaker.closed):  # else nothing answers but the store
            early = guard.before(call, breaker, cache_asked)
            if early is not None:
                return early
        started = perf_counter()
        reply = yield call
        if isinstance(reply, _FAULTS):
            if isinstance(reply, RequestRejected):
                guard.rejected(started, breaker)
                raise reply
            return guard.failed(call, reply, started, breaker)
        decision = guard.succeeded(call, reply, started, breaker)
        if not decision.allowed and identity is not None and self.top is not None:
            self.top.record(call.policy, identity, call.cost)
        fleet = guard.fleet
        if fleet is not None:  # local_share="auto": a heartbeat when one is due
            beat = self._beat(fleet)
            if beat is not None:
                yield Later(beat, fleet)
        return decision

    def merge_top(self, run: Run) -> Steps:
        """The steps of merging the top offenders' summary of one policy (``run``, from
        ``TopOffenders.drain``): like a heartbeat, sent only through a closed breaker, its
        failure told (and its counts lost), never raised."""
        guard = self.guard
        breaker = guard.breaker_of(run.keys[0])
        if not guard.beat_allowed(breaker):
            return
        started = perf_counter()
        reply = yield run
        if isinstance(reply, _FAULTS):
            guard.beat_failed(reply, started, breaker, "a merge of the top offenders")
        else:
            guard.beat_succeeded(started, breaker)

    def _beat(self, fleet: Fleet) -> Steps | None:
        """The steps of a fleet heartbeat, if one is due and the breaker of its node is
        closed (a heartbeat is never a half-open probe)."""
        guard = self.guard
        breaker = guard.breaker_of(fleet.key)
        if not guard.beat_allowed(breaker):
            return None
        due = fleet.due()
        if due is None:
            return None
        return self._beating(fleet, Run(*due), breaker)

    def _beating(self, fleet: Fleet, run: Run, breaker: CircuitBreaker) -> Steps:
        guard = self.guard
        started = perf_counter()
        reply = yield run
        if isinstance(reply, _FAULTS):  # told, never raised
            guard.beat_failed(reply, started, breaker)
            fleet.beaten(None)
        else:
            guard.beat_succeeded(started, breaker)
            fleet.beaten(reply)
