"""Concurrency leases on every backend (memory, Redis, Valkey) and both APIs (sync, async).

Time is a ManualClock passed to the limiter, so lease expiry is tested by moving the clock, not
by waiting. A lease is ``acquire``d, held, then ``release``d; one never released (a crashed
holder) frees its units when the policy's period, the lease timeout, has passed.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from ratekeeper import AsyncLease, ConfigError, Decision, Lease, ManualClock, Policy
from ratekeeper._engine.keys import Identity

from ..conftest import MakeLimiter
from ..support import workers

START = 1_700_000_000.0


class HeldLease:
    """A blocking face of an AsyncLease, run on the driver's event loop."""

    def __init__(self, lease: AsyncLease, loop: asyncio.AbstractEventLoop) -> None:
        self.lease = lease
        self.loop = loop

    @property
    def allowed(self) -> bool:
        return self.lease.allowed

    @property
    def decision(self) -> Decision:
        return self.lease.decision

    @property
    def held(self) -> bool:
        return self.lease.held

    def release(self) -> bool:
        return self.loop.run_until_complete(self.lease.release())


class Leases:
    """acquire / peek / release with blocking calls on either API, and a look at the stored key.

    ``limiter`` is what ``make_limiter`` built: a ``Limiter`` or conftest's ``AsyncDriver``.
    """

    def __init__(self, limiter: Any, api: str, backend: str, clock: ManualClock) -> None:
        self.limiter = limiter
        self.api = api
        self.backend = backend
        self.clock = clock
        self.client = None if backend == "memory://" else redis.Redis.from_url(backend)

    def acquire(self, policy: Policy, identity: Identity, cost: int = 1) -> Any:
        if self.api == "sync":
            lease = self.limiter.acquire(policy, identity, cost)
            assert isinstance(lease, Lease)
            return lease
        acquiring = self.limiter.limiter.acquire(policy, identity, cost)

        async def take() -> AsyncLease:
            return await acquiring

        lease = self.limiter.loop.run_until_complete(take())
        assert isinstance(lease, AsyncLease)
        return HeldLease(lease, self.limiter.loop)

    def peek(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        return self.limiter.peek(policy, identity, cost)

    def hit(self, policy: Policy, identity: Identity) -> Decision:
        return self.limiter.hit(policy, identity)

    def key(self, policy: Policy, identity: Identity) -> str:
        (key,) = self.limiter.keys(policy, identity)
        return key

    def pttl(self, policy: Policy, identity: Identity) -> int:
        """Milliseconds the identity's key has left in the store; -2 when it does not exist."""
        key = self.key(policy, identity)
        if self.client is not None:
            return int(self.client.pttl(key))
        storage = self.limiter.storage if self.api == "sync" else self.limiter.limiter.storage.sync
        return int(storage.pttl(key))

    def members(self, policy: Policy, identity: Identity) -> int | None:
        """Members of the lease sorted set, live or expired (servers only; None in memory)."""
        if self.client is None:
            return None
        return int(self.client.zcard(self.key(policy, identity)))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START)


@pytest.fixture
def leases(
    make_limiter: MakeLimiter, backend: str, api: str, key_prefix: str, clock: ManualClock
) -> Iterator[Leases]:
    options = workers.exact_options(key_prefix, server=backend != "memory://")
    made = Leases(make_limiter(clock=clock, **options), api, backend, clock)
    yield made
    made.close()


def _free(leases: Leases, policy: Policy, identity: Identity) -> int:
    decision = leases.peek(policy, identity)
    return decision.remaining


def test_a_lease_expires_after_the_timeout_and_frees_its_units(leases: Leases):
    """A lease lives exactly its timeout: then its unit is free again, and releasing it late
    returns False without touching the lease that took its place."""
    policy = Policy("jobs", "2 per 10 seconds", algorithm="concurrency")
    clock = leases.clock
    first = leases.acquire(policy, "t")
    assert first.allowed
    assert first.held
    assert first.decision.remaining == 1
    assert first.decision.reset_after == 10.0
    clock.advance(4)
    second = leases.acquire(policy, "t")
    assert second.allowed
    assert second.decision.remaining == 0
    assert second.decision.reset_after == 10.0  # until every lease held now has expired

    denied = leases.acquire(policy, "t")
    assert not denied.allowed
    assert not denied.held
    assert denied.decision.remaining == 0
    assert denied.decision.retry_after == 6.0  # when the first lease expires

    clock.advance(5.99)  # 9.99 s after the first lease: both still held
    assert not leases.peek(policy, "t").allowed
    assert _free(leases, policy, "t") == 0

    clock.set(START + 10)  # the first lease's timeout: it has expired
    assert _free(leases, policy, "t") == 1
    third = leases.acquire(policy, "t")
    assert third.allowed
    assert third.decision.remaining == 0
    assert third.decision.retry_after is None

    clock.set(START + 14)  # the second lease's timeout
    assert _free(leases, policy, "t") == 1
    assert third.release() is True
    assert _free(leases, policy, "t") == 2


def test_releasing_an_expired_lease_returns_false_and_frees_nothing(leases: Leases):
    """A holder that releases after its timeout learns that its lease had expired (False), and
    its late release does not free the unit another holder has taken since.

    The bug this catches: the release of an expired lease is answered {0, remaining, reset, -1}
    (not held; retry -1, as nothing waits), and ``Core.decision_of`` skipped every rate of a denied
    reply whose retry is -1, was left with no rate and raised ``ValueError: not enough values
    to unpack`` from ``lease.release()`` (and from leaving a ``with`` block late), on every
    backend.
    """
    policy = Policy("late", "1 per 10 seconds", algorithm="concurrency")
    first = leases.acquire(policy, "l")
    assert first.allowed
    leases.clock.advance(10)  # the first lease has expired
    second = leases.acquire(policy, "l")
    assert second.allowed
    assert first.release() is False  # it had expired
    assert not first.held
    assert _free(leases, policy, "l") == 0  # ... and the late release freed nothing
    assert second.release() is True
    assert _free(leases, policy, "l") == 1
    assert leases.pttl(policy, "l") == -2  # the last release deleted the key


def test_releasing_a_lease_nobody_replaced_after_expiry_returns_false(leases: Leases):
    """The same without a successor: the expired lease's release answers False."""
    policy = Policy("late-alone", "2 per 10 seconds", algorithm="concurrency")
    lease = leases.acquire(policy, "l")
    assert lease.allowed
    leases.clock.advance(11)
    assert lease.release() is False
    assert _free(leases, policy, "l") == 2


def test_a_crashed_holder_does_not_leak_beyond_the_timeout(leases: Leases):
    """Leases never released (their holder died) free themselves at the timeout, all of them,
    and the store drops the key by itself soon after."""
    policy = Policy("crash", "3 per 30 seconds", algorithm="concurrency")
    clock = leases.clock
    started = time.monotonic()
    held = [leases.acquire(policy, "c") for _ in range(3)]
    assert all(lease.allowed for lease in held)
    del held  # the holder is gone: nothing releases on garbage collection
    gc.collect()
    assert leases.members(policy, "c") in (None, 3)
    ttl = leases.pttl(policy, "c")
    # The key outlives its longest lease by the 1 s margin, and no more. A server's TTL runs in
    # real time: what has passed since the first acquire (long on a loaded machine) is gone.
    elapsed_ms = (time.monotonic() - started) * 1000
    assert 30_000 - elapsed_ms < ttl <= 31_000

    denied = leases.acquire(policy, "c")
    assert not denied.allowed
    assert denied.decision.retry_after == 30.0
    clock.advance(29.5)
    denied = leases.acquire(policy, "c")
    assert not denied.allowed
    assert denied.decision.retry_after == 0.5
    assert _free(leases, policy, "c") == 0

    clock.advance(0.5)
    assert _free(leases, policy, "c") == 3
    fresh = [leases.acquire(policy, "c") for _ in range(4)]
    assert [lease.allowed for lease in fresh] == [True, True, True, False]
    # Acquiring pruned the dead leases: only the three live ones remain stored.
    assert leases.members(policy, "c") in (None, 3)
    assert [lease.release() for lease in fresh] == [True, True, True, False]
    assert leases.pttl(policy, "c") == -2


def test_leases_taken_at_different_times_expire_one_by_one(leases: Leases):
    policy = Policy("staggered", "3 per 30 seconds", algorithm="concurrency")
    clock = leases.clock
    for _ in range(3):
        assert leases.acquire(policy, "s").allowed
        clock.advance(10)
    # Leases taken at 0, 10 and 20 s; now is 30 s: the first has just expired.
    assert _free(leases, policy, "s") == 1
    clock.advance(10)
    assert _free(leases, policy, "s") == 2
    clock.advance(9.5)
    assert _free(leases, policy, "s") == 2
    clock.advance(0.5)
    assert _free(leases, policy, "s") == 3


def test_cost_weighted_leases(leases: Leases):
    """A lease of cost 3 out of 5 leaves 2; another of 3 does not fit; releasing frees 3."""
    policy = Policy("weighted", "5 per minute", algorithm="concurrency")
    big = leases.acquire(policy, "w", cost=3)
    assert big.allowed
    assert big.decision.remaining == 2
    assert leases.members(policy, "w") in (None, 3)  # one member per unit

    too_big = leases.acquire(policy, "w", cost=3)
    assert not too_big.allowed
    assert too_big.decision.remaining == 2
    assert too_big.decision.retry_after == 60.0
    assert too_big.release() is False

    small = leases.acquire(policy, "w", cost=2)
    assert small.allowed
    assert small.decision.remaining == 0
    assert not leases.peek(policy, "w").allowed

    assert big.release() is True
    assert _free(leases, policy, "w") == 3
    assert leases.peek(policy, "w", cost=3).allowed
    assert not leases.peek(policy, "w", cost=4).allowed
    again = leases.acquire(policy, "w", cost=3)
    assert again.allowed
    assert again.decision.remaining == 0

    never = leases.acquire(policy, "w", cost=6)
    assert not never.allowed
    assert never.decision.retry_after == math.inf

    assert small.release() is True
    assert again.release() is True
    assert _free(leases, policy, "w") == 5
    assert leases.pttl(policy, "w") == -2


def test_a_denied_lease_releases_nothing(leases: Leases):
    """release() of a denied lease returns False and does not free the holder's unit, nor
    does leaving a denied lease's context; releasing twice frees once."""
    policy = Policy("single", "1 per minute", algorithm="concurrency")
    holder = leases.acquire(policy, "d")
    assert holder.allowed
    denied = leases.acquire(policy, "d")
    assert not denied.allowed
    assert not denied.held
    assert denied.release() is False
    assert denied.release() is False
    assert _free(leases, policy, "d") == 0
    assert holder.held

    assert holder.release() is True
    assert not holder.held
    successor = leases.acquire(policy, "d")
    assert successor.allowed
    assert holder.release() is False  # idempotent: it cannot free the successor's unit
    assert _free(leases, policy, "d") == 0
    assert successor.release() is True
    assert _free(leases, policy, "d") == 1


def test_peek_reports_free_units_and_takes_nothing(leases: Leases):
    policy = Policy("peeked", "4 per minute", algorithm="concurrency")
    clock = leases.clock
    for _ in range(3):
        decision = leases.peek(policy, "p")
        assert decision.allowed
        assert decision.limit == 4
        assert decision.remaining == 4
        assert decision.reset_after == 0.0
    assert leases.pttl(policy, "p") == -2  # peeks write nothing

    lease = leases.acquire(policy, "p", cost=3)
    assert lease.allowed
    clock.advance(15)
    decision = leases.peek(policy, "p")
    assert decision.allowed
    assert decision.remaining == 1
    assert decision.reset_after == 45.0
    assert leases.peek(policy, "p", cost=1).allowed
    two = leases.peek(policy, "p", cost=2)
    assert not two.allowed
    assert two.remaining == 1
    assert two.retry_after == 45.0
    assert _free(leases, policy, "p") == 1  # still: peeking took nothing

    assert lease.release() is True
    assert _free(leases, policy, "p") == 4


def _scoped(leases: Leases, policy: Policy, identity: str, fail: bool) -> tuple[Any, int]:
    """Take a lease with ``with`` (sync) or ``async with`` (async), peek inside the block, and
    raise RuntimeError from it if ``fail``. Returns the lease and the free units seen inside."""
    seen: list[int] = []
    if leases.api == "sync":
        try:
            with leases.limiter.acquire(policy, identity) as lease:
                seen.append(leases.limiter.peek(policy, identity).remaining)
                if fail:
                    raise RuntimeError("the work failed")
        except RuntimeError:
            assert fail
        return lease, seen[0]

    limiter = leases.limiter.limiter

    async def main() -> AsyncLease:
        try:
            async with limiter.acquire(policy, identity) as lease:
                seen.append((await limiter.peek(policy, identity)).remaining)
                if fail:
                    raise RuntimeError("the work failed")
        except RuntimeError:
            assert fail
        return lease

    return leases.limiter.loop.run_until_complete(main()), seen[0]


@pytest.mark.parametrize("fail", [False, True], ids=["body-returns", "body-raises"])
def test_a_lease_scope_releases_on_exit(leases: Leases, fail: bool):
    """``with limiter.acquire(...)`` / ``async with limiter.acquire(...)`` hold the lease for
    the block and release it on the way out, also when the block raises."""
    policy = Policy("scoped", "2 per minute", algorithm="concurrency")
    lease, inside = _scoped(leases, policy, "s", fail)
    assert lease.allowed
    assert inside == 1
    assert not lease.held
    assert _free(leases, policy, "s") == 2
    assert leases.pttl(policy, "s") == -2


def test_a_denied_lease_scope_leaves_the_holders_alone(leases: Leases):
    policy = Policy("scoped-denied", "1 per minute", algorithm="concurrency")
    holder = leases.acquire(policy, "s")
    assert holder.allowed
    lease, inside = _scoped(leases, policy, "s", fail=False)
    assert not lease.allowed
    assert inside == 0
    assert _free(leases, policy, "s") == 0
    assert holder.held
    assert holder.release() is True


def test_hit_and_acquire_are_not_interchangeable(leases: Leases):
    concurrency = Policy("conc", "2 per minute", algorithm="concurrency")
    counted = Policy("counted", "2 per minute", algorithm="gcra")
    with pytest.raises(ConfigError, match="acquire"):
        leases.hit(concurrency, "x")
    with pytest.raises(ConfigError, match="hit"):
        leases.acquire(counted, "x")
    assert _free(leases, concurrency, "x") == 2
    assert leases.peek(counted, "x").remaining == 2


def test_identities_hold_leases_independently(leases: Leases):
    policy = Policy("tenants", "1 per minute", algorithm="concurrency")
    first = leases.acquire(policy, "tenant-1")
    second = leases.acquire(policy, "tenant-2")
    assert first.allowed
    assert second.allowed
    assert not leases.acquire(policy, "tenant-1").allowed
    assert first.release() is True
    assert _free(leases, policy, "tenant-1") == 1
    assert _free(leases, policy, "tenant-2") == 0
    assert second.release() is True
