"""``local_share="auto"``: fleet heartbeats on real servers, and the local share they give.

The scenario the issue asks for: limiters heartbeat on a ManualClock into a private server,
the server dies, and each instance's local fallback grants exactly ``limit // N``: N = 2, then
(store back, scaled up, heartbeats) 6, then (3 instances stopped, their heartbeats expired on
the clock) 3. The dead store is a private server killed with SIGKILL; the breakers run on a
fake clock, as in ``test_failure_modes``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratekeeper import AsyncLimiter, AutoShare, ConfigError, Limiter, ManualClock, Policy
from ratekeeper._algorithms import HIT, encode_args
from ratekeeper._algorithms.scripts import load_script
from ratekeeper._engine.breaker import BreakerState, CircuitBreaker
from ratekeeper._engine.keys import KeyBuilder
from ratekeeper._storage import open_sync
from ratekeeper._storage.memory import MemoryStorage

from ..support import workers
from ..support.servers import RedisServer, ServerBinary, command_calls, find_binaries

BINARIES = find_binaries()
FLAVORS = [binary.flavor for binary in BINARIES]
SHORT = {"timeout": 0.2, "connect_timeout": 0.2}
LIMIT = 60
POLICY = Policy("fleet-share", f"{LIMIT}/minute")


# --- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize("share", [0, 0.0, -0.5, 1.5, True, "Auto", "half", None, float("nan")])
def test_a_bad_local_share_is_a_config_error(share: Any):
    with pytest.raises(ConfigError, match="local_share must be 'auto' or a share in"):
        Limiter.from_url("memory://", local_share=share)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"heartbeat": 0}, "heartbeat must be seconds"),
        ({"heartbeat": float("inf")}, "heartbeat must be seconds"),
        ({"ttl": "3"}, "ttl must be seconds"),
        ({"heartbeat": 2.0, "ttl": 1.0}, "must be at least one heartbeat"),
    ],
)
def test_a_bad_auto_share_is_a_config_error(options: dict[str, Any], message: str):
    with pytest.raises(ConfigError, match=message):
        AutoShare(**options)


def test_auto_and_its_defaults():
    assert AutoShare().heartbeat == 1.0
    assert AutoShare().ttl_seconds == 3.0
    assert AutoShare(heartbeat=2).ttl_seconds == 6.0
    limiter = Limiter.from_url("memory://", local_share="auto")
    assert limiter._guard.fleet is not None
    assert limiter._guard.fleet.key == "ratekeeper:{fleet}"
    assert Limiter.from_url("memory://", local_share=0.25)._guard.fleet is None


# --- the script and its reference -------------------------------------------------------------


def _beat_args(now_us: int, member: str, ttl_us: int) -> tuple[int | str, ...]:
    return encode_args(
        now_us, cost=1, mode=HIT, token=member, margin_ms=1000, rates=(), extra=(ttl_us,)
    )


beats = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 4_000_000), st.integers(1_000, 5_000_000)),
    min_size=1,
    max_size=30,
)


@pytest.mark.parametrize("flavor", FLAVORS)
@settings(max_examples=40, deadline=None)
@given(sequence=beats)
def test_script_and_reference_agree(
    own_servers: dict[str, RedisServer], flavor: str, sequence: list[tuple[int, int, int]]
):
    """Random heartbeats (member, clock step, ttl): the same counts, the same members and
    expiries, and a key TTL of the last membership TTL plus the margin on both."""
    server = own_servers[flavor]
    key = KeyBuilder("fleet-prop").fleet_key()
    script = load_script("fleet")
    memory = MemoryStorage()
    storage = open_sync(server.url, timeout=5, connect_timeout=5)
    with server.client() as admin:
        try:
            admin.delete(key)
            now = 1_700_000_000_000_000
            for member, step, ttl in sequence:
                now += step
                args = _beat_args(now, f"m{member}", ttl)
                assert storage.run(script, (key,), args) == memory.run(script, (key,), args)
            stored = {m.decode(): int(s) for m, s in admin.zrange(key, 0, -1, withscores=True)}
            assert stored == memory._keyspace.get(key, now)
            longest = max(stored.values()) - now
            assert 0 < admin.pttl(key) <= -(-longest // 1000) + 1000
        finally:
            storage.close()


@pytest.mark.parametrize("flavor", FLAVORS)
def test_on_the_servers_clock(own_servers: dict[str, RedisServer], flavor: str):
    """now = 0: the script stamps members with TIME; two ids count 2, one id beating twice 1."""
    server = own_servers[flavor]
    key = KeyBuilder("fleet-time").fleet_key()
    script = load_script("fleet")
    storage = open_sync(server.url, timeout=5, connect_timeout=5)
    with server.client() as admin:
        try:
            admin.delete(key)
            assert storage.run(script, (key,), _beat_args(0, "a", 3_000_000)) == [1]
            assert storage.run(script, (key,), _beat_args(0, "a", 3_000_000)) == [1]
            assert storage.run(script, (key,), _beat_args(0, "b", 3_000_000)) == [2]
            seconds, micros = admin.time()
            for _, expiry in admin.zrange(key, 0, -1, withscores=True):
                assert 0 < expiry - (seconds * 1_000_000 + micros) <= 3_000_000
            assert 3_000 < admin.pttl(key) <= 4_000
        finally:
            storage.close()


# --- the share following the fleet --------------------------------------------------------------


class Instance:
    """One limiter of the fleet, with its own instance id."""

    def __init__(self, url: str, prefix: str, clock: ManualClock, breaker_clock: ManualClock):
        self.breaker_clock = breaker_clock
        self.limiter = Limiter.from_url(
            url,
            key_prefix=prefix,
            clock=clock,
            failure_mode="local",
            local_share="auto",
            breaker=CircuitBreaker(clock=breaker_clock),
            **SHORT,
        )

    @property
    def count(self) -> int | None:
        fleet = self.limiter._guard.fleet
        assert fleet is not None
        return fleet.count

    def decide(self) -> None:
        """A decision the store makes (and the heartbeat it carries when one is due)."""
        decision = self.limiter.hit(POLICY, "warm")
        assert not decision.degraded

    def recover(self) -> None:
        """After the store is back: probe until the breaker closes again."""
        for _ in range(40):
            if self.limiter.breaker.state is BreakerState.CLOSED:
                return
            self.breaker_clock.advance(5)  # past open_for: the next call is a probe
            self.limiter.hit(POLICY, "probe")
        raise AssertionError("the breaker did not close")

    def admitted_while_down(self, identity: str, tries: int) -> int:
        decisions = [self.limiter.hit(POLICY, identity) for _ in range(tries)]
        assert all(d.degraded and d.reason and d.reason.endswith("/local") for d in decisions)
        return sum(d.allowed for d in decisions)


def _beat_rounds(fleet: list[Instance], clock: ManualClock, rounds: int = 2) -> None:
    for _ in range(rounds):
        clock.advance(1.0)  # one heartbeat interval
        for instance in fleet:
            instance.decide()


def test_the_auto_share_follows_a_fleet_of_2_6_then_3(own_server: RedisServer, key_prefix: str):
    clock, breaker_clock = ManualClock(), ManualClock(100.0)
    admin = own_server.client()
    fleet_key = KeyBuilder(key_prefix).fleet_key()
    fleet = [Instance(own_server.url, key_prefix, clock, breaker_clock) for _ in range(2)]
    try:
        # Before any heartbeat the count is unknown, and the share would be nothing.
        assert [i.count for i in fleet] == [None, None]
        _beat_rounds(fleet, clock)
        assert [i.count for i in fleet] == [2, 2]
        assert admin.zcard(fleet_key) == 2

        own_server.kill()
        assert [i.admitted_while_down("down-2", 40) for i in fleet] == [30, 30]

        # Store back (empty), scaled up to 6, heartbeats: the next outage shares by 6.
        clock.advance(10)
        own_server.start()
        for instance in fleet:
            instance.recover()
        fleet += [Instance(own_server.url, key_prefix, clock, breaker_clock) for _ in range(4)]
        _beat_rounds(fleet, clock)
        assert [i.count for i in fleet] == [6] * 6
        assert admin.zcard(fleet_key) == 6
        assert len(set(admin.zrange(fleet_key, 0, -1))) == 6  # each its own instance id

        own_server.kill()
        admitted = [i.admitted_while_down("down-6", 15) for i in fleet]
        assert admitted == [10] * 6
        assert sum(admitted) == LIMIT

        # Store back; 3 instances stop. Their members expire after the TTL (3 s) on the clock.
        own_server.start()
        for instance in fleet:
            instance.recover()
        _beat_rounds(fleet, clock, rounds=1)
        stopped, fleet = fleet[3:], fleet[:3]
        for instance in stopped:
            instance.limiter.close()
        # The rest beat every second. The stopped ones' members expire 3 s (the TTL) after
        # their last heartbeat; the count then stays 6 for one more TTL (the largest seen in
        # the last TTL: a store that lost the set cannot make the share grow), then reads 3.
        zcards, counts = [], []
        for _ in range(6):
            _beat_rounds(fleet, clock, rounds=1)
            zcards.append(admin.zcard(fleet_key))
            counts.append([i.count for i in fleet])
        assert zcards == [6, 6, 3, 3, 3, 3]
        assert counts == [[6, 6, 6]] * 5 + [[3, 3, 3]]

        own_server.kill()
        admitted = [i.admitted_while_down("down-3", 25) for i in fleet]
        assert admitted == [20] * 3
        assert sum(admitted) == LIMIT
    finally:
        admin.close()
        for instance in fleet:
            instance.limiter.close()


def test_no_count_yet_denies(own_server: RedisServer, key_prefix: str):
    """An instance that never saw a heartbeat grants nothing in an outage, as closed would: one
    instance granting the whole limit would multiply it by the fleet's size."""
    url = own_server.url
    own_server.kill()
    with Limiter.from_url(
        url, key_prefix=key_prefix, failure_mode="local", local_share="auto", **SHORT
    ) as limiter:
        decisions = [limiter.hit(POLICY, "a") for _ in range(3)]
    assert [d.allowed for d in decisions] == [False] * 3
    assert all(d.degraded and d.retry_after for d in decisions)
    assert decisions[0].reason == "unavailable/local"


def test_a_limit_smaller_than_the_fleet_grants_nothing(own_server: RedisServer, key_prefix: str):
    """limit // N rounds to 0: never more than the limit across the fleet, so nothing."""
    clock = ManualClock()
    small = Policy("fleet-small", "2/minute")
    options: dict[str, Any] = {
        "key_prefix": key_prefix,
        "clock": clock,
        "failure_mode": "local",
        "local_share": "auto",
        **SHORT,
    }
    limiters = [Limiter.from_url(own_server.url, **options) for _ in range(3)]
    try:
        for _ in range(2):
            clock.advance(1)
            for limiter in limiters:
                limiter.hit(small, "warm")
        own_server.kill()
        assert [limiters[0].hit(small, "x").allowed for _ in range(2)] == [False, False]
        assert [limiters[0].hit(POLICY, "x").allowed for _ in range(21)] == [True] * 20 + [False]
    finally:
        for limiter in limiters:
            limiter.close()


def test_heartbeats_at_most_once_per_interval(own_server: RedisServer, key_prefix: str):
    clock = ManualClock()
    with (
        own_server.client() as admin,
        Limiter.from_url(
            own_server.url,
            key_prefix=key_prefix,
            clock=clock,
            failure_mode="local",
            local_share=AutoShare(heartbeat=2.0),
            **SHORT,
        ) as limiter,
    ):
        counter = Policy("fleet-counter", "100/minute", "fixed_window")
        admin.config_resetstat()
        for _ in range(5):
            limiter.hit(counter, "a")
        clock.advance(1.9)
        limiter.hit(counter, "a")
        clock.advance(0.1)
        limiter.hit(counter, "a")
        # 7 decisions; 2 heartbeats: with the first decision, and 2 s later
        assert command_calls(admin, "hmget") == 7
        assert command_calls(admin, "zadd") == 2
        assert command_calls(admin, "zcard") == 2


def test_the_async_share_follows_the_fleet(own_server: RedisServer, key_prefix: str):
    clock = ManualClock()

    async def main() -> list[int]:
        limiters = [
            AsyncLimiter.from_url(
                own_server.url,
                key_prefix=key_prefix,
                clock=clock,
                failure_mode="local",
                local_share="auto",
                **SHORT,
            )
            for _ in range(4)
        ]
        try:
            for _ in range(2):
                clock.advance(1)
                for limiter in limiters:
                    await limiter.hit(POLICY, "warm")
                for limiter in limiters:
                    assert limiter._guard.fleet is not None
                    await limiter._guard.fleet.join()
            assert [lim._guard.fleet and lim._guard.fleet.count for lim in limiters] == [4] * 4
            own_server.kill()
            return [
                sum([(await limiter.hit(POLICY, "down")).allowed for _ in range(20)])
                for limiter in limiters
            ]
        finally:
            for limiter in limiters:
                await limiter.close()

    assert asyncio.run(main()) == [15] * 4


# --- separate processes -------------------------------------------------------------------------


def fleet_worker(*, url: str, key_prefix: str, size: int, barrier: Any, queue: Any) -> None:
    """One process of the fleet: heartbeat (server clock) until it sees ``size`` instances,
    wait for the store to die, then count what its local share admits."""
    errors: list[str] = []
    admitted = count = 0
    try:
        with Limiter.from_url(
            url,
            key_prefix=key_prefix,
            failure_mode="local",
            local_share=AutoShare(heartbeat=0.001, ttl=120),
            timeout=5,
            connect_timeout=5,
        ) as limiter:
            fleet = limiter._guard.fleet
            assert fleet is not None
            limiter.hit(POLICY, "warm")
            barrier.wait(60)  # every process has beaten once
            for _ in range(1000):
                limiter.hit(POLICY, "warm")
                if fleet.count == size:
                    break
            count = fleet.count or 0
            barrier.wait(60)  # every process has seen the whole fleet
            barrier.wait(60)  # the parent killed the store
            admitted = sum(limiter.hit(POLICY, "down").allowed for _ in range(LIMIT))
    except Exception as exc:
        errors.append(repr(exc))
    queue.put({"admitted": admitted, "count": count, "errors": errors})


@pytest.mark.parametrize("binary", BINARIES[:1], ids=FLAVORS[:1])
def test_separate_processes_share_the_limit(binary: ServerBinary, key_prefix: str):
    size = 4
    server = RedisServer(binary).start()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(size + 1)
    kwargs = {"url": server.url, "key_prefix": key_prefix, "size": size, "barrier": barrier}
    try:
        with workers.Processes(ctx, fleet_worker, size, **kwargs) as running:
            barrier.wait(120)
            barrier.wait(120)
            server.kill()
            barrier.wait(120)
            results = running.reports()
    finally:
        server.stop()
    assert [proc.exitcode for proc in running.procs] == [0] * size
    assert [r["errors"] for r in results] == [[]] * size
    assert [r["count"] for r in results] == [size] * size
    assert [r["admitted"] for r in results] == [LIMIT // size] * size


def test_a_rejected_heartbeat_never_reaches_the_caller(
    own_server: RedisServer, key_prefix: str, caplog: pytest.LogCaptureFixture
):
    """Someone wrote a string to the fleet key: the heartbeat gets WRONGTYPE. The decision
    stands, the error is logged, the breaker stays closed and the count stays unknown."""
    with own_server.client() as admin:
        admin.set(KeyBuilder(key_prefix).fleet_key(), "not a set")
    with Limiter.from_url(
        own_server.url, key_prefix=key_prefix, failure_mode="local", local_share="auto", **SHORT
    ) as limiter:
        decision = limiter.hit(POLICY, "a")
        assert decision.allowed
        assert not decision.degraded
        assert limiter.breaker.state is BreakerState.CLOSED
        assert limiter._guard.fleet is not None
        assert limiter._guard.fleet.count is None
    assert "rejected a fleet heartbeat" in caplog.text
