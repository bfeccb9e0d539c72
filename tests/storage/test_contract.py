"""The contract every backend (memory, Redis, Valkey) and API (sync, async) must keep.

Time is a ``ManualClock`` passed as ``clock=``: the limiter then sends client time to the store,
so every backend sees the same instants and the expected numbers can be computed by hand.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from ratekeeper import AsyncLimiter, Decision, Limiter, ManualClock, Policy, Rate
from ratekeeper._engine.keys import KeyBuilder
from ratekeeper._model.decision import make_decision
from ratekeeper.testing import decision

from ..conftest import MakeLimiter, Pttl
from ..support.servers import RedisServer

T0 = 1_700_000_000.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


# -- the limit -------------------------------------------------------------------------------


def test_exact_limit_then_deny(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("exact", "5/minute")
    decisions = [limiter.hit(policy, "alice") for _ in range(5)]
    assert [d.allowed for d in decisions] == [True] * 5
    assert [d.remaining for d in decisions] == [4, 3, 2, 1, 0]
    for _ in range(3):
        denied = limiter.hit(policy, "alice")
        assert not denied.allowed
        assert denied.remaining == 0
        assert denied.retry_after == 60.0


def test_decision_fields_exact(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("fields", "3 per 10 seconds")
    rate = Rate(3, 10)
    assert limiter.hit(policy, "a") == decision(
        True, rate=rate, remaining=2, reset_after=10.0, policy=policy.name
    )
    clock.advance(1)
    assert limiter.hit(policy, "a") == decision(
        True, rate=rate, remaining=1, reset_after=10.0, policy=policy.name
    )
    clock.advance(1)
    assert limiter.hit(policy, "a") == decision(
        True, rate=rate, remaining=0, reset_after=10.0, policy=policy.name
    )
    # The 4th hit at t+2 waits for the entry of t to leave: t + 10 - (t + 2) = 8 s.
    assert limiter.hit(policy, "a") == decision(
        False, rate=rate, remaining=0, reset_after=10.0, retry_after=8.0, policy=policy.name
    )
    # Half a second later every number has moved by half a second.
    clock.advance(0.5)
    assert limiter.peek(policy, "a") == decision(
        False, rate=rate, remaining=0, reset_after=9.5, retry_after=7.5, policy=policy.name
    )


def test_retry_after_is_the_exact_wait(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("wait", "3 per 10 seconds")
    for _ in range(3):
        assert limiter.hit(policy, "a").allowed
        clock.advance(1)
    denied = limiter.hit(policy, "a")  # at t+3: the entry of t leaves at t+10
    assert denied.retry_after == 7.0
    clock.advance(7.0 - 0.000_001)
    one_us_early = limiter.hit(policy, "a")
    assert not one_us_early.allowed
    assert one_us_early.retry_after == 0.000_001
    clock.advance(0.000_001)
    assert limiter.hit(policy, "a").allowed


def test_reset_after_follows_the_newest_entry(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("reset-after", "5 per 10 seconds")
    assert limiter.peek(policy, "a").reset_after == 0.0  # nothing stored yet
    limiter.hit(policy, "a")
    clock.advance(3)
    assert limiter.hit(policy, "a").reset_after == 10.0
    clock.advance(1)
    assert limiter.peek(policy, "a").reset_after == 9.0
    clock.advance(9)  # t+13: the newest entry (t+3) has just left
    assert limiter.peek(policy, "a") == decision(
        True, rate=Rate(5, 10), remaining=5, reset_after=0.0, policy=policy.name
    )


# -- the window slides -----------------------------------------------------------------------


def test_window_slides(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("slide", "2 per 10 seconds")
    assert limiter.hit(policy, "a").allowed  # t
    clock.advance(4)
    assert limiter.hit(policy, "a").allowed  # t+4
    clock.advance(5.5)
    denied = limiter.hit(policy, "a")  # t+9.5
    assert not denied.allowed
    assert denied.retry_after == 0.5
    clock.advance(0.5)  # t+10: the entry of t has left, the one of t+4 has not
    admitted = limiter.hit(policy, "a")
    assert admitted.allowed
    assert admitted.remaining == 0
    again = limiter.hit(policy, "a")
    assert not again.allowed
    assert again.retry_after == 4.0  # t+4 leaves at t+14


def test_entry_leaves_at_exactly_t_plus_period(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("edge", "1 per 10 seconds")
    assert limiter.hit(policy, "a").allowed
    clock.advance(9.999)
    assert limiter.peek(policy, "a").retry_after == pytest.approx(0.001, abs=1e-9)
    clock.advance(0.001)
    assert limiter.peek(policy, "a") == decision(
        True, rate=Rate(1, 10), remaining=1, reset_after=0.0, policy=policy.name
    )
    assert limiter.hit(policy, "a").allowed


def test_a_hit_prunes_only_entries_outside_the_window(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("prune", "2 per 10 seconds")
    assert limiter.hit(policy, "a").allowed  # t
    clock.advance(10 - 0.000_001)
    # The entry of t is 1 us inside the window: this hit must count it, and must not drop it.
    assert limiter.hit(policy, "a").remaining == 0
    denied = limiter.peek(policy, "a")
    assert not denied.allowed
    assert denied.retry_after == 0.000_001
    clock.advance(0.000_001)
    assert limiter.peek(policy, "a").remaining == 1


# -- cost ------------------------------------------------------------------------------------


def test_cost_consumes_units(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("cost", "5 per 10 seconds")
    decision = limiter.hit(policy, "a", cost=3)
    assert decision.allowed
    assert decision.remaining == 2
    assert limiter.hit(policy, "a", cost=2).remaining == 0
    assert not limiter.hit(policy, "a").allowed


def test_cost_above_remaining_is_denied_exactly_and_writes_nothing(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("cost-over", "5 per 10 seconds")
    for _ in range(4):  # entries at t, t+1, t+2, t+3
        assert limiter.hit(policy, "a").allowed
        clock.advance(1)
    # At t+4 a cost of 3 needs 2 entries to leave; the 2nd oldest (t+1) leaves at t+11.
    denied = limiter.hit(policy, "a", cost=3)
    assert denied == decision(
        False, rate=Rate(5, 10), remaining=1, reset_after=9.0, retry_after=7.0, policy=policy.name
    )
    # The denial wrote nothing: one unit is still free.
    last = limiter.hit(policy, "a")
    assert last.allowed
    assert last.remaining == 0


def test_cost_above_limit_never_passes_and_writes_nothing(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("cost-never", "5 per 10 seconds")
    never = limiter.hit(policy, "a", cost=6)
    assert never == decision(
        False, rate=Rate(5, 10), remaining=5, retry_after=math.inf, policy=policy.name
    )
    assert limiter.peek(policy, "a", cost=6).retry_after == math.inf
    first = limiter.hit(policy, "a")
    assert first.allowed
    assert first.remaining == 4
    # Still never, however much time passes.
    clock.advance(3600)
    assert limiter.hit(policy, "a", cost=10**6).retry_after == math.inf


def test_cost_above_one_of_several_limits(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("cost-multi", "2/second;10/minute")
    never = limiter.hit(policy, "a", cost=3)
    assert not never.allowed
    assert never.retry_after == math.inf
    assert never.rate == Rate(2, 1)
    assert limiter.hit(policy, "a", cost=2).allowed


# -- several rates ---------------------------------------------------------------------------


def test_multi_rate_denial_by_longer_rate_leaves_shorter_untouched(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("multi", "2/second;3/minute")
    # Same name and identity, so the same log: a probe of the per-second rate alone.
    per_second = Policy("multi", "2/second")
    assert limiter.hit(policy, "a").allowed  # t
    assert limiter.hit(policy, "a").allowed  # t
    clock.advance(1)
    assert limiter.hit(policy, "a").allowed  # t+1: the minute is now full
    assert limiter.peek(per_second, "a").remaining == 1
    denied = limiter.hit(policy, "a")  # the second has room, the minute has not
    assert denied == decision(
        False, rate=Rate(3, 60), remaining=0, reset_after=60.0, retry_after=59.0, policy=policy.name
    )
    # All or nothing: the per-second rate's count did not change.
    assert limiter.peek(per_second, "a").remaining == 1
    assert limiter.peek(per_second, "a", cost=2).retry_after == 1.0  # t+1 leaves at t+2


def test_multi_rate_denial_by_shorter_rate_leaves_longer_untouched(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("multi2", "2/second;3/minute")
    assert limiter.hit(policy, "a").allowed
    assert limiter.hit(policy, "a").allowed
    denied = limiter.hit(policy, "a")  # the second is full, the minute is not
    assert not denied.allowed
    assert denied.rate == Rate(2, 1)
    assert denied.retry_after == 1.0
    clock.advance(1)
    # Had the denial been counted in the minute, this third unit would be refused.
    last = limiter.hit(policy, "a")
    assert last.allowed
    assert last.rate == Rate(3, 60)
    assert last.remaining == 0


def test_denial_names_the_rate_with_the_longest_wait(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("longest", "2/second;3/minute")
    limiter.hit(policy, "a")
    limiter.hit(policy, "a")  # two at t
    clock.advance(1)
    limiter.hit(policy, "a")  # one at t+1
    clock.advance(0.5)
    # At t+1.5 a cost of 2 is refused by both: the second waits 0.5 s (t+1 leaves at t+2),
    # the minute waits for its 2nd oldest entry (t) to leave at t+60: 58.5 s.
    denied = limiter.hit(policy, "a", cost=2)
    assert denied == decision(
        False, rate=Rate(3, 60), remaining=0, reset_after=59.5, retry_after=58.5, policy=policy.name
    )


def test_denial_names_the_shorter_rate_when_its_wait_is_longer(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("longest2", "1/second;2/minute")
    assert limiter.hit(policy, "a").allowed  # t
    clock.advance(59.5)
    assert limiter.hit(policy, "a").allowed  # t+59.5
    # Both refuse: the minute frees up at t+60 (0.5 s), the second at t+60.5 (1 s).
    denied = limiter.hit(policy, "a")
    assert denied == decision(
        False, rate=Rate(1, 1), remaining=0, reset_after=1.0, retry_after=1.0, policy=policy.name
    )
    clock.advance(0.5)
    assert not limiter.hit(policy, "a").allowed
    clock.advance(0.5)
    assert limiter.hit(policy, "a").allowed


def test_allowed_decision_names_the_rate_with_fewest_units_left(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("fewest", "2/second;3/minute")
    first = limiter.hit(policy, "a")
    assert first == decision(
        True, rate=Rate(2, 1), remaining=1, reset_after=1.0, policy=policy.name
    )
    clock.advance(1)
    limiter.hit(policy, "a")
    clock.advance(1)
    third = limiter.hit(policy, "a")  # second: 1 left; minute: 0 left
    assert third == decision(
        True, rate=Rate(3, 60), remaining=0, reset_after=60.0, policy=policy.name
    )


# -- peek ------------------------------------------------------------------------------------


def test_peek_never_consumes(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("peek", "5 per 10 seconds")
    for _ in range(100):
        peeked = limiter.peek(policy, "a")
        assert peeked.allowed
        assert peeked.remaining == 5
    for _ in range(50):
        limiter.peek(policy, "a", cost=5)
        limiter.peek(policy, "a", cost=6)
    assert [limiter.hit(policy, "a").allowed for _ in range(6)] == [True] * 5 + [False]


def test_peek_reports_for_a_given_cost(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("peek-cost", "5 per 10 seconds")
    rate = Rate(5, 10)
    limiter.hit(policy, "a", cost=2)  # two at t
    clock.advance(2)
    limiter.hit(policy, "a")  # one at t+2
    clock.advance(1)  # t+3: 3 used, 2 free
    assert limiter.peek(policy, "a", cost=2) == decision(
        True, rate=rate, remaining=2, reset_after=9.0, policy=policy.name
    )
    # cost 3 needs one entry to leave: the oldest, t, at t+10.
    assert limiter.peek(policy, "a", cost=3) == decision(
        False, rate=rate, remaining=2, reset_after=9.0, retry_after=7.0, policy=policy.name
    )
    # cost 5 needs all three to leave: the last, t+2, at t+12.
    assert limiter.peek(policy, "a", cost=5).retry_after == 9.0
    assert limiter.peek(policy, "a", cost=6).retry_after == math.inf
    # A hit of that cost agrees with its peek.
    assert limiter.hit(policy, "a", cost=3).retry_after == 7.0
    assert limiter.hit(policy, "a", cost=2).remaining == 0


# -- reset and independence ------------------------------------------------------------------


def test_reset_clears_state(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("reset", "2/hour")
    limiter.hit(policy, "a")
    limiter.hit(policy, "a")
    limiter.hit(policy, "b")
    assert not limiter.hit(policy, "a").allowed
    assert limiter.reset(policy, "a") == len(limiter.keys(policy, "a"))  # every key existed
    assert limiter.reset(policy, "a") == 0  # and now none does
    assert limiter.peek(policy, "a") == decision(
        True, rate=Rate(2, 3600), remaining=2, reset_after=0.0, policy=policy.name
    )
    assert limiter.hit(policy, "a").remaining == 1
    assert limiter.hit(policy, "b").remaining == 0  # b was not reset
    assert limiter.reset(policy, "never-seen") == 0  # resetting nothing is fine, and said
    assert limiter.hit(policy, "never-seen").remaining == 1


def test_identities_are_independent(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("ids", "2/minute")
    assert [limiter.hit(policy, "alice").allowed for _ in range(3)] == [True, True, False]
    assert [limiter.hit(policy, "bob").allowed for _ in range(3)] == [True, True, False]
    assert limiter.peek(policy, "carol").remaining == 2


def test_policies_are_independent(make_limiter: MakeLimiter, clock: ManualClock) -> None:
    limiter = make_limiter(clock=clock)
    login = Policy("login", "1/minute")
    api = Policy("api", "3/minute")
    assert limiter.hit(login, "alice").allowed
    assert not limiter.hit(login, "alice").allowed
    assert [limiter.hit(api, "alice").remaining for _ in range(3)] == [2, 1, 0]
    assert not limiter.hit(login, "alice").allowed
    assert limiter.keys(login, "alice") != limiter.keys(api, "alice")


def test_key_prefix_separates_limiters(
    make_limiter: MakeLimiter, clock: ManualClock, key_prefix: str, backend: str
) -> None:
    one = make_limiter(clock=clock, key_prefix=key_prefix + "-one")
    two = make_limiter(clock=clock, key_prefix=key_prefix + "-two")
    policy = Policy("prefixed", "1/minute")
    assert one.hit(policy, "a").allowed
    assert not one.hit(policy, "a").allowed
    assert two.hit(policy, "a").allowed
    assert one.keys(policy, "a")[0].startswith(key_prefix + "-one:")
    if backend != "memory://":
        # On a shared store, the same prefix is the same state: that is the point.
        same = make_limiter(clock=clock, key_prefix=key_prefix + "-one")
        assert not same.hit(policy, "a").allowed


@pytest.mark.parametrize(
    ("identity", "alias"),
    [("42", 42), ("a", b"a"), ("\u00e9", "\u00e9".encode()), ("-7", -7)],
)
def test_identity_types(
    make_limiter: MakeLimiter, clock: ManualClock, identity: Any, alias: Any
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("types", "2/minute")
    assert limiter.hit(policy, identity).remaining == 1
    # 42 and "42", "a" and b"a": the same identity (documented).
    assert limiter.hit(policy, alias).remaining == 0
    assert not limiter.hit(policy, identity).allowed
    assert limiter.keys(policy, identity) == limiter.keys(policy, alias)
    # Other spellings are other identities.
    assert limiter.hit(policy, b"\xff" + identity.encode()).remaining == 1
    assert limiter.hit(policy, 43).remaining == 1


CRAFTED = [
    "",
    "{",
    "}",
    "}{",
    "{}",
    "a}b{c",
    "\x00",
    "a\x00",
    "\n",
    "\r\n",
    " ",
    "*",
    "x" * 100_000,
    "x" * 100_001,
    "\U0001f600",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467",
    "\u00e9",
    "e\u0301",
    "ratekeeper:crafted:{x}:log",
    b"\xff\xfe",
    0,
    -1,
    2**70,
]


def test_crafted_identities_work_and_are_independent(
    make_limiter: MakeLimiter, clock: ManualClock
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("crafted", "2/hour")
    for identity in CRAFTED:
        assert limiter.hit(policy, identity).remaining == 1, identity
    for identity in CRAFTED:
        assert limiter.hit(policy, identity).remaining == 0, identity
    for identity in CRAFTED:
        assert not limiter.hit(policy, identity).allowed, identity
    limiter.reset(policy, "{")
    assert limiter.hit(policy, "{").remaining == 1
    assert not limiter.hit(policy, "}").allowed


def test_keys_have_one_hash_tag(make_limiter: MakeLimiter, key_prefix: str) -> None:
    limiter = make_limiter()
    policy = Policy("tagged", "1/second")
    for identity in ("a}b{c", "", "x" * 100_000):
        (key,) = limiter.keys(policy, identity)
        assert key.count("{") == key.count("}") == 1
        tag = KeyBuilder(key_prefix).tag("tagged", identity)
        assert key == f"{key_prefix}:tagged:{{{tag}}}:times"


def test_key_lives_its_longest_window_plus_a_margin(
    make_limiter: MakeLimiter,
    clock: ManualClock,
    backend: str,
    pttl: Pttl,
) -> None:
    limiter = make_limiter(clock=clock)
    policy = Policy("ttl", "1/second;2 per 30 seconds")
    (key,) = limiter.keys(policy, "a")
    assert pttl(limiter, key) == -2
    limiter.hit(policy, "a")
    if backend == "memory://":
        # The memory keyspace runs on the manual clock: exact, and a denial does not extend it.
        assert pttl(limiter, key) == 31_000
        clock.advance(0.5)
        assert not limiter.hit(policy, "a").allowed
        limiter.peek(policy, "a")
        assert pttl(limiter, key) == 30_500
    else:
        # A server's keys expire in real time, which has barely moved.
        assert 30_000 < pttl(limiter, key) <= 31_000


def test_a_log_written_by_a_clock_behind_lives_until_its_newest_entry_leaves(
    make_limiter: MakeLimiter,
    clock: ManualClock,
    backend: str,
    pttl: Pttl,
) -> None:
    """A client 4 s behind the newest entry stamps its own with that newest time (the sliding
    log stays in time order), and the key's TTL runs from it: 4 s + the window + the margin."""
    limiter = make_limiter(clock=clock)
    policy = Policy("ttl-skew", "3 per 10 seconds")
    (key,) = limiter.keys(policy, "a")
    clock.set(T0 + 4)
    assert limiter.hit(policy, "a").allowed
    clock.set(T0)
    assert limiter.hit(policy, "a").reset_after == 14.0
    if backend == "memory://":
        assert pttl(limiter, key) == 15_000
    else:
        assert 14_000 < pttl(limiter, key) <= 15_000


# -- server time -----------------------------------------------------------------------------


def test_server_time_path(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()  # no clock: the store's clock decides
    policy = Policy("server-time", "5 per 30 seconds")
    decisions = [limiter.hit(policy, "a") for _ in range(6)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False]
    assert [d.remaining for d in decisions[:5]] == [4, 3, 2, 1, 0]
    last = decisions[-1]
    assert last.retry_after is not None
    assert 0 < last.retry_after <= 30.0
    assert 0 < last.reset_after <= 30.0
    assert not limiter.peek(policy, "a").allowed


# -- closing ---------------------------------------------------------------------------------


def _redis_options(backend: str, name: str) -> dict[str, Any]:
    if backend == "memory://":
        return {}
    return {"redis_options": {"client_name": name}}


def _connected(server: RedisServer, name: str) -> int:
    """How many connections named ``name`` ``server`` has."""
    with server.client() as client:
        return sum(1 for c in client.client_list() if c.get("name") == name)


def _wait_disconnected(server: RedisServer, name: str) -> int:
    # The server sees the close asynchronously; each CLIENT LIST is a round trip it must
    # serve after having read the FIN, so a bounded number of polls settles it.
    count = 0
    for _ in range(500):
        count = _connected(server, name)
        if count == 0:
            break
    return count


def test_sync_context_manager_closes(
    backend: str, key_prefix: str, backend_server: RedisServer | None
) -> None:
    name = f"rk-close-{key_prefix}"
    policy = Policy("close", "2/minute")
    with Limiter.from_url(
        backend, key_prefix=key_prefix, clock=ManualClock(T0), **_redis_options(backend, name)
    ) as limiter:
        assert limiter.hit(policy, "a").remaining == 1
        if backend == "memory://":
            assert len(limiter.storage) == 1
        else:
            assert _connected(backend_server, name) == 1
    if backend == "memory://":
        assert len(limiter.storage) == 0
    else:
        assert _wait_disconnected(backend_server, name) == 0


def test_async_context_manager_closes(
    backend: str, key_prefix: str, backend_server: RedisServer | None
) -> None:
    name = f"rk-aclose-{key_prefix}"
    policy = Policy("aclose", "2/minute")

    async def main() -> tuple[AsyncLimiter, list[Decision], int]:
        async with AsyncLimiter.from_url(
            backend, key_prefix=key_prefix, clock=ManualClock(T0), **_redis_options(backend, name)
        ) as limiter:
            decisions = [await limiter.hit(policy, "a") for _ in range(3)]
            if backend == "memory://":
                inside = len(limiter.storage.sync)  # type: ignore[attr-defined]
            else:
                inside = _connected(backend_server, name)
        return limiter, decisions, inside

    limiter, decisions, inside = asyncio.run(main())
    assert [d.allowed for d in decisions] == [True, True, False]
    assert inside == 1
    if backend == "memory://":
        assert len(limiter.storage.sync) == 0  # type: ignore[attr-defined]
    else:
        assert _wait_disconnected(backend_server, name) == 0


@pytest.mark.parametrize(
    "fields",
    [
        (True, 5, 4, 60.0, None, "p", Rate(5, 60.0)),
        (False, 5, 0, 12.5, 3.25, "p", Rate(5, 60.0), False, "deny_cache"),
        (True, 10, 10, 0.0, None, "q", Rate(10, 1.0), True, "timeout/open"),
        (False, 1, 0, 0.0, math.inf, "r", Rate(1, 3600.0)),
    ],
)
def test_the_fast_decision_builder_makes_the_same_decision(fields: tuple[Any, ...]) -> None:
    built = make_decision(*fields)
    usual = Decision(*fields)
    assert built == usual
    assert hash(built) == hash(usual)
    assert repr(built) == repr(usual)
    with pytest.raises(AttributeError):
        built.allowed = not built.allowed  # type: ignore[misc]
