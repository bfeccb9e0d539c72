"""Memory per identity on real servers, measured with ``MEMORY USAGE key SAMPLES 0``.

MEMORY USAGE is deterministic for a given server build and content (it adds up the allocation
sizes of the key, its value and their overhead), so these are tests, not timings. Time is a
ManualClock frozen in the middle of a day, so the stored numbers, and with them the encodings'
sizes, are the same on every run.

* sliding_window, fixed_window, gcra: O(1) per identity and rate, whatever the limit;
* concurrency: O(leases held), back to nothing when they are released or have expired;
* sliding_log: O(limit), one list element (a 64-bit time, about 10 bytes) per admitted unit,
  which is why policies cap it; at most 16 bytes a unit, key and overhead included.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from ratekeeper import ConfigError, Limiter, ManualClock, Policy

from ..support import workers
from ..support.servers import RedisServer

#: Bytes one identity may use per rate with an O(1) algorithm (key, hash and overhead included).
PER_RATE = 200
#: Largest difference between the sizes measured for limits of 10 and of 1,000,000: bigger
#: counts take a few more bytes in the listpack, and the allocator rounds to 16-byte classes.
SPREAD = 32
LIMITS = (10, 10_000, 1_000_000)
#: Concurrency: a key costs at most LEASE_BASE bytes plus PER_LEASE per lease held (while the
#: sorted set is a listpack, up to 128 members; beyond that each member costs about 100 bytes).
LEASE_BASE = 200
PER_LEASE = 40
#: sliding_log: bytes per admitted unit of a full log, key and overhead included.
LOG_UNIT_BYTES = 16


@pytest.fixture
def client(server: RedisServer) -> Iterator[redis.Redis]:
    made = redis.Redis.from_url(server.url)
    yield made
    made.close()


@pytest.fixture
def limiter(server: RedisServer, key_prefix: str) -> Iterator[tuple[Limiter, ManualClock]]:
    clock = ManualClock(workers.FROZEN_AT)
    with Limiter.from_url(server.url, clock=clock, **workers.exact_options(key_prefix)) as made:
        yield made, clock


def _bytes(client: redis.Redis, limiter: Limiter, policy: Policy, identity: str) -> int:
    """MEMORY USAGE of every key of ``identity`` under ``policy``; each key must exist."""
    total = 0
    for key in limiter.keys(policy, identity):
        used = client.memory_usage(key, samples=0)
        assert used is not None, f"{key} does not exist"
        total += int(used)
    return total


def _rates(limit: int, count: int) -> str:
    """One rate of ``limit`` per hour, or that and twice as much per day."""
    return f"{limit} per hour" if count == 1 else f"{limit} per hour;{2 * limit} per day"


def _fill(limiter: Limiter, policy: Policy, identity: str) -> None:
    """Spend the whole (tightest) limit: hit by hit for a limit of 10, else 5 hits and the rest
    in one cost; the next hit is denied."""
    limit = policy.rates[0].limit
    if limit <= 10:
        decisions = [limiter.hit(policy, identity) for _ in range(limit)]
    else:
        decisions = [limiter.hit(policy, identity) for _ in range(5)]
        decisions.append(limiter.hit(policy, identity, cost=limit - 5))
    assert all(decision.allowed for decision in decisions)
    assert not limiter.hit(policy, identity).allowed


@pytest.mark.parametrize("rate_count", [1, 2], ids=["1-rate", "2-rates"])
@pytest.mark.parametrize("algorithm", ["sliding_window", "fixed_window", "gcra"])
def test_constant_memory_algorithms_use_the_same_bytes_for_any_limit(
    client: redis.Redis,
    limiter: tuple[Limiter, ManualClock],
    algorithm: str,
    rate_count: int,
):
    """At most 200 bytes per rate, after 5 hits or a full limit, for limits of 10 to 10**6;
    and the limit makes a few bytes of difference at most."""
    made, _ = limiter
    measured: dict[tuple[int, str], int] = {}
    for limit in LIMITS:
        policy = Policy(f"mem-{algorithm}-{limit}", _rates(limit, rate_count), algorithm)
        for _ in range(5):
            assert made.hit(policy, "few").allowed
        measured[limit, "5 hits"] = _bytes(client, made, policy, "few")
        _fill(made, policy, "full")
        measured[limit, "full"] = _bytes(client, made, policy, "full")
    assert max(measured.values()) <= PER_RATE * rate_count, measured
    assert max(measured.values()) - min(measured.values()) <= SPREAD, measured
    for state in ("5 hits", "full"):
        assert abs(measured[10, state] - measured[1_000_000, state]) <= SPREAD, measured


def test_two_rates_cost_more_than_one_but_less_than_two_keys(
    client: redis.Redis, limiter: tuple[Limiter, ManualClock]
):
    """A second rate adds fields to the same hash, not another key."""
    made, _ = limiter
    for algorithm in ("sliding_window", "fixed_window", "gcra"):
        one = Policy(f"one-{algorithm}", _rates(100, 1), algorithm)
        two = Policy(f"two-{algorithm}", _rates(100, 2), algorithm)
        assert len(made.keys(two, "x")) == 1
        for policy in (one, two):
            for _ in range(5):
                assert made.hit(policy, "x").allowed
        single = _bytes(client, made, one, "x")
        double = _bytes(client, made, two, "x")
        assert single <= double < 2 * single, (algorithm, single, double)


def test_concurrency_memory_follows_the_leases_held(
    client: redis.Redis, limiter: tuple[Limiter, ManualClock]
):
    """k leases cost at most 200 + 40 k bytes whatever the limit, and nothing once released
    (the sorted set is deleted when its last member goes)."""
    made, _ = limiter
    measured: dict[tuple[int, int], int] = {}
    for limit in (1_000, 100_000):
        policy = Policy(f"mem-leases-{limit}", f"{limit} per minute", algorithm="concurrency")
        (key,) = made.keys(policy, "held")
        for held in (1, 10, 100):
            leases = [made.acquire(policy, "held") for _ in range(held)]
            assert all(lease.allowed for lease in leases)
            measured[limit, held] = _bytes(client, made, policy, "held")
            assert measured[limit, held] <= LEASE_BASE + PER_LEASE * held, measured
            assert [lease.release() for lease in leases] == [True] * held
            assert client.exists(key) == 0
            assert client.memory_usage(key, samples=0) is None
    for limit in (1_000, 100_000):
        assert measured[limit, 1] < measured[limit, 10] < measured[limit, 100], measured
    for held in (1, 10, 100):
        assert abs(measured[1_000, held] - measured[100_000, held]) <= SPREAD, measured


def test_concurrency_memory_of_crashed_holders_is_reclaimed(
    client: redis.Redis, limiter: tuple[Limiter, ManualClock]
):
    """100 leases never released: after the timeout the next acquire prunes them, and the key
    is back to the size of one lease."""
    made, clock = limiter
    policy = Policy("mem-crashed", "1000 per minute", algorithm="concurrency")
    one = made.acquire(policy, "alone")
    assert one.allowed
    single = _bytes(client, made, policy, "alone")
    assert one.release()

    crashed = [made.acquire(policy, "crashed") for _ in range(100)]
    assert all(lease.allowed for lease in crashed)
    full = _bytes(client, made, policy, "crashed")
    clock.advance(60)
    survivor = made.acquire(policy, "crashed")
    assert survivor.allowed
    (key,) = made.keys(policy, "crashed")
    assert client.zcard(key) == 1
    reclaimed = _bytes(client, made, policy, "crashed")
    assert reclaimed < full // 10
    assert abs(reclaimed - single) <= SPREAD
    assert survivor.release()
    assert client.exists(key) == 0


@pytest.mark.parametrize("limit", [1_000, 10_000])
def test_sliding_log_takes_at_most_16_bytes_per_admitted_unit(
    client: redis.Redis, limiter: tuple[Limiter, ManualClock], limit: int
):
    """A full log, hit by hit 100 us apart (every entry a distinct 16-digit time), takes at most
    16 bytes per admitted unit, key and overhead included; a sorted set of the same times (the
    earlier format: one member per unit, named by a call token) takes at least 5 times more."""
    made, clock = limiter
    policy = Policy(f"log-{limit}", f"{limit} per hour")
    for _ in range(limit):
        assert made.hit(policy, "x").allowed
        clock.advance(0.0001)
    assert not made.hit(policy, "x").allowed
    (key,) = made.keys(policy, "x")
    times = [int(t) for t in client.lrange(key, 0, -1)]
    assert len(times) == len(set(times)) == limit
    assert times == sorted(times)
    used = _bytes(client, made, policy, "x")
    assert used <= LOG_UNIT_BYTES * limit, (used, used / limit)

    # The earlier sorted set, with members as the earlier script named them: token + '.1'.
    old = f"{key}:as-sorted-set"
    client.zadd(old, {f"{os.urandom(6).hex()}{i:x}.1": t for i, t in enumerate(times)})
    sorted_set = client.memory_usage(old, samples=0)
    client.delete(old)
    assert sorted_set is not None
    assert sorted_set >= 5 * used, (sorted_set, used)
    print(
        f"\nsliding_log, {limit:,} entries: {used / limit:.1f} B per unit; the sorted set "
        f"{sorted_set / limit:.1f} B ({sorted_set / used:.1f}x)"
    )


def test_sliding_log_memory_grows_with_the_limit(
    client: redis.Redis, limiter: tuple[Limiter, ManualClock]
):
    """The exact log keeps one entry per admitted unit: a cost of 10,000 takes 10,000 entries,
    well over a hundred times the room of 10, so limits are capped."""
    made, _ = limiter
    small = Policy("log-small", "10 per hour")
    large = Policy("log-large", "10000 per hour")
    _fill(made, small, "x")
    assert made.hit(large, "x", cost=10_000).allowed
    assert not made.hit(large, "x").allowed
    small_bytes = _bytes(client, made, small, "x")
    large_bytes = _bytes(client, made, large, "x")
    assert small_bytes <= 10 * PER_RATE
    assert 8 * 10_000 <= large_bytes <= LOG_UNIT_BYTES * 10_000
    assert large_bytes > 100 * small_bytes


def test_sliding_log_limits_above_the_cap_are_refused():
    assert Policy("log-cap", "10000 per hour").max_limit == 10_000
    with pytest.raises(ConfigError, match="max_log_entries=10000"):
        Policy("log-cap", "10001 per hour")
    with pytest.raises(ConfigError, match="max_log_entries=10000"):
        Policy("log-cap", "10 per second;20000 per day")
    with pytest.raises(ConfigError, match="max_log_entries=100"):
        Policy("log-cap", "101 per hour", max_log_entries=100)
    raised = Policy("log-cap", "1000000 per hour", max_log_entries=1_000_000)
    assert raised.max_log_entries == 1_000_000
    # The O(1) algorithms take any such limit.
    for algorithm in ("sliding_window", "fixed_window", "gcra"):
        assert Policy("log-cap", "1000000 per hour", algorithm).max_limit == 1_000_000
