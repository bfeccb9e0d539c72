"""Failure modes against a dead store, request-caused errors, and the deny cache.

The dead store is real: a loopback port where nothing listens (connections are refused at
once), or a live server killed with SIGKILL. The breakers here run on a fake clock, so
"while the breaker is open" lasts exactly as long as a test says. Live stores are the module's
own servers (``own_server``, running again after a test kills one), so ``CONFIG RESETSTAT``
and ``INFO commandstats`` see only this module's calls.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
import redis

import ratekeeper
from ratekeeper import (
    AsyncLimiter,
    ConfigError,
    Decision,
    Limiter,
    ManualClock,
    Policy,
    StorageError,
    StorageUnavailable,
)
from ratekeeper._engine.breaker import BreakerState, CircuitBreaker
from ratekeeper._model.errors import RequestRejected

from ..support.figures import record
from ..support.servers import RedisServer, command_calls, free_port

#: Short deadlines: a dead store is detected quickly.
SHORT = {"timeout": 0.05, "connect_timeout": 0.05}
#: For live stores whose answers the test needs, on a loaded machine.
PATIENT = {"timeout": 5, "connect_timeout": 5}


def fake_breaker(**options: Any) -> tuple[CircuitBreaker, ManualClock]:
    clock = ManualClock(100.0)
    return CircuitBreaker(clock=clock, **options), clock


@pytest.fixture
def dead_url() -> str:
    """A loopback port where nothing listens."""
    return f"redis://127.0.0.1:{free_port()}/0"


@pytest.fixture
def live(own_server: RedisServer) -> RedisServer:
    """One of the module's own servers: its command statistics count this module's calls."""
    return own_server


def reasons(decisions: list[Decision]) -> list[str | None]:
    return [d.reason for d in decisions]


# --- open ----------------------------------------------------------------------------------------


def test_open_allows_degraded_then_breaker_open(dead_url: str, key_prefix: str):
    breaker, _ = fake_breaker(consecutive_failures=5)
    policy = Policy("fm-open", "2/minute")
    with Limiter.from_url(
        dead_url, key_prefix=key_prefix, failure_mode="open", breaker=breaker, **SHORT
    ) as limiter:
        decisions = [limiter.hit(policy, "a") for _ in range(12)]
        assert breaker.state is BreakerState.OPEN
    assert all(d.allowed and d.degraded for d in decisions)  # far over the limit of 2
    assert reasons(decisions) == ["unavailable/open"] * 5 + ["breaker_open/open"] * 7
    assert all(d.retry_after is None and d.limit == 2 and d.policy == "fm-open" for d in decisions)


def test_open_on_a_killed_server_with_a_pooled_connection(live: RedisServer, key_prefix: str):
    """A server that was up and dies: the pooled connection breaks, reconnects are refused."""
    breaker, _ = fake_breaker(consecutive_failures=3)
    policy = Policy("fm-killed", "2/minute")
    with Limiter.from_url(
        live.url, key_prefix=key_prefix, failure_mode="open", breaker=breaker, **SHORT
    ) as limiter:
        assert limiter.hit(policy, "a").reason is None
        assert limiter.hit(policy, "a").reason is None
        assert not limiter.hit(policy, "a").allowed  # the store enforces
        limiter.reset(policy, "a")  # no cached denial: the next hits go to the store
        live.kill()
        decisions = [limiter.hit(policy, "a") for _ in range(5)]
    assert all(d.allowed and d.degraded for d in decisions)
    assert reasons(decisions) == ["unavailable/open"] * 3 + ["breaker_open/open"] * 2


def test_a_peek_follows_the_failure_mode_too(dead_url: str, key_prefix: str):
    breaker, _ = fake_breaker()
    policy = Policy("fm-peek", "2/minute", failure_mode="closed")
    with Limiter.from_url(dead_url, key_prefix=key_prefix, breaker=breaker, **SHORT) as limiter:
        decision = limiter.peek(policy, "a")
    assert not decision.allowed
    assert decision.degraded
    assert decision.reason == "unavailable/closed"


# --- closed --------------------------------------------------------------------------------------


def test_closed_denies_with_retry_after(dead_url: str, key_prefix: str):
    breaker, clock = fake_breaker(consecutive_failures=3, open_for=2.0, max_open_for=8.0)
    policy = Policy("fm-closed", "100/minute")
    with Limiter.from_url(
        dead_url, key_prefix=key_prefix, failure_mode="closed", breaker=breaker, **SHORT
    ) as limiter:
        failing = [limiter.hit(policy, "a") for _ in range(3)]
        assert breaker.state is BreakerState.OPEN
        clock.advance(0.5)
        while_open = limiter.hit(policy, "a")
    assert reasons(failing) == ["unavailable/closed"] * 3
    for decision in [*failing, while_open]:
        assert not decision.allowed
        assert decision.degraded
        assert decision.remaining == 0
        assert decision.retry_after is not None
        assert decision.retry_after > 0
    # Before it opened: the wait of a whole opening; while open: what is left of it.
    assert failing[0].retry_after == 2.0
    assert while_open.reason == "breaker_open/closed"
    assert while_open.retry_after == pytest.approx(1.5)


# --- local ---------------------------------------------------------------------------------------


def test_local_enforces_its_share(dead_url: str, key_prefix: str):
    breaker, _ = fake_breaker(consecutive_failures=3)
    policy = Policy("fm-local", "10/minute")
    with Limiter.from_url(
        dead_url,
        key_prefix=key_prefix,
        failure_mode="local",
        local_share=0.5,
        breaker=breaker,
        **SHORT,
    ) as limiter:
        decisions = [limiter.hit(policy, "a") for _ in range(12)]
        other = [limiter.hit(policy, "b") for _ in range(6)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 7
    assert [d.allowed for d in other] == [True] * 5 + [False]  # per identity
    assert all(d.degraded for d in decisions + other)
    assert all(d.reason is not None and d.reason.endswith("/local") for d in decisions + other)
    assert reasons(decisions)[:3] == ["unavailable/local"] * 3
    assert set(reasons(decisions)[3:]) == {"breaker_open/local"}
    assert [d.remaining for d in decisions[:5]] == [4, 3, 2, 1, 0]
    assert all(d.limit == 5 for d in decisions)  # the local share of 10
    denied = decisions[5]
    assert denied.retry_after is not None
    assert 0 < denied.retry_after <= 60


def test_local_share_never_rounds_below_one(dead_url: str, key_prefix: str):
    breaker, _ = fake_breaker()
    policy = Policy("fm-local-tiny", "3/minute", failure_mode="local")
    with Limiter.from_url(
        dead_url, key_prefix=key_prefix, local_share=0.1, breaker=breaker, **SHORT
    ) as limiter:
        assert [limiter.hit(policy, "a").allowed for _ in range(3)] == [True, False, False]


# --- raise ---------------------------------------------------------------------------------------


def test_raise_raises_storage_unavailable_then_mentions_the_breaker(dead_url: str, key_prefix: str):
    breaker, clock = fake_breaker(consecutive_failures=3, open_for=1.0)
    policy = Policy("fm-raise", "10/minute")
    with Limiter.from_url(
        dead_url, key_prefix=key_prefix, failure_mode="raise", breaker=breaker, **SHORT
    ) as limiter:
        for _ in range(3):
            with pytest.raises(StorageUnavailable) as excinfo:
                limiter.hit(policy, "a")
            assert isinstance(excinfo.value.__cause__, redis.ConnectionError)
        assert breaker.state is BreakerState.OPEN
        clock.advance(0.25)
        with pytest.raises(StorageUnavailable, match="circuit breaker") as excinfo:
            limiter.hit(policy, "a")
        assert excinfo.value.__cause__ is None  # nothing was sent
        assert "0.750" in str(excinfo.value)  # how long it stays open


# --- per-policy overrides ------------------------------------------------------------------------


@pytest.mark.parametrize("default", ["open", "closed", "local", "raise"])
def test_a_policy_failure_mode_overrides_the_limiter_default(
    dead_url: str, key_prefix: str, default: str
):
    breaker, _ = fake_breaker(consecutive_failures=1_000)
    allow = Policy("ovr-open", "1/minute", failure_mode="open")
    deny = Policy("ovr-closed", "1/minute", failure_mode="closed")
    local = Policy("ovr-local", "4/minute", failure_mode="local")
    fail = Policy("ovr-raise", "1/minute", failure_mode="raise")
    inherit = Policy("ovr-none", "1/minute")
    with Limiter.from_url(
        dead_url,
        key_prefix=key_prefix,
        failure_mode=default,
        local_share=0.5,
        breaker=breaker,
        **SHORT,
    ) as limiter:
        opened = [limiter.hit(allow, "a") for _ in range(3)]
        closed = [limiter.hit(deny, "a") for _ in range(3)]
        localled = [limiter.hit(local, "a") for _ in range(3)]
        with pytest.raises(StorageUnavailable):
            limiter.hit(fail, "a")
        if default == "raise":
            with pytest.raises(StorageUnavailable):
                limiter.hit(inherit, "a")
        else:
            inherited = limiter.hit(inherit, "a")
            assert inherited.reason == f"unavailable/{default}"
    assert [(d.allowed, d.reason) for d in opened] == [(True, "unavailable/open")] * 3
    assert [(d.allowed, d.reason) for d in closed] == [(False, "unavailable/closed")] * 3
    assert [(d.allowed, d.reason) for d in localled] == [
        (True, "unavailable/local"),
        (True, "unavailable/local"),
        (False, "unavailable/local"),
    ]


# --- asyncio -------------------------------------------------------------------------------------


def test_failure_modes_async(dead_url: str, key_prefix: str):
    breaker, clock = fake_breaker(consecutive_failures=3, open_for=1.0)
    allow = Policy("afm-open", "1/minute", failure_mode="open")
    deny = Policy("afm-closed", "1/minute", failure_mode="closed")
    local = Policy("afm-local", "10/minute", failure_mode="local")
    fail = Policy("afm-raise", "1/minute", failure_mode="raise")

    async def main() -> None:
        limiter = AsyncLimiter.from_url(
            dead_url, key_prefix=key_prefix, local_share=0.5, breaker=breaker, **SHORT
        )
        try:
            first = [await limiter.hit(allow, "a") for _ in range(3)]
            assert [(d.allowed, d.reason) for d in first] == [(True, "unavailable/open")] * 3
            assert breaker.state is BreakerState.OPEN
            opened = await limiter.hit(allow, "a")
            assert (opened.allowed, opened.degraded, opened.reason) == (
                True,
                True,
                "breaker_open/open",
            )
            clock.advance(0.25)
            closed = await limiter.hit(deny, "a")
            assert (closed.allowed, closed.reason) == (False, "breaker_open/closed")
            assert closed.retry_after == pytest.approx(0.75)
            localled = [await limiter.hit(local, "a") for _ in range(7)]
            assert [d.allowed for d in localled] == [True] * 5 + [False] * 2
            assert {d.reason for d in localled} == {"breaker_open/local"}
            with pytest.raises(StorageUnavailable, match="circuit breaker"):
                await limiter.hit(fail, "a")
        finally:
            await limiter.close()

    asyncio.run(main())


def test_raise_async_on_a_dead_store(dead_url: str, key_prefix: str):
    breaker, _ = fake_breaker()
    policy = Policy("afm-raise-dead", "1/minute")

    async def main() -> None:
        limiter = AsyncLimiter.from_url(
            dead_url, key_prefix=key_prefix, failure_mode="raise", breaker=breaker, **SHORT
        )
        try:
            with pytest.raises(StorageUnavailable) as excinfo:
                await limiter.hit(policy, "a")
            assert isinstance(excinfo.value.__cause__, redis.ConnectionError)
        finally:
            await limiter.close()

    asyncio.run(main())


# --- errors caused by the request ----------------------------------------------------------------


def test_request_rejected_is_exported():
    """README ("Errors"): ``RequestRejected`` is part of the error tree callers catch, yet
    ``ratekeeper`` exports every other error but this one."""
    assert ratekeeper.RequestRejected is RequestRejected  # type: ignore[attr-defined]
    assert "RequestRejected" in ratekeeper.__all__


@pytest.mark.parametrize("mode", ["open", "closed", "local", "raise"])
def test_wrongtype_is_raised_not_failed_open(live: RedisServer, key_prefix: str, mode: str):
    # A breaker that would open on the first failure it is told about.
    breaker = CircuitBreaker(consecutive_failures=1, min_calls=1)
    policy = Policy("wrongtype", "5/minute")
    with (
        live.client() as admin,
        Limiter.from_url(
            live.url, key_prefix=key_prefix, failure_mode=mode, breaker=breaker, **PATIENT
        ) as limiter,
    ):
        (key,) = limiter.keys(policy, "victim")
        admin.set(key, "a plain string")
        for _ in range(25):
            with pytest.raises(RequestRejected, match="WRONGTYPE") as excinfo:
                limiter.hit(policy, "victim")
            assert not isinstance(excinfo.value, StorageError)
            assert isinstance(excinfo.value.__cause__, redis.ResponseError)
        assert breaker.state is BreakerState.CLOSED
        assert admin.get(key) == b"a plain string"  # untouched
        # Other identities are decided by the store as usual meanwhile.
        decision = limiter.hit(policy, "bystander")
        assert (decision.allowed, decision.degraded, decision.reason) == (True, False, None)
        admin.delete(key)
        assert limiter.hit(policy, "victim").remaining == 4


def test_a_rejected_probe_does_not_hold_back_recovery(live: RedisServer, key_prefix: str):
    """In half_open, ``allow()`` marks a probe in flight. A probe that ends in RequestRejected
    reached the store and got an answer (the store is up), but the guard never reports it, so
    the probe stays "in flight" and every call is answered ``breaker_open`` for another whole
    ``open_for`` (up to ``max_open_for``, 30 s by default, after back-off). The next call must
    be allowed to probe."""
    breaker, clock = fake_breaker(consecutive_failures=2, open_for=8.0, max_open_for=30.0)
    policy = Policy("rejected-probe", "5/minute")
    with (
        live.client() as admin,
        Limiter.from_url(live.url, key_prefix=key_prefix, breaker=breaker, **PATIENT) as limiter,
    ):
        admin.set(limiter.keys(policy, "bad")[0], "a plain string")
        for _ in range(2):  # the store failed twice, earlier
            breaker.record(False, 0.0)
        clock.advance(8.0)
        assert breaker.state is BreakerState.HALF_OPEN
        with pytest.raises(RequestRejected):
            limiter.hit(policy, "bad")  # this call was the probe
        clock.advance(0.01)
        decision = limiter.hit(policy, "good")
        assert decision.reason is None  # actual: "breaker_open/open" for 8 s more
        assert not decision.degraded


def test_wrongtype_is_raised_async(live: RedisServer, key_prefix: str):
    breaker = CircuitBreaker(consecutive_failures=1, min_calls=1)
    policy = Policy("wrongtype-async", "5/minute")

    async def main(admin: redis.Redis) -> None:
        limiter = AsyncLimiter.from_url(
            live.url, key_prefix=key_prefix, failure_mode="open", breaker=breaker, **PATIENT
        )
        try:
            (key,) = limiter.keys(policy, "victim")
            admin.set(key, "a plain string")
            for _ in range(10):
                with pytest.raises(RequestRejected, match="WRONGTYPE"):
                    await limiter.hit(policy, "victim")
            assert breaker.state is BreakerState.CLOSED
        finally:
            await limiter.close()

    with live.client() as admin:
        asyncio.run(main(admin))


# --- the deny cache ------------------------------------------------------------------------------


def same_numbers(cached: Decision, stored: Decision) -> None:
    """A cached denial says exactly what the store would have said at that moment."""
    assert cached.reason == "deny_cache"
    assert stored.reason is None
    assert not cached.degraded
    assert not stored.degraded
    assert (cached.allowed, cached.limit, cached.remaining, cached.rate, cached.policy) == (
        stored.allowed,
        stored.limit,
        stored.remaining,
        stored.rate,
        stored.policy,
    )
    assert cached.retry_after == stored.retry_after
    assert cached.reset_after == stored.reset_after


@pytest.mark.parametrize(
    "algorithm", ["sliding_log", "sliding_window", "fixed_window", "gcra", "token_bucket"]
)
def test_deny_cache_answers_exactly_as_the_store(live: RedisServer, key_prefix: str, algorithm):
    clock = ManualClock(1_700_000_000.0)
    policy = Policy("dc-exact", "3/minute", algorithm)
    with (
        live.client() as admin,
        # A max age past the wait: the cache alone answers the whole wait (the default, 1 s,
        # asks the store again each second; see test_a_reset_elsewhere_reaches_...).
        Limiter.from_url(
            live.url, key_prefix=key_prefix, clock=clock, deny_cache_max_age=3600, **PATIENT
        ) as cached,
        Limiter.from_url(
            live.url, key_prefix=key_prefix + "x", clock=clock, deny_cache=0, **PATIENT
        ) as plain,
    ):
        for _ in range(3):
            first, second = cached.hit(policy, "a"), plain.hit(policy, "a")
            assert first.allowed
            assert first == second
            clock.advance(1)
        admin.config_resetstat()
        denied_at = clock()
        denied, expected = cached.hit(policy, "a"), plain.hit(policy, "a")
        assert not denied.allowed
        assert denied == expected  # the store's own denial, reason None
        assert command_calls(admin, "evalsha") == 2
        wait = expected.retry_after
        assert wait is not None
        assert 0 < wait <= 60
        admin.config_resetstat()
        for _ in range(10):
            for _ in range(1_000):
                assert cached.hit(policy, "a").reason == "deny_cache"
            clock.advance(wait / 20)
        # 10,000 hits on the denied key, over half its wait: no store call at all.
        assert command_calls(admin, "evalsha") == 0
        assert len(cached._guard._deny) == 1  # type: ignore[arg-type]
        # The cached answers equal the store's at several moments of the wait.
        for _ in range(4):
            same_numbers(cached.hit(policy, "a"), plain.hit(policy, "a"))
            clock.advance(wait / 10)
        # Once the clock passes retry_after the store is asked again, and admits.
        clock.set(denied_at + wait + 2e-6)
        admin.config_resetstat()
        again, again_plain = cached.hit(policy, "a"), plain.hit(policy, "a")
        assert command_calls(admin, "evalsha") == 2
        assert again.allowed
        assert again.reason is None
        assert again == again_plain


def test_deny_cache_flood_costs_at_most_a_handful_of_evalsha(live: RedisServer, key_prefix: str):
    clock = ManualClock()
    policy = Policy("dc-flood", "3/minute")
    with (
        live.client() as admin,
        Limiter.from_url(live.url, key_prefix=key_prefix, clock=clock, **PATIENT) as limiter,
    ):
        assert [limiter.hit(policy, "hot").allowed for _ in range(3)] == [True] * 3
        admin.config_resetstat()
        decisions = [limiter.hit(policy, "hot") for _ in range(10_000)]
        calls = command_calls(admin, "evalsha")
    print(f"\n[{live.binary.flavor}] 10,000 hits on a denied key: {calls} EVALSHA")
    assert calls <= 2
    assert not any(d.allowed for d in decisions)
    assert decisions[0].reason is None
    assert {d.reason for d in decisions[1:]} == {"deny_cache"}


def test_deny_cache_async(live: RedisServer, key_prefix: str):
    clock = ManualClock()
    policy = Policy("dc-async", "3/minute")

    async def main(admin: redis.Redis) -> None:
        limiter = AsyncLimiter.from_url(live.url, key_prefix=key_prefix, clock=clock, **PATIENT)
        try:
            assert [(await limiter.hit(policy, "hot")).allowed for _ in range(3)] == [True] * 3
            admin.config_resetstat()
            decisions = [await limiter.hit(policy, "hot") for _ in range(2_000)]
            assert command_calls(admin, "evalsha") <= 2
            assert {d.reason for d in decisions[1:]} == {"deny_cache"}
            await limiter.reset(policy, "hot")
            decision = await limiter.hit(policy, "hot")
            assert (decision.allowed, decision.reason) == (True, None)
        finally:
            await limiter.close()

    with live.client() as admin:
        asyncio.run(main(admin))


def test_reset_clears_the_cached_denial(live: RedisServer, key_prefix: str):
    clock = ManualClock()
    policy = Policy("dc-reset", "3/minute")
    with Limiter.from_url(live.url, key_prefix=key_prefix, clock=clock, **PATIENT) as limiter:
        for _ in range(4):
            limiter.hit(policy, "a")
        assert limiter.hit(policy, "a").reason == "deny_cache"
        limiter.reset(policy, "a")
        assert len(limiter._guard._deny) == 0  # type: ignore[arg-type]
        decision = limiter.hit(policy, "a")
        assert (decision.allowed, decision.reason, decision.remaining) == (True, None, 2)


def test_only_denials_of_cost_1_are_cached(live: RedisServer, key_prefix: str):
    """A larger cost's remaining can grow while it still does not fit, so only cost-1 denials
    (whose decision changes with nothing but the clock) are answered locally."""
    clock = ManualClock()
    policy = Policy("dc-cost", "3/minute")
    with (
        live.client() as admin,
        Limiter.from_url(live.url, key_prefix=key_prefix, clock=clock, **PATIENT) as limiter,
    ):
        assert limiter.hit(policy, "a", cost=2).allowed
        admin.config_resetstat()
        assert limiter.hit(policy, "a", cost=2).reason is None  # denied by the store
        assert limiter.hit(policy, "a", cost=2).reason is None  # and not cached
        assert command_calls(admin, "evalsha") == 2
        assert limiter.hit(policy, "a").allowed  # the last unit
        assert limiter.hit(policy, "a").reason is None  # a cost-1 denial, now cached
        admin.config_resetstat()
        assert limiter.hit(policy, "a").reason == "deny_cache"
        assert command_calls(admin, "evalsha") == 0
        larger = limiter.hit(policy, "a", cost=2)
        assert command_calls(admin, "evalsha") == 1
        assert (larger.allowed, larger.reason, larger.remaining) == (False, None, 0)


def test_concurrency_policies_are_never_cached(live: RedisServer, key_prefix: str):
    clock = ManualClock()
    policy = Policy("dc-leases", "2/minute", "concurrency")
    with (
        live.client() as admin,
        Limiter.from_url(live.url, key_prefix=key_prefix, clock=clock, **PATIENT) as limiter,
    ):
        held = [limiter.acquire(policy, "a") for _ in range(2)]
        assert all(lease.allowed for lease in held)
        admin.config_resetstat()
        refused = [limiter.acquire(policy, "a") for _ in range(20)]
        assert command_calls(admin, "evalsha") == 20
        assert not any(lease.allowed for lease in refused)
        assert {lease.decision.reason for lease in refused} == {None}
        assert len(limiter._guard._deny) == 0  # type: ignore[arg-type]
        assert held[0].release()
        # A cached denial would be wrong now: a lease was given back early.
        assert limiter.acquire(policy, "a").allowed


def test_deny_cache_zero_turns_it_off(live: RedisServer, key_prefix: str):
    clock = ManualClock()
    policy = Policy("dc-off", "3/minute")
    with (
        live.client() as admin,
        Limiter.from_url(
            live.url, key_prefix=key_prefix, clock=clock, deny_cache=0, **PATIENT
        ) as limiter,
    ):
        assert limiter._guard._deny is None
        for _ in range(3):
            limiter.hit(policy, "a")
        admin.config_resetstat()
        decisions = [limiter.hit(policy, "a") for _ in range(50)]
        assert command_calls(admin, "evalsha") == 50
        assert {(d.allowed, d.reason) for d in decisions} == {(False, None)}


def test_the_deny_cache_is_bounded(live: RedisServer, key_prefix: str):
    clock = ManualClock()
    policy = Policy("dc-bounded", "1/minute")
    with Limiter.from_url(
        live.url, key_prefix=key_prefix, clock=clock, deny_cache=10, **PATIENT
    ) as limiter:
        for identity in range(50):
            assert limiter.hit(policy, identity).allowed
            assert limiter.hit(policy, identity).reason is None  # denied by the store
        assert len(limiter._guard._deny) == 10  # type: ignore[arg-type]
        # Least recently used first out: the last ten are cached, the first are not.
        assert limiter.hit(policy, 49).reason == "deny_cache"
        assert limiter.hit(policy, 40).reason == "deny_cache"
        assert limiter.hit(policy, 0).reason is None
        assert len(limiter._guard._deny) == 10  # type: ignore[arg-type]


# --- operator actions reach every process; a denial stays a denial through a fault -------------


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_reset_elsewhere_reaches_a_running_limiter_within_its_max_age(
    live: RedisServer, key_prefix: str, api: str
):
    """The running app's limiter has the identity's denial cached; another process (here a
    limiter of its own, with its own cache) resets it. Within ``deny_cache_max_age`` (1 s by
    default) the running limiter asks the store again and admits."""
    clock = ManualClock(1_700_000_000.0)
    policy = Policy("dc-elsewhere", "2/hour")
    with Limiter.from_url(live.url, key_prefix=key_prefix, clock=clock, **PATIENT) as operator:
        if api == "sync":
            running: Any = Limiter.from_url(live.url, key_prefix=key_prefix, clock=clock, **PATIENT)
        else:
            from ..conftest import AsyncDriver

            running = AsyncDriver(
                AsyncLimiter.from_url(live.url, key_prefix=key_prefix, clock=clock, **PATIENT)
            )
        try:
            assert [running.hit(policy, "a").allowed for _ in range(3)] == [True, True, False]
            assert running.hit(policy, "a").reason == "deny_cache"
            operator.reset(policy, "a")
            clock.advance(0.999)
            assert running.hit(policy, "a").reason == "deny_cache"  # still fresh
            clock.advance(0.001)
            again = running.hit(policy, "a")
            assert (again.allowed, again.reason, again.remaining) == (True, None, 1)
        finally:
            running.close()


def test_deny_cache_max_age_is_checked():
    for bad in (0, -1, float("inf"), True, "1"):
        with pytest.raises(ConfigError, match="deny_cache_max_age must be"):
            Limiter.from_url("memory://", deny_cache_max_age=bad)


def test_the_local_mode_keeps_a_bounded_number_of_identities(dead_url: str, key_prefix: str):
    """With the store down, rotated identities each get a local budget, and the oldest are
    forgotten past ``LOCAL_MAX_KEYS``: memory stays bounded (the figure: test_memory_usage)."""
    from ratekeeper._engine.fallback import LOCAL_MAX_KEYS

    policy = Policy("local-bounded", "5/minute", "gcra")
    with Limiter.from_url(dead_url, key_prefix=key_prefix, failure_mode="local") as limiter:
        for identity in range(LOCAL_MAX_KEYS + 500):
            decision = limiter.hit(policy, identity)
            assert decision.allowed
            assert decision.degraded
        local = limiter._guard.local
        assert local is not None
        assert len(local.storage) == LOCAL_MAX_KEYS
        # The newest identity keeps its state, the first one was forgotten.
        assert limiter.hit(policy, LOCAL_MAX_KEYS + 499).remaining == 3


_ROTATION = """
import resource, sys
from ratekeeper import Limiter, Policy

def rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024

policy = Policy("rotated", "5/minute", "gcra")
with Limiter.from_url(sys.argv[1], failure_mode="local") as limiter:
    assert limiter.hit(policy, "warm").degraded
    before = rss_kb()
    for n in range(500_000):
        limiter.hit(policy, f"attacker-{n}")
    print(rss_kb() - before)
"""


def test_the_local_mode_grows_by_less_than_20_mb_under_500k_rotated_identities(dead_url: str):
    """An outage and an attacker rotating identities: 500,000 fresh identities decided by the
    local failure mode; the process grows by less than 20 MB (it grew by 212 MB before the
    bound). A process of its own, so nothing else this run holds is counted."""
    done = subprocess.run(
        [sys.executable, "-c", _ROTATION, dead_url],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    grown_kb = int(done.stdout.split()[-1])
    record("local_mode_rotation", identities=500_000, grown_mb=round(grown_kb / 1024, 1))
    assert grown_kb < 20 * 1024


def test_a_locally_answered_async_hit_lets_other_tasks_run(dead_url: str, key_prefix: str):
    """``await hit()`` answered without the store (a cached denial, an open breaker) still
    yields to the event loop: a loop of such hits cannot starve the other tasks. So does one
    that raises without the store (an open breaker, ``failure_mode="raise"``): a caller that
    retries at once used to hold the loop until the breaker let it probe."""
    policy = Policy("yields", "1/hour")

    async def main() -> tuple[int, int, int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        async with (
            AsyncLimiter.from_url("memory://", key_prefix=key_prefix) as cached,
            AsyncLimiter.from_url(dead_url, key_prefix=key_prefix) as broken,
            AsyncLimiter.from_url(dead_url, key_prefix=key_prefix, failure_mode="raise") as raising,
        ):
            assert (await cached.hit(policy, "a")).allowed
            assert (await cached.hit(policy, "a")).reason is None
            for _ in range(10):  # opens the breaker of the dead store
                await broken.hit(policy, "a")
                with pytest.raises(StorageError):
                    await raising.hit(policy, "a")
            assert broken.breaker.state is BreakerState.OPEN
            assert raising.breaker.state is BreakerState.OPEN
            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            start = ticks
            for _ in range(500):
                assert (await cached.hit(policy, "a")).reason == "deny_cache"
            during_cached = ticks - start
            start = ticks
            for _ in range(500):
                assert (await broken.hit(policy, "a")).reason == "breaker_open/open"
            during_open = ticks - start
            start = ticks
            for _ in range(500):
                with pytest.raises(StorageUnavailable, match="circuit breaker is open"):
                    await raising.hit(policy, "a")
            during_raised = ticks - start
            stop.set()
            await task
        return during_cached, during_open, during_raised

    during_cached, during_open, during_raised = asyncio.run(main())
    assert during_cached >= 499
    assert during_open >= 499
    assert during_raised >= 499
