"""The contract of each algorithm, on every backend (memory, Redis, Valkey) and API (sync, async).

Every expected number is computed by hand from the algorithm's documented semantics (the
docstrings of ``ratekeeper/_algorithms/*.py`` and ``ratekeeper/_algorithms/lua/*.lua``). Time is an
``ExactClock``: a ``ManualClock`` moved in whole microseconds and read back by the core as
exactly those microseconds, starting on an hour boundary so that every epoch-aligned window
(fixed_window, sliding_window) starts at a known instant.

The limiters raise on a store error (``failure_mode="raise"``) and wait long for a reply, so a
loaded machine cannot turn a decision into a degraded one.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import redis

from ratekeeper import CircuitBreaker, ConfigError, Decision, Limiter, Policy, Rate
from ratekeeper.testing import decision

from ..conftest import AsyncDriver, MakeLimiter, Pttl
from ..support.clocks import ALIGNED_US, ExactClock
from ..support.servers import RedisServer

#: The counter algorithms: everything but concurrency, which hands out leases.
COUNTERS = ["sliding_log", "sliding_window", "fixed_window", "gcra", "token_bucket"]


@pytest.fixture
def clock() -> ExactClock:
    return ExactClock()


@pytest.fixture
def make(make_limiter: MakeLimiter, backend: str, clock: ExactClock) -> MakeLimiter:
    """``make_limiter`` on the exact clock, raising on store errors, with long timeouts."""

    def build(**options: Any) -> Any:
        options.setdefault("clock", clock)
        options.setdefault("failure_mode", "raise")
        options.setdefault("breaker", CircuitBreaker(slow_call=60.0))
        if backend != "memory://":
            options.setdefault("timeout", 10.0)
            options.setdefault("connect_timeout", 10.0)
        return make_limiter(**options)

    return build


@pytest.fixture
def limiter(make: MakeLimiter) -> Any:
    return make()


def assert_ttl(pttl: Pttl, limiter: Any, backend: str, key: str, expected_ms: int) -> None:
    """The key's TTL is the one its script sets: exact on the memory keyspace (which runs on
    the manual clock), at most that and not a second less on a server (real time)."""
    left = pttl(limiter, key)
    if backend == "memory://":
        assert left == expected_ms, key
    else:
        assert expected_ms - 1000 < left <= expected_ms, key


class BlockingLease:
    """An AsyncLease driven on the AsyncDriver's loop."""

    def __init__(self, driver: AsyncDriver, lease: Any) -> None:
        self.driver = driver
        self.lease = lease

    @property
    def allowed(self) -> bool:
        return bool(self.lease.allowed)

    @property
    def decision(self) -> Decision:
        return self.lease.decision  # type: ignore[no-any-return]

    @property
    def held(self) -> bool:
        return bool(self.lease.held)

    def release(self) -> bool:
        return bool(self.driver.loop.run_until_complete(self.lease.release()))


def acquire(limiter: Any, policy: Policy, identity: Any, cost: int = 1) -> Any:
    """``limiter.acquire`` for either API, as a lease with a blocking ``release``."""
    if isinstance(limiter, AsyncDriver):
        acquiring = limiter.limiter.acquire(policy, identity, cost)

        async def take() -> Any:
            return await acquiring

        return BlockingLease(limiter, limiter.loop.run_until_complete(take()))
    return limiter.acquire(policy, identity, cost)


# == every counter algorithm =================================================================
#
# "5 per 10 seconds", hit five times at a window start t, then once more. The sixth waits:
#   sliding_log     for the first entry to leave: t + 10 s                       -> 10 s
#   fixed_window    for the window to end: t + 10 s                              -> 10 s
#   sliding_window  curr 5 + 1 > 5, so in the next window, at e' (ms) where
#                   5 * (10000 - e') / 10000 + 1 <= 5: e' = 2000 ms              -> 12 s
#   gcra            T = 2 s, burst 5: TAT = t + 10 s; 1 more fits at t + 2 s     ->  2 s
# and each reports when its state is empty again (reset_after):
#   sliding_log 10 s, fixed_window 10 s, sliding_window t + 2 W = 20 s, gcra TAT = 10 s.

SIXTH = {
    "sliding_log": (10.0, 10.0),
    "fixed_window": (10.0, 10.0),
    "sliding_window": (12.0, 20.0),
    "gcra": (2.0, 10.0),
    "token_bucket": (2.0, 10.0),
}


@pytest.mark.parametrize("algorithm", COUNTERS)
def test_limit_then_deny_with_the_exact_wait(
    limiter: Any, clock: ExactClock, algorithm: str
) -> None:
    policy = Policy("five", "5 per 10 seconds", algorithm)
    decisions = [limiter.hit(policy, "a") for _ in range(5)]
    assert [d.allowed for d in decisions] == [True] * 5
    assert [d.remaining for d in decisions] == [4, 3, 2, 1, 0]
    retry, reset = SIXTH[algorithm]
    sixth = limiter.hit(policy, "a")
    assert sixth == decision(
        False, rate="5 per 10 seconds", reset_after=reset, retry_after=retry, policy=policy.name
    )
    # One microsecond before the wait ends: still denied, with one microsecond to go.
    clock.advance_us(round(retry * 1_000_000) - 1)
    early = limiter.hit(policy, "a")
    assert not early.allowed
    assert early.retry_after == 0.000_001
    clock.advance_us(1)
    assert limiter.hit(policy, "a").allowed


@pytest.mark.parametrize("algorithm", COUNTERS)
def test_cost_consumes_units_and_a_denial_writes_nothing(limiter: Any, algorithm: str) -> None:
    policy = Policy("cost", "5 per 10 seconds", algorithm)
    assert limiter.hit(policy, "a", cost=3).remaining == 2
    denied = limiter.hit(policy, "a", cost=3)
    assert not denied.allowed
    assert denied.remaining == 2
    # The denial consumed nothing: exactly two units are left.
    last = limiter.hit(policy, "a", cost=2)
    assert last.allowed
    assert last.remaining == 0
    assert not limiter.hit(policy, "a").allowed


@pytest.mark.parametrize("algorithm", [*COUNTERS, "gcra-burst"])
def test_cost_above_capacity_never_passes_and_writes_nothing(
    limiter: Any, clock: ExactClock, pttl: Pttl, algorithm: str
) -> None:
    if algorithm == "gcra-burst":
        # With a burst of 3, a cost of 4 never fits, although it is within the limit of 10.
        policy, cost, capacity = Policy("never", "10 per 10 seconds", "gcra", burst=3), 4, 3
    else:
        policy, cost, capacity = Policy("never", "5 per 10 seconds", algorithm), 6, 5
    never = limiter.hit(policy, "a", cost=cost)
    assert never == decision(
        False, rate=policy.rates[0], remaining=capacity, retry_after=math.inf, policy=policy.name
    )
    assert limiter.peek(policy, "a", cost=cost).retry_after == math.inf
    (key,) = limiter.keys(policy, "a")
    assert pttl(limiter, key) == -2  # nothing was written
    assert limiter.hit(policy, "a", cost=capacity).allowed
    clock.advance(3600)
    assert limiter.hit(policy, "a", cost=cost).retry_after == math.inf


@pytest.mark.parametrize("algorithm", COUNTERS)
def test_peek_never_consumes(limiter: Any, clock: ExactClock, algorithm: str) -> None:
    policy = Policy("peek", "5 per 10 seconds", algorithm)
    for cost in (1, 5, 6, 1, 2, 5):
        for _ in range(10):
            limiter.peek(policy, "a", cost=cost)
    assert limiter.peek(policy, "a").remaining == 5
    assert [limiter.hit(policy, "a").allowed for _ in range(6)] == [True] * 5 + [False]
    before = limiter.peek(policy, "a", cost=2)
    for _ in range(10):
        assert limiter.peek(policy, "a", cost=2) == before
    clock.advance(1)
    assert limiter.peek(policy, "a", cost=2).retry_after == pytest.approx(
        before.retry_after - 1, abs=1e-9
    )


@pytest.mark.parametrize("algorithm", COUNTERS)
def test_reset_forgets_one_identity(limiter: Any, algorithm: str) -> None:
    policy = Policy("reset", "2/hour", algorithm)
    for identity in ("a", "b"):
        assert [limiter.hit(policy, identity).allowed for _ in range(3)] == [True, True, False]
    limiter.reset(policy, "a")
    assert limiter.peek(policy, "a") == decision(
        True, rate="2/hour", remaining=2, reset_after=0.0, policy=policy.name
    )
    assert [limiter.hit(policy, "a").allowed for _ in range(3)] == [True, True, False]
    assert not limiter.hit(policy, "b").allowed  # b was not reset
    limiter.reset(policy, "never-seen")


# -- several rates: all or nothing -----------------------------------------------------------


@pytest.mark.parametrize("algorithm", COUNTERS)
def test_a_denial_by_either_rate_consumes_from_none(
    limiter: Any, clock: ExactClock, algorithm: str
) -> None:
    """Identity "a" is denied once by the per-second rate and once by the per-minute one;
    identity "b" makes the same admitted hits without the denied ones. Had a denial consumed
    from any rate, some later peek (any cost, any instant) would tell them apart."""
    policy = Policy("multi", "2/second;3/minute", algorithm)
    second, minute = policy.rates
    for identity in ("a", "b"):
        assert limiter.hit(policy, identity, cost=2).allowed
    by_second = limiter.hit(policy, "a")
    assert not by_second.allowed
    assert by_second.rate == second
    clock.advance(2)  # the per-second rate is clear again (sliding_window: prev too)
    for identity in ("a", "b"):
        assert limiter.hit(policy, identity).allowed  # the minute is now full
    by_minute = limiter.hit(policy, "a")
    assert not by_minute.allowed
    assert by_minute.rate == minute
    for later in (0, 0.25, 0.5, 1, 10, 30, 58, 62, 125):  # seconds after the second denial
        clock.advance_us(ALIGNED_US + 2_000_000 + round(later * 1_000_000) - clock.us)
        for cost in (1, 2, 3, 4):
            assert limiter.peek(policy, "a", cost=cost) == limiter.peek(policy, "b", cost=cost)


def test_fixed_window_multi_rate_by_hand(limiter: Any, clock: ExactClock) -> None:
    """Epoch-aligned windows of 2 s and 3 s, so that each can roll while the other does not."""
    policy = Policy("fw-multi", "3 per 2 seconds;4 per 3 seconds", "fixed_window")
    two, three = policy.rates
    assert ALIGNED_US % 6_000_000 == 0
    assert limiter.hit(policy, "a", cost=2).allowed  # t=0: [0,2) 2 of 3, [0,3) 2 of 4
    clock.advance(2.5)
    assert limiter.hit(policy, "a", cost=2).allowed  # t=2.5: [2,4) 2 of 3, [0,3) 4 of 4
    denied = limiter.hit(policy, "a")  # refused by the 3 s window alone
    assert denied == decision(
        False, rate=three, remaining=0, reset_after=0.5, retry_after=0.5, policy=policy.name
    )
    clock.advance(0.5)  # t=3: [2,4) still holds 2 (3 had the denial counted), [3,6) is new
    assert limiter.peek(policy, "a") == decision(
        True, rate=two, remaining=1, reset_after=1.0, policy=policy.name
    )
    assert limiter.hit(policy, "a").allowed  # [2,4) 3 of 3, [3,6) 1 of 4
    denied = limiter.hit(policy, "a")  # refused by the 2 s window alone
    assert denied == decision(
        False, rate=two, remaining=0, reset_after=1.0, retry_after=1.0, policy=policy.name
    )
    clock.advance(1)  # t=4: [4,6) is new; [3,6) holds 1 (2 had the denial counted)
    assert limiter.peek(policy, "a") == decision(
        True, rate=three, remaining=3, reset_after=2.0, policy=policy.name
    )


# == sliding_log =============================================================================


def test_sliding_log_waits_for_an_entry_from_a_clock_ahead(limiter: Any, clock: ExactClock) -> None:
    """Two clients whose clocks are 4 s apart share a log. The entry stamped by the clock ahead
    counts for the client behind, and its window is empty only once that entry has left it.
    The log keeps time order: the client behind stamps its entry with the newest time already
    logged, so its entry too leaves only then (a longer wait, never a wider admission)."""
    policy = Policy("skew", "3 per 10 seconds")
    clock.advance(4)
    assert limiter.hit(policy, "a").allowed  # stamped t + 4 s
    clock.rewind(4)
    # Stamped t + 4 s too (clamped to the newest); the log empties at t + 14 s.
    expected = decision(
        True, rate="3 per 10 seconds", remaining=1, reset_after=14.0, policy=policy.name
    )
    assert limiter.hit(policy, "a") == expected
    assert limiter.peek(policy, "a") == expected
    # A cost of 2 waits for the older of the two entries to leave: both are at t + 4 s, 14 s.
    assert limiter.hit(policy, "a", cost=2) == replace(expected, allowed=False, retry_after=14.0)
    clock.advance_us(14_000_000 - 1)  # a microsecond before: still denied
    assert not limiter.hit(policy, "a", cost=2).allowed
    clock.advance_us(1)
    assert limiter.hit(policy, "a", cost=2).allowed


# == fixed_window ============================================================================


def test_fixed_window_waits_for_the_window_end(limiter: Any, clock: ExactClock) -> None:
    policy = Policy("fw", "3/minute", "fixed_window")
    clock.advance(10)  # 10 s into an aligned minute
    decisions = [limiter.hit(policy, "a") for _ in range(3)]
    assert decisions[-1] == decision(
        True, rate="3/minute", remaining=0, reset_after=50.0, policy=policy.name
    )
    assert limiter.hit(policy, "a") == decision(
        False, rate="3/minute", remaining=0, reset_after=50.0, retry_after=50.0, policy=policy.name
    )
    clock.advance(49.999_999)
    assert limiter.hit(policy, "a").retry_after == 0.000_001
    clock.advance_us(1)  # the next window: a fresh count, whatever happened just before
    assert limiter.hit(policy, "a") == decision(
        True, rate="3/minute", remaining=2, reset_after=60.0, policy=policy.name
    )
    # Up to twice the limit across a boundary: the documented weakness of fixed windows.
    assert [limiter.hit(policy, "a").allowed for _ in range(3)] == [True, True, False]


def test_fixed_window_ttl_ends_with_the_window(
    limiter: Any, clock: ExactClock, backend: str, pttl: Pttl
) -> None:
    policy = Policy("fw-ttl", "5 per 10 seconds", "fixed_window")
    (key,) = limiter.keys(policy, "a")
    clock.advance(2.5)
    limiter.hit(policy, "a")
    assert_ttl(pttl, limiter, backend, key, 7_500 + 1_000)  # window end + margin
    clock.advance(7)  # 0.5 s before the window ends
    limiter.hit(policy, "a")
    # Not re-armed to now + window: still the window end (+ margin), which is now closer.
    assert_ttl(pttl, limiter, backend, key, 500 + 1_000)
    clock.advance(0.5)  # the next window
    limiter.hit(policy, "a")
    assert_ttl(pttl, limiter, backend, key, 10_000 + 1_000)


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window"])
def test_on_the_server_clock_a_hit_in_the_same_window_keeps_the_ttl(
    server: RedisServer, admin: redis.Redis, key_prefix: str, algorithm: str
) -> None:
    """On the server's clock the TTL set when a window starts already runs to its end (plus
    the margin), so later hits in that window leave it alone: a TTL no hit would set stays."""
    policy = Policy("ttl-kept", "5 per day", algorithm)
    with Limiter.from_url(server.url, key_prefix=key_prefix, deny_cache=0) as limiter:
        (key,) = limiter.keys(policy, "a")
        assert limiter.hit(policy, "a").remaining == 4
        assert 0 < admin.pttl(key) <= 2 * 86_400_000 + 1_000
        start = admin.hget(key, "w1")
        admin.pexpire(key, 3 * 86_400_000)  # a TTL no hit would set
        second = limiter.hit(policy, "a")
        assert second.remaining == 3
        if admin.hget(key, "w1") == start:  # not across midnight UTC, when a new window starts
            assert admin.pttl(key) > 3 * 86_400_000 - 60_000


# == sliding_window ==========================================================================


def test_sliding_window_weighs_the_previous_window(limiter: Any, clock: ExactClock) -> None:
    """10/minute; 10 hits in the previous window. 30 s into the current window the previous
    count weighs 10 * (60000 - 30000) / 60000 = 5: five more fit."""
    policy = Policy("sw", "10/minute", "sliding_window")
    clock.advance(10)
    assert limiter.hit(policy, "a", cost=10).remaining == 0
    clock.advance(80)  # 30 s into the next minute
    assert limiter.peek(policy, "a") == decision(
        True, rate="10/minute", remaining=5, reset_after=30.0, policy=policy.name
    )
    for left in (4, 3, 2, 1, 0):
        # Counted now, weighted through the end of the next window: 90 s.
        assert limiter.hit(policy, "a") == decision(
            True, rate="10/minute", remaining=left, reset_after=90.0, policy=policy.name
        )
    # The sixth fits once 10 * (60000 - e') / 60000 + 5 + 1 <= 10, i.e. e' = 36000 ms: 6 s.
    assert limiter.hit(policy, "a") == decision(
        False, rate="10/minute", remaining=0, reset_after=90.0, retry_after=6.0, policy=policy.name
    )
    clock.advance(5.999_999)  # e = 35999 ms: the weight is still above 4
    assert limiter.hit(policy, "a").retry_after == 0.000_001
    clock.advance_us(1)
    admitted = limiter.hit(policy, "a")
    assert admitted.allowed
    assert admitted.remaining == 0  # 10 - 6 - 4


def test_sliding_window_full_window_waits_into_the_next(limiter: Any, clock: ExactClock) -> None:
    """5/minute, all five at 10 s: a sixth cannot fit in this window (5 + 1 > 5); in the next
    one it fits when 5 * (60000 - e') / 60000 + 1 <= 5, i.e. e' = 12000 ms: 50 + 12 = 62 s."""
    policy = Policy("sw-next", "5/minute", "sliding_window")
    clock.advance(10)
    assert limiter.hit(policy, "a", cost=5).allowed
    assert limiter.hit(policy, "a") == decision(
        False, rate="5/minute", remaining=0, reset_after=110.0, retry_after=62.0, policy=policy.name
    )
    clock.advance(61.999)  # 11999 ms into the next window
    assert not limiter.hit(policy, "a").allowed
    clock.advance(0.001)
    assert limiter.hit(policy, "a") == decision(
        True, rate="5/minute", remaining=0, reset_after=108.0, policy=policy.name
    )


# == gcra and token_bucket ===================================================================


@pytest.mark.parametrize("algorithm", ["gcra", "token_bucket"])
def test_gcra_burst_then_one_per_interval(limiter: Any, clock: ExactClock, algorithm: str) -> None:
    """10/second, burst 10 by default: T = 100 ms. Ten at t; the eleventh waits 100 ms."""
    policy = Policy("gcra", "10/second", algorithm)
    for k in range(1, 11):
        assert limiter.hit(policy, "a") == decision(
            True, rate="10/second", remaining=10 - k, reset_after=k / 10, policy=policy.name
        )
    assert limiter.hit(policy, "a") == decision(
        False, rate="10/second", remaining=0, reset_after=1.0, retry_after=0.1, policy=policy.name
    )
    clock.advance(0.1)
    assert limiter.hit(policy, "a") == decision(
        True, rate="10/second", remaining=0, reset_after=1.0, policy=policy.name
    )
    # Time counts in whole milliseconds: 99.999 ms later is still 99 ms later.
    clock.advance(0.099_999)
    assert limiter.hit(policy, "a").retry_after == 0.000_001
    clock.advance_us(1)
    assert limiter.hit(policy, "a").allowed


@pytest.mark.parametrize("algorithm", ["gcra", "token_bucket"])
def test_gcra_burst_one_admits_exactly_the_rate(
    limiter: Any, clock: ExactClock, algorithm: str
) -> None:
    policy = Policy("gcra-b1", "10/second", algorithm, burst=1)
    for _ in range(20):
        assert limiter.hit(policy, "a") == decision(
            True, rate="10/second", remaining=0, reset_after=0.1, policy=policy.name
        )
        clock.advance(0.099)
        assert limiter.hit(policy, "a").retry_after == pytest.approx(0.001, abs=1e-9)
        clock.advance(0.001)


def test_gcra_burst_above_the_limit(limiter: Any, clock: ExactClock) -> None:
    """2/second with burst 5: T = 500 ms; five at once, then one per 500 ms."""
    policy = Policy("gcra-b5", "2/second", "gcra", burst=5)
    assert [limiter.hit(policy, "a").remaining for _ in range(5)] == [4, 3, 2, 1, 0]
    assert limiter.hit(policy, "a") == decision(
        False, rate="2/second", remaining=0, reset_after=2.5, retry_after=0.5, policy=policy.name
    )
    clock.advance(0.5)
    assert limiter.hit(policy, "a").allowed
    assert not limiter.hit(policy, "a").allowed


def test_token_bucket_is_gcra(make: MakeLimiter, clock: ExactClock) -> None:
    """The alias: the same decisions for the same calls, and the same state (the same keys)."""
    gcra, bucket = make(), make()
    sequence = [(0, 3), (0, 3), (0, 5), (0.2, 1), (0.05, 2), (0.001, 1), (0.7, 6), (0, 1)]
    for burst in (None, 4):
        one = Policy("alias", "10/second", "gcra", burst=burst)
        two = Policy("alias", "10/second", "token_bucket", burst=burst)
        assert gcra.keys(one, "a") == bucket.keys(two, "a")
        for step, cost in sequence:
            clock.advance(step)
            assert gcra.hit(one, f"a{burst}", cost) == bucket.hit(two, f"b{burst}", cost)
    # Same keys, same state: token_bucket hits are gcra's.
    shared_gcra = Policy("shared", "5/second", "gcra")
    shared_bucket = Policy("shared", "5/second", "token_bucket")
    assert gcra.hit(shared_bucket, "s", cost=5).allowed
    peeked = gcra.peek(shared_gcra, "s")
    assert not peeked.allowed
    assert peeked.retry_after == 0.2


# == TTLs ====================================================================================


#: (algorithm, rates, cost of a hit 2.5 s into an aligned window, the TTL it sets in ms)
TTL_CASES = [
    # The longest window, plus the margin.
    ("sliding_log", "2/second;5 per 30 seconds", 1, 30_000 + 1_000),
    # 2.5 s into an aligned 10 s window: counted through the next one, to t + 17.5 s.
    ("sliding_window", "5 per 10 seconds", 1, 17_500 + 1_000),
    # 2.5 s into an aligned 10 s window: to its end.
    ("fixed_window", "5 per 10 seconds", 1, 7_500 + 1_000),
    # T = 2 s: cost 2 puts the TAT 4 s ahead.
    ("gcra", "5 per 10 seconds", 2, 4_000 + 1_000),
    ("token_bucket", "5 per 10 seconds", 2, 4_000 + 1_000),
]


@pytest.mark.parametrize("case", TTL_CASES, ids=[case[0] for case in TTL_CASES])
def test_every_key_written_has_the_documented_ttl(
    limiter: Any,
    clock: ExactClock,
    backend: str,
    pttl: Pttl,
    case: tuple[str, str, int, int],
) -> None:
    algorithm, rates, cost, ttl_ms = case
    policy = Policy("ttl", rates, algorithm)
    keys = limiter.keys(policy, "a")
    clock.advance(2.5)
    assert all(pttl(limiter, key) == -2 for key in keys)
    assert limiter.hit(policy, "a", cost=cost).allowed
    for key in keys:
        assert_ttl(pttl, limiter, backend, key, ttl_ms)


def test_concurrency_key_has_the_documented_ttl(
    limiter: Any, clock: ExactClock, backend: str, pttl: Pttl
) -> None:
    policy = Policy("ttl-leases", "5 per 10 seconds", "concurrency")
    (key,) = limiter.keys(policy, "a")
    first = acquire(limiter, policy, "a")
    assert_ttl(pttl, limiter, backend, key, 10_000 + 1_000)  # the latest expiry + margin
    clock.advance(4)
    acquire(limiter, policy, "a")
    assert_ttl(pttl, limiter, backend, key, 10_000 + 1_000)
    assert first.release()
    assert pttl(limiter, key) > 0  # the other lease is still held


# == concurrency =============================================================================


def test_concurrency_limit_and_exact_wait(limiter: Any, clock: ExactClock) -> None:
    policy = Policy("jobs", "3 per 30 seconds", "concurrency")
    leases = []
    for left in (2, 1, 0):
        lease = acquire(limiter, policy, "a")
        assert lease.decision == decision(
            True, rate="3 per 30 seconds", remaining=left, reset_after=30.0, policy=policy.name
        )
        assert lease.allowed
        assert lease.held
        leases.append(lease)
        clock.advance(1)
    # At t+3 the oldest lease (t) expires at t+30, the newest (t+2) at t+32.
    denied = acquire(limiter, policy, "a")
    assert denied.decision == decision(
        False, rate="3 per 30 seconds", reset_after=29.0, retry_after=27.0, policy=policy.name
    )
    assert not denied.allowed
    assert not denied.held
    assert denied.release() is False  # never granted: nothing to give back
    # A cost of 2 needs two units to expire: the second oldest, at t+31.
    assert limiter.peek(policy, "a", cost=2).retry_after == 28.0
    assert limiter.peek(policy, "a", cost=4).retry_after == math.inf
    # Releasing frees a slot at once.
    assert leases[1].release() is True
    assert not leases[1].held
    assert limiter.peek(policy, "a") == decision(
        True, rate="3 per 30 seconds", remaining=1, reset_after=29.0, policy=policy.name
    )
    assert leases[1].release() is False  # idempotent
    replacement = acquire(limiter, policy, "a")
    assert replacement.decision == decision(
        True, rate="3 per 30 seconds", remaining=0, reset_after=30.0, policy=policy.name
    )
    # Unreleased leases expire after the period: at t+30 the first one is gone.
    clock.advance(27)
    assert limiter.peek(policy, "a") == decision(
        True, rate="3 per 30 seconds", remaining=1, reset_after=3.0, policy=policy.name
    )
    assert acquire(limiter, policy, "a").allowed


def test_concurrency_cost(limiter: Any, pttl: Pttl) -> None:
    policy = Policy("jobs-cost", "5 per 30 seconds", "concurrency")
    big = acquire(limiter, policy, "a", cost=3)
    assert big.decision.remaining == 2
    assert not acquire(limiter, policy, "a", cost=3).allowed
    assert acquire(limiter, policy, "a", cost=2).decision.remaining == 0
    assert big.release() is True  # all three units come back
    assert limiter.peek(policy, "a", cost=3).allowed
    never = acquire(limiter, policy, "b", cost=6)
    assert never.decision == decision(
        False, rate="5 per 30 seconds", remaining=5, retry_after=math.inf, policy=policy.name
    )
    (key,) = limiter.keys(policy, "b")
    assert pttl(limiter, key) == -2


def test_released_lease_expired_or_reset_returns_false(limiter: Any, clock: ExactClock) -> None:
    """release() says whether the lease was still held: not once it has expired, nor after a
    reset of its identity. (Both replies from the store are "not held": ok = 0.)"""
    policy = Policy("jobs-expire", "2 per 10 seconds", "concurrency")
    expired = acquire(limiter, policy, "a")
    clock.advance(10)  # exactly the lease timeout
    assert limiter.peek(policy, "a").remaining == 2
    assert expired.release() is False
    cleared = acquire(limiter, policy, "b")
    limiter.reset(policy, "b")
    assert cleared.release() is False


def test_lease_context_manager_releases(make: MakeLimiter, backend: str) -> None:
    limiter = make()
    policy = Policy("jobs-with", "2 per 30 seconds", "concurrency")
    if isinstance(limiter, AsyncDriver):

        async def main() -> tuple[int, int, bool]:
            async with limiter.limiter.acquire(policy, "a") as lease:
                inside = (await limiter.limiter.peek(policy, "a")).remaining
                assert lease.allowed
            after = (await limiter.limiter.peek(policy, "a")).remaining
            return inside, after, lease.held

        inside, after, held = limiter.loop.run_until_complete(main())
    else:
        with limiter.acquire(policy, "a") as lease:
            assert lease.allowed
            inside = limiter.peek(policy, "a").remaining
        after, held = limiter.peek(policy, "a").remaining, lease.held
    assert (inside, after, held) == (1, 2, False)


def test_hit_and_acquire_refuse_the_wrong_kind_of_policy(limiter: Any) -> None:
    leases = Policy("leases", "2 per 30 seconds", "concurrency")
    counter = Policy("counter", "2 per 30 seconds", "gcra")
    with pytest.raises(ConfigError, match="acquire"):
        limiter.hit(leases, "a")
    with pytest.raises(ConfigError, match="hit"):
        acquire(limiter, counter, "a")
    # peek works on both kinds, and the refused calls consumed nothing.
    assert limiter.peek(leases, "a").remaining == 2
    assert limiter.peek(counter, "a").remaining == 2


# == exact at the validation bounds ==========================================================
#
# Each policy below passes validation, so the promise of exact integer arithmetic holds for it.
# The expected numbers follow from the documented formulas in exact integers (the memory
# reference agrees); the scripts compute in Lua doubles, which hold integers only up to 2**53,
# so the counter algorithms refuse limits their arithmetic could not hold exactly.


def test_fixed_window_limit_of_2_52_is_exact(limiter: Any) -> None:
    """limit 2**52 (the largest fixed_window takes): with 2 units used, a cost of 2**52 - 1 is
    2**52 + 1 > limit and must be denied."""
    rate = Rate(2**52, 60)
    policy = Policy("fw-max", rate, "fixed_window")
    assert limiter.hit(policy, "a").allowed
    assert limiter.hit(policy, "a").allowed
    assert limiter.hit(policy, "a", cost=2**52 - 1) == decision(
        False, rate=rate, remaining=2**52 - 2, reset_after=60.0, policy=policy.name
    )
    assert limiter.hit(policy, "a", cost=2**52 - 2).remaining == 0
    assert not limiter.hit(policy, "a").allowed
    # A cost far above the limit is never admitted, whatever doubles do to the sum.
    assert limiter.hit(policy, "b", cost=2**53).retry_after == math.inf


def test_sliding_window_limit_of_2_52_per_ms_is_exact(limiter: Any) -> None:
    """limit 2**52 per 1 ms. Full, a hit of 1 cannot fit in this window (2**52 + 1 > limit);
    in the next one at e' = 1 - floor((2**52 - 1) / 2**52) = 1 ms: 2 ms from now."""
    rate = Rate(2**52, 0.001)
    policy = Policy("sw-max", rate, "sliding_window")
    assert limiter.hit(policy, "a", cost=2**52).allowed
    assert limiter.hit(policy, "a") == decision(
        False, rate=rate, remaining=0, reset_after=0.002, retry_after=0.002, policy=policy.name
    )


GCRA_MAX_LIMIT = 2**53 // 1001


def test_gcra_retry_after_stays_positive_at_its_largest_limit(
    limiter: Any, clock: ExactClock
) -> None:
    """The largest gcra limit per 1 ms, burst 2: two at t fill the burst; 250 us later one more
    needs the next whole millisecond: retry_after = 750 us (never 0 or negative)."""
    rate = Rate(GCRA_MAX_LIMIT, 0.001)
    policy = Policy("gcra-max", rate, "gcra", burst=2)
    assert limiter.hit(policy, "a", cost=2).allowed
    clock.advance_us(250)
    denied = limiter.hit(policy, "a")
    assert not denied.allowed
    assert denied.retry_after == 0.000_750


@pytest.mark.parametrize(
    ("burst", "cost"),
    [(2**52, 2**52), (None, 1_337_569_089_329)],
    ids=["burst-2**52", "default-burst"],
)
def test_gcra_reset_after_is_exact_for_large_limits(
    limiter: Any, burst: int | None, cost: int
) -> None:
    """TAT - t = cost / limit ms, so reset_after = ceil(cost * 1000 / limit) us, in integers."""
    rate = Rate(GCRA_MAX_LIMIT, 0.001)
    policy = Policy("gcra-big", rate, "gcra", burst=burst)
    admitted = limiter.hit(policy, "a", cost=cost)
    assert admitted.allowed
    assert admitted.reset_after == -(-cost * 1000 // GCRA_MAX_LIMIT) / 1_000_000


@pytest.mark.parametrize(
    ("algorithm", "limit"),
    [
        ("fixed_window", 2**52 + 1),
        ("sliding_window", 2**52 + 1),
        ("gcra", GCRA_MAX_LIMIT + 1),
        ("token_bucket", GCRA_MAX_LIMIT + 1),
    ],
)
def test_limits_beyond_exact_double_arithmetic_are_refused(algorithm: str, limit: int) -> None:
    with pytest.raises(ConfigError, match=f"{algorithm} takes limits up to"):
        Policy("x", Rate(limit, 0.001), algorithm)


# == bad configuration =======================================================================


def test_unknown_algorithm_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown algorithm 'leaky_bucket'") as caught:
        Policy("x", "1/second", "leaky_bucket")
    for known in (*COUNTERS, "concurrency"):
        assert known in str(caught.value)


@pytest.mark.parametrize("burst", [0, -1, 2**53 + 1])
def test_burst_out_of_range(burst: int) -> None:
    with pytest.raises(ConfigError, match="burst must be between 1 and 2"):
        Policy("x", "10/second", "gcra", burst=burst)


@pytest.mark.parametrize("burst", [True, 1.5, "5"])
def test_burst_not_an_int(burst: Any) -> None:
    with pytest.raises(ConfigError, match="burst must be an int"):
        Policy("x", "10/second", "gcra", burst=burst)


@pytest.mark.parametrize(
    "algorithm", ["sliding_log", "sliding_window", "fixed_window", "concurrency"]
)
def test_burst_only_for_gcra(algorithm: str) -> None:
    with pytest.raises(ConfigError, match=f"burst applies to the gcra .*{algorithm}"):
        Policy("x", "10/second", algorithm, burst=5)
    assert Policy("x", "10/second", "token_bucket", burst=5).burst == 5


@pytest.mark.parametrize("algorithm", ["gcra", "token_bucket"])
def test_burst_only_for_a_single_rate(algorithm: str) -> None:
    with pytest.raises(ConfigError, match="burst applies to a single-rate"):
        Policy("x", "10/second;100/minute", algorithm, burst=5)


def test_concurrency_takes_one_rate() -> None:
    with pytest.raises(ConfigError, match=r"takes one limit.*got 2 rates"):
        Policy("x", "10/second;100/minute", "concurrency")
    with pytest.raises(ConfigError, match="concurrency limit above 100000"):
        Policy("x", "100001/minute", "concurrency")
    assert Policy("x", "100000/minute", "concurrency").max_limit == 100_000


def test_sliding_window_limit_times_period_bound() -> None:
    at_bound = Rate(2**52 // 3_600_000, 3600)
    assert Policy("x", at_bound, "sliding_window").rates == (at_bound,)
    with pytest.raises(ConfigError, match=r"sliding_window needs limit x period in ms <= 2\*\*52"):
        Policy("x", Rate(2**52 // 3_600_000 + 1, 3600), "sliding_window")
    with pytest.raises(ConfigError, match="sliding_window"):
        Policy("x", [Rate(1, 1), Rate(2**52 // 60_000 + 1, 60)], "sliding_window")


def test_gcra_burst_times_period_bound() -> None:
    assert Policy("x", Rate(10_000, 1), "gcra", burst=2**52 // 1000).burst == 2**52 // 1000
    with pytest.raises(ConfigError, match=r"gcra needs burst x period in ms <= 2\*\*52"):
        Policy("x", Rate(10_000, 1), "gcra", burst=2**52 // 1000 + 1)
    # A refill horizon (burst x period / limit) beyond 2**51 us, about 71 years, is refused.
    with pytest.raises(ConfigError, match="71 years"):
        Policy("x", Rate(1, 1), "gcra", burst=2**52 // 1000)
    # Without a burst, each rate's burst is its limit.
    with pytest.raises(ConfigError, match=r"burst x period in ms <= 2\*\*52"):
        Policy("x", Rate(2**52 // 1000 + 1, 1), "token_bucket")
    assert Policy("x", Rate(2**52 // 1000, 1), "token_bucket").burst is None


# == the deny cache keeps decisions exact ====================================================


@pytest.mark.parametrize("algorithm", ["sliding_window", "gcra"])
def test_cached_denial_does_not_answer_a_cost_that_can_never_pass(
    limiter: Any, clock: ExactClock, algorithm: str
) -> None:
    """After a denial of cost 2 (cached), a cost above the limit must still be math.inf, and a
    larger cost its own, longer wait (the default limiter, deny cache on)."""
    policy = Policy("cache-never", "4 per 10 seconds", algorithm)
    assert limiter.hit(policy, "a", cost=4).allowed
    clock.advance(1)
    assert not limiter.hit(policy, "a", cost=2).allowed
    assert limiter.hit(policy, "a", cost=5).retry_after == math.inf
    # The same question asked without consuming (peek skips the cache) has the same answer.
    assert limiter.hit(policy, "a", cost=3).retry_after == limiter.peek(policy, "a", 3).retry_after


def test_cached_denial_is_not_reused_after_an_admission(limiter: Any, clock: ExactClock) -> None:
    """sliding_log 4 per 10 s: entries at t, t+1, t+2. At t+3 a cost of 2 waits for t to leave
    (7 s). At t+4 one unit is admitted. At t+5 a cost of 2 waits for t+1 to leave: 6 s, and
    no unit remains: the denial cached at t+3 (5 s left, 1 remaining) is out of date."""
    policy = Policy("cache-stale", "4 per 10 seconds")
    for _ in range(3):
        assert limiter.hit(policy, "a").allowed
        clock.advance(1)
    assert limiter.hit(policy, "a", cost=2).retry_after == 7.0
    clock.advance(1)
    assert limiter.hit(policy, "a").allowed
    clock.advance(1)
    denied = limiter.hit(policy, "a", cost=2)
    assert denied.reason in (None, "deny_cache")  # a cached answer is fine, if it is exact
    assert replace(denied, reason=None) == decision(
        False, rate="4 per 10 seconds", reset_after=9.0, retry_after=6.0, policy=policy.name
    )
