"""Waiting until admitted: ``Limiter.wait`` / ``AsyncLimiter.wait``, the rule in ``_wait`` and
the ``limit`` decorator.

The rule and its drivers run on injected time (a ManualClock that the fake sleep moves, and the
limiter's ``clock=`` on the same clock), so they run instantly and every sleep is checked
exactly. The real default sleep is measured once per API, and 8 processes share one limit for
about 10 s of real time: that one measures the real wait.
"""

from __future__ import annotations

import asyncio
import functools
import math
import multiprocessing
import pickle
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from ratekeeper import (
    AsyncLimiter,
    ConfigError,
    Decision,
    Limiter,
    ManualClock,
    Policy,
    RatekeeperError,
    RateLimited,
    testing,
)
from ratekeeper._limiters.wait import (
    JITTER,
    MAX_JITTER,
    MIN_SLEEP,
    jitter,
    next_sleep,
    timeout_of,
    wait_async,
    wait_sync,
)
from ratekeeper.decorators import limit

from ..support import workers
from ..support.servers import RedisServer

PER_SECOND = Policy("wait", "2/second")


def _opts(url: str) -> dict[str, Any]:
    """Store timeouts long enough never to fire on a loaded machine (none for memory://)."""
    return {} if url == "memory://" else {"timeout": 5, "connect_timeout": 5}


#: ``ratekeeper.testing.decision`` under PER_SECOND, resetting in 1 s.
decision = functools.partial(
    testing.decision, rate="2/second", policy=PER_SECOND.name, reset_after=1.0
)


# -- the rule, pure ------------------------------------------------------------------------


def test_an_allowed_decision_is_returned() -> None:
    allowed = decision(remaining=1)
    assert next_sleep(allowed, 100.0, 100.0, lambda: 0.5) is None
    degraded = decision(degraded=True, reason="timeout/open")
    assert next_sleep(degraded, 0.0, None, lambda: 0.5) is None


@pytest.mark.parametrize(
    ("retry_after", "rand", "expected"),
    [
        (0.5, 0.0, 0.5),  # the exact wait
        (0.5, 0.5, 0.5 + 0.5 * 0.05),  # half the 10% jitter
        (0.5, 0.999, 0.5 + 0.999 * 0.05),
        (100.0, 0.999, 100.0 + 0.999 * MAX_JITTER),  # 10% would be 10 s: capped at 1 s
        (0.0, 0.0, MIN_SLEEP),  # never a busy loop
    ],
)
def test_a_denial_sleeps_its_retry_after_plus_bounded_jitter(
    retry_after: float, rand: float, expected: float
) -> None:
    pause = next_sleep(decision(False, retry_after=retry_after), 10.0, None, lambda: rand)
    assert pause == pytest.approx(expected, abs=1e-12)
    assert retry_after <= pause <= max(retry_after * (1 + JITTER), MIN_SLEEP)


def test_jitter_stays_in_its_bounds() -> None:
    for wait in (0.001, 0.3, 1.0, 9.0, 10.0, 3600.0):
        assert jitter(wait, lambda: 0.0) == 0.0
        top = jitter(wait, lambda: math.nextafter(1.0, 0.0))
        assert top < min(wait * JITTER, MAX_JITTER)
        assert top > 0.99 * min(wait * JITTER, MAX_JITTER)


def test_it_raises_at_once_when_retry_after_exceeds_the_time_left() -> None:
    denial = decision(False, retry_after=0.8)
    with pytest.raises(RateLimited) as caught:
        next_sleep(denial, 10.0, 10.7, lambda: 0.0)
    assert caught.value.decision is denial
    assert isinstance(caught.value, RatekeeperError)
    # Just enough time: it sleeps, and the jitter is cut so the retry happens by the deadline.
    assert next_sleep(denial, 10.0, 10.8, lambda: 0.9) == pytest.approx(0.8)
    assert next_sleep(denial, 10.0, 10.82, lambda: 0.9) == pytest.approx(0.82)
    assert next_sleep(denial, 10.0, 11.0, lambda: 0.5) == pytest.approx(0.84)


def test_a_cost_above_the_limit_raises_at_once_even_without_a_timeout() -> None:
    never = decision(False, retry_after=math.inf)
    for deadline in (None, math.inf, 1e9):
        with pytest.raises(RateLimited, match="can never pass") as caught:
            next_sleep(never, 0.0, deadline, lambda: 0.0)
        assert caught.value.decision is never


def test_rate_limited_pickles_with_its_decision() -> None:
    error = RateLimited(decision(False, retry_after=0.25))
    assert "retry in 0.250 s" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is RateLimited
    assert again.decision == error.decision
    assert str(again) == str(error)


@pytest.mark.parametrize("bad", [-1, -0.001, math.nan, "1", True, [1]])
def test_bad_timeouts_are_refused(bad: Any) -> None:
    limiter = Limiter.from_url("memory://")
    with pytest.raises(ConfigError, match="timeout"):
        limiter.wait(PER_SECOND, "x", timeout=bad)
    assert limiter.peek(PER_SECOND, "x").remaining == 2  # refused before any hit


def test_the_wait_option() -> None:
    assert timeout_of(True) is None
    assert timeout_of(False) == 0.0
    assert timeout_of(2.5) == 2.5
    assert timeout_of(math.inf) is None
    for bad in (-1, "yes", None, math.nan):
        with pytest.raises(ConfigError, match="wait must be"):
            timeout_of(bad)  # type: ignore[arg-type]


# -- the drivers on injected time ----------------------------------------------------------


class FakeTime:
    """A monotonic clock and a sleep that moves it (and the limiter's ManualClock) instantly;
    ``then`` runs after each sleep, as another client would between two tries."""

    def __init__(
        self, clock: ManualClock, then: Callable[[], object] = lambda: None, rand: float = 0.0
    ) -> None:
        self.clock = clock
        self.then = then
        self.rand = rand
        self.sleeps: list[float] = []

    def wait(self, limiter: Any, identity: str, cost: int = 1, **kw: Any) -> Decision:
        """``wait_sync`` on this fake time, under PER_SECOND."""
        return wait_sync(
            limiter,
            PER_SECOND,
            identity,
            cost,
            **kw,
            sleep=self.sleep,
            monotonic=self.monotonic,
            rand=lambda: self.rand,
        )

    async def await_(self, limiter: Any, identity: str, cost: int = 1, **kw: Any) -> Decision:
        """``wait_async`` on this fake time, under PER_SECOND."""
        return await wait_async(
            limiter,
            PER_SECOND,
            identity,
            cost,
            **kw,
            sleep=self.asleep,
            monotonic=self.monotonic,
            rand=lambda: self.rand,
        )

    def monotonic(self) -> float:
        return self.clock()

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.clock.advance(seconds)
        self.then()

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


class Recording:
    """Passes hits to a limiter and keeps every decision."""

    def __init__(self, limiter: Any) -> None:
        self.limiter = limiter
        self.decisions: list[Decision] = []

    def hit(self, policy: Policy, identity: Any, cost: int = 1) -> Decision:
        decision = self.limiter.hit(policy, identity, cost)
        self.decisions.append(decision)
        return decision


@pytest.fixture
def sync_limiter(backend: str, key_prefix: str) -> Any:
    clock = ManualClock()
    limiter = Limiter.from_url(backend, key_prefix=key_prefix, clock=clock, **_opts(backend))
    yield limiter, clock
    limiter.close()


def test_it_sleeps_the_exact_retry_after_plus_jitter(sync_limiter: Any) -> None:
    limiter, clock = sync_limiter
    fake = FakeTime(clock, rand=0.5)
    assert limiter.hit(PER_SECOND, "a").allowed
    clock.advance(0.25)
    assert limiter.hit(PER_SECOND, "a").allowed
    started = clock()
    decision = fake.wait(limiter, "a")
    assert decision.allowed
    assert decision.remaining == 0
    # The first entry leaves the window 0.75 s later; 10% of that times 0.5 on top.
    assert fake.sleeps == [pytest.approx(0.75 * (1 + JITTER * 0.5))]
    assert clock() - started == pytest.approx(0.75 * 1.05)


def test_it_waits_again_while_others_take_the_freed_units(sync_limiter: Any) -> None:
    limiter, clock = sync_limiter
    steals = 3

    def another_client() -> None:  # takes the freed unit before we retry, three times
        nonlocal steals
        if steals:
            steals -= 1
            assert limiter.hit(PER_SECOND, "b", 2).allowed

    fake = FakeTime(clock, another_client)
    recording = Recording(limiter)
    assert limiter.hit(PER_SECOND, "b", 2).allowed
    decision = fake.wait(recording, "b")  # timeout=None: as long as it takes
    assert decision.allowed
    assert [d.allowed for d in recording.decisions] == [False] * 4 + [True]
    assert fake.sleeps == [pytest.approx(1.0)] * 4
    assert fake.sleeps == [pytest.approx(d.retry_after) for d in recording.decisions[:4]]


def test_it_raises_with_the_last_denial_once_the_next_try_would_pass_the_timeout(
    sync_limiter: Any,
) -> None:
    limiter, clock = sync_limiter
    fake = FakeTime(clock, lambda: limiter.hit(PER_SECOND, "c", 2))  # someone else gets in
    recording = Recording(limiter)
    assert limiter.hit(PER_SECOND, "c", 2).allowed
    started = clock()
    with pytest.raises(RateLimited) as caught:
        fake.wait(recording, "c", timeout=1.5)
    # One sleep of 1 s; the next denial's 1 s would end past 1.5 s, so no second sleep.
    assert fake.sleeps == [pytest.approx(1.0)]
    assert clock() - started == pytest.approx(1.0)
    assert len(recording.decisions) == 2
    assert caught.value.decision is recording.decisions[-1]
    assert not caught.value.decision.allowed


def test_a_timeout_shorter_than_retry_after_raises_without_sleeping(sync_limiter: Any) -> None:
    limiter, clock = sync_limiter
    fake = FakeTime(clock)
    limiter.hit(PER_SECOND, "d", 2)
    with pytest.raises(RateLimited) as caught:
        fake.wait(limiter, "d", timeout=0.99)
    assert fake.sleeps == []
    assert caught.value.decision.retry_after == pytest.approx(1.0)
    with pytest.raises(RateLimited):
        limiter.wait(PER_SECOND, "d", timeout=0)  # the real method, no seam: no sleep either


def test_a_cost_above_the_limit_raises_at_once(sync_limiter: Any) -> None:
    limiter, clock = sync_limiter
    fake = FakeTime(clock)
    with pytest.raises(RateLimited) as caught:
        fake.wait(limiter, "e", 3)
    assert caught.value.decision.retry_after == math.inf
    assert fake.sleeps == []
    with pytest.raises(RateLimited):
        limiter.wait(PER_SECOND, "e", 3)  # timeout=None, real sleep: still at once


def test_async_driver_on_injected_time(backend: str, key_prefix: str) -> None:
    async def main() -> None:
        clock = ManualClock()
        async with AsyncLimiter.from_url(
            backend, key_prefix=key_prefix, clock=clock, **_opts(backend)
        ) as limiter:
            fake = FakeTime(clock, rand=1.0)
            await limiter.hit(PER_SECOND, "f", 2)
            clock.advance(0.4)
            decision = await fake.await_(limiter, "f")
            assert decision.allowed
            assert fake.sleeps == [pytest.approx(0.6 * (1 + JITTER))]
            await limiter.hit(PER_SECOND, "f")
            with pytest.raises(RateLimited) as caught:
                await fake.await_(limiter, "f", timeout=0.5)
            assert fake.sleeps == [pytest.approx(0.66)]
            assert caught.value.decision.retry_after == pytest.approx(1.0)
            with pytest.raises(RateLimited, match="can never pass"):
                await limiter.wait(PER_SECOND, "f", 5)

    asyncio.run(main())


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_degraded_decisions_follow_what_they_say() -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    with Limiter.from_url(url, failure_mode="open") as limiter:
        fake = FakeTime(ManualClock())
        decision = fake.wait(limiter, "g")
        assert decision.allowed
        assert decision.degraded
        assert fake.sleeps == []
    with Limiter.from_url(url, failure_mode="closed") as limiter:
        fake = FakeTime(ManualClock())
        recording = Recording(limiter)
        with pytest.raises(RateLimited) as caught:
            fake.wait(recording, "g", timeout=1.2)
        denials = recording.decisions
        assert all(d.degraded and not d.allowed for d in denials)
        assert caught.value.decision is denials[-1]
        assert caught.value.decision.reason is not None
        assert caught.value.decision.reason.endswith("/closed")
        # Each closed denial was waited for, exactly, like any other.
        assert len(fake.sleeps) == len(denials) - 1 >= 1
        for slept, denial in zip(fake.sleeps, denials, strict=False):
            assert slept == pytest.approx(max(denial.retry_after or 0, MIN_SLEEP))


# -- the real sleep ------------------------------------------------------------------------


def test_the_real_wait_sleeps_retry_after(backend: str, key_prefix: str) -> None:
    policy = Policy("real", "1/second")
    with Limiter.from_url(backend, key_prefix=key_prefix, **_opts(backend)) as limiter:
        first = limiter.hit(policy, "h")
        assert first.allowed
        denied = limiter.hit(policy, "h")
        assert denied.retry_after is not None
        started = time.monotonic()
        decision = limiter.wait(policy, "h", timeout=5)
        elapsed = time.monotonic() - started
    assert decision.allowed
    assert denied.retry_after - 0.01 <= elapsed <= denied.retry_after * (1 + JITTER) + 0.5


def test_the_real_async_wait_sleeps_retry_after(backend: str, key_prefix: str) -> None:
    policy = Policy("real", "1/second")

    async def main() -> tuple[float, float, Decision]:
        async with AsyncLimiter.from_url(
            backend, key_prefix=key_prefix, **_opts(backend)
        ) as limiter:
            await limiter.hit(policy, "h")
            denied = await limiter.hit(policy, "h")
            assert denied.retry_after is not None
            started = time.monotonic()
            decision = await limiter.wait(policy, "h", timeout=5)
            return time.monotonic() - started, denied.retry_after, decision

    elapsed, retry_after, decision = asyncio.run(main())
    assert decision.allowed
    assert retry_after - 0.01 <= elapsed <= retry_after * (1 + JITTER) + 0.5


# -- 8 processes sharing one limit ---------------------------------------------------------

PROCESSES = 8
CALLS = 50
LIMIT = 5


def assert_at_most_per_window(
    admissions: list[tuple[float, float]], limit: int, width: float = 1.0
) -> int:
    """Check that no window of ``width`` seconds held more than ``limit`` admissions, and
    return the most that one surely held.

    Each admission is ``(sent, back)``: the store admitted it between the moment its hit was
    sent and the moment the reply came back, on this host's clock. So every ``limit + 1``
    admissions must span at least ``width`` from the first ``sent`` to the last ``back``; and
    an admission is surely inside ``[x, x + width)`` when ``sent >= x`` and ``back < x + width``.
    """
    by_sent = sorted(admissions)
    for i in range(len(by_sent) - limit):
        group = by_sent[i : i + limit + 1]
        assert max(back for _, back in group) - group[0][0] >= width, group
    return max(
        sum(1 for sent, back in admissions if start <= sent and back < start + width)
        for start, _ in admissions
    )


def test_eight_processes_wait_their_turn(server: RedisServer) -> None:
    ctx = multiprocessing.get_context("spawn")
    tickets = ctx.Value("i", CALLS)
    results = workers.run_processes(
        ctx,
        workers.waiting_calls,
        PROCESSES,
        url=server.url,
        key_prefix=f"wait-{uuid.uuid4().hex[:8]}",
        policy_name="shared",
        rates=f"{LIMIT} per second",
        identity="partner-api",
        tickets=tickets,
        barrier=ctx.Barrier(PROCESSES),
    )
    admissions = [adm for result in results for adm in result["admissions"]]
    assert len(admissions) == CALLS  # none failed: run_processes checked every error list
    assert tickets.value == 0
    started = min(result["started"] for result in results)
    elapsed = max(back for _, back in admissions) - started
    shares = sorted(len(result["admissions"]) for result in results)
    print(
        f"\n{PROCESSES} processes, {CALLS} calls at {LIMIT}/s with wait(): {elapsed:.2f} s "
        f"(calls per process: {shares})"
    )
    assert 9.0 <= elapsed <= 12.5
    assert assert_at_most_per_window(admissions, LIMIT) == LIMIT


# -- the decorator -------------------------------------------------------------------------


def test_the_decorator_on_a_sync_function(backend: str, key_prefix: str) -> None:
    policy = Policy("send", "2/minute")
    calls: list[str] = []
    with Limiter.from_url(backend, key_prefix=key_prefix, **_opts(backend)) as limiter:

        @limit(limiter, policy, key=lambda user, text="": user)
        def send(user: str, text: str = "") -> str:
            calls.append(user)
            return text.upper()

        assert send.__name__ == "send"
        assert send("alice", text="a") == "A"
        assert send("alice", "b") == "B"
        with pytest.raises(RateLimited) as caught:
            send("alice", "c")
        assert caught.value.decision.retry_after == pytest.approx(60, abs=1)
        assert send("bob") == ""  # another key
        assert calls == ["alice", "alice", "bob"]  # the denied call never ran
        assert limiter.peek(policy, "alice").remaining == 0


def test_the_decorator_waits_on_a_sync_function(backend: str, key_prefix: str) -> None:
    policy = Policy("poll", "1/second")
    with Limiter.from_url(backend, key_prefix=key_prefix, **_opts(backend)) as limiter:

        @limit(limiter, policy, key="one-for-all", cost=1, wait=5)
        def poll() -> float:
            return time.monotonic()

        first, second = poll(), poll()
        assert 0.99 <= second - first <= 1.0 * (1 + JITTER) + 0.5

        @limit(limiter, policy, key="one-for-all", wait=0.5)
        def impatient() -> None:
            raise AssertionError("never called")

        with pytest.raises(RateLimited):
            impatient()


def test_the_decorator_on_an_async_function(backend: str, key_prefix: str) -> None:
    policy = Policy("fetch", "2/second")

    async def main() -> None:
        async with AsyncLimiter.from_url(
            backend, key_prefix=key_prefix, **_opts(backend)
        ) as limiter:

            @limit(limiter, policy, key=lambda url: url.split("/")[2])
            async def fetch(url: str) -> str:
                return url

            @limit(limiter, policy, key=lambda url: url.split("/")[2], wait=True)
            async def patient_fetch(url: str) -> float:
                return time.monotonic()

            assert asyncio.iscoroutinefunction(fetch)
            assert await fetch("https://a.example/1") == "https://a.example/1"
            assert await fetch("https://a.example/2") == "https://a.example/2"
            with pytest.raises(RateLimited):
                await fetch("https://a.example/3")
            started = time.monotonic()
            admitted = await patient_fetch("https://a.example/4")
            assert 0.9 <= admitted - started <= 1.0 * (1 + JITTER) + 0.5
            # The 4th call took a unit: at most one of the 2 is free again.
            assert (await limiter.peek(policy, "a.example")).remaining <= 1

    asyncio.run(main())


def test_the_decorator_refuses_a_limiter_of_the_wrong_kind() -> None:
    policy = Policy("p", "1/second")
    sync, asyncio_limiter = Limiter.from_url("memory://"), AsyncLimiter.from_url("memory://")

    async def coroutine() -> None: ...

    def function() -> None: ...

    with pytest.raises(ConfigError, match="coroutine function: limit it with an AsyncLimiter"):
        limit(sync, policy, key="k")(coroutine)
    with pytest.raises(ConfigError, match="not a coroutine function: limit it with a Limiter"):
        limit(asyncio_limiter, policy, key="k")(function)
    with pytest.raises(ConfigError, match="key must be"):
        limit(sync, policy, key=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="wait must be"):
        limit(sync, policy, key="k", wait=-1)
    with pytest.raises(ConfigError, match="cost"):
        limit(sync, policy, key="k", cost=0)
    with pytest.raises(ConfigError, match="policy must be"):
        limit(sync, "p", key="k")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="limiter must be"):
        limit(object(), policy, key="k")  # type: ignore[arg-type]
