"""Reservations: reserve an estimate, settle the actual cost, cancel; every algorithm, both
APIs, every backend; the scripts equal their references; exact across processes.

A naive model is the third opinion: with the clock frozen nothing refills and no window
ends, so an identity has used exactly the estimates it holds plus the actual costs settled
(charged past the limit), a reservation fits when that plus its estimate is within the limit,
and ``remaining`` is the limit minus that (0 below).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratekeeper import (
    AsyncLimiter,
    ConfigError,
    Limiter,
    ManualClock,
    Policy,
    Rate,
    ReservationError,
)
from ratekeeper._algorithms import CHARGE, HIT, PEEK, REFUND, RESERVE

from ..algorithms.test_property import (
    ALGORITHM_SETTINGS,
    SHRINK_TIMEOUT,
    Direct,
    exact_options,
    fresh_prefix,
    moved,
)
from ..conftest import MakeLimiter
from ..support import workers
from ..support.servers import RedisServer
from ..support.strategies import LOG_CASES, START, algorithm_policies, draw_time_op
from ..support.web_apps import asgi_client

RATE_ALGORITHMS = ("fixed_window", "sliding_window", "gcra", "token_bucket", "sliding_log")


# == the API ===================================================================================


@pytest.mark.parametrize("algorithm", RATE_ALGORITHMS)
def test_settle_charges_exactly_the_actual_cost(make_limiter: MakeLimiter, algorithm: str) -> None:
    limiter = make_limiter(clock=ManualClock(START + 0.5))
    policy = Policy("tokens", "100/hour", algorithm)
    first = limiter.reserve(policy, "k", 20)
    second = limiter.reserve(policy, "k", 30)
    assert first.allowed
    assert second.allowed
    assert limiter.peek(policy, "k").remaining == 50  # both estimates held
    assert first.settle(5).remaining == 65  # 15 refunded
    assert second.settle(50).remaining == 45  # 20 more charged
    third = limiter.reserve(policy, "k", 10)
    assert third.cancel().remaining == 45  # all refunded
    assert limiter.peek(policy, "k").remaining == 45
    # Past the limit: work done is work done, and later calls wait for it.
    last = limiter.reserve(policy, "k", 45)
    assert last.allowed
    after = last.settle(200)
    assert not after.allowed
    assert after.remaining == 0
    assert limiter.peek(policy, "k").retry_after > 0
    assert not limiter.reserve(policy, "k", 1).allowed


@pytest.mark.parametrize("algorithm", RATE_ALGORITHMS)
def test_a_denied_reservation_holds_nothing(make_limiter: MakeLimiter, algorithm: str) -> None:
    limiter = make_limiter(clock=ManualClock(START + 0.5))
    policy = Policy("tokens", "10/hour", algorithm)
    assert limiter.reserve(policy, "k", 8).allowed
    denied = limiter.reserve(policy, "k", 5)
    assert not denied.allowed
    assert denied.decision.retry_after > 0
    assert denied.cancel() is None
    with pytest.raises(ReservationError, match="denied"):
        denied.settle(1)
    assert limiter.peek(policy, "k").remaining == 2


def test_settle_twice_or_after_cancel_is_an_error_and_cancel_after_settle_a_no_op(
    make_limiter: MakeLimiter,
) -> None:
    limiter = make_limiter()
    policy = Policy("tokens", "100/hour")
    settled = limiter.reserve(policy, "k", 10)
    settled.settle(4)
    with pytest.raises(ReservationError, match="settled"):
        settled.settle(4)
    assert settled.cancel() is None
    cancelled = limiter.reserve(policy, "k", 10)
    assert cancelled.cancel() is not None
    assert cancelled.cancel() is None
    with pytest.raises(ReservationError, match="cancelled"):
        cancelled.settle(1)
    assert limiter.peek(policy, "k").remaining == 96


def test_bad_actual_costs_are_refused_before_anything_is_sent(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    policy = Policy("tokens", "100/hour")
    reservation = limiter.reserve(policy, "k", 10)
    for bad in (-1, 1.5, True, "3", 2**53 + 1):
        with pytest.raises(ConfigError, match="actual must be an int"):
            reservation.settle(bad)
    assert reservation.held  # nothing was settled: it can still be
    assert reservation.settle(0).remaining == 100


def test_a_reservation_is_not_pickled_but_says_how_to_hand_it_over() -> None:
    """A reservation is bound to its limiter: pickling it says what to send instead (was:
    "Can't pickle local object ...<lambda>")."""
    import pickle

    policy = Policy("handover", "10/minute", "gcra")
    with Limiter.from_url("memory://") as limiter:
        reservation = limiter.reserve(policy, "u", cost=3)
        with pytest.raises(
            TypeError, match=r"limiter\.resume\(policy, identity, estimate, stamp\)"
        ):
            pickle.dumps(reservation)
        resumed = limiter.resume(policy, "u", reservation.estimate, reservation.stamp)
        assert resumed.settle(1).remaining == 9  # what the hand-over is for


def test_a_concurrency_policy_hands_out_leases_instead(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    with pytest.raises(ConfigError, match=r"leases.*acquire"):
        limiter.reserve(Policy("jobs", "3/minute", "concurrency"), "k", 1)


def test_charge_adds_past_the_limit(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(clock=ManualClock(START + 0.5))
    policy = Policy("bytes", "1000/minute", "gcra")
    assert limiter.charge(policy, "k", 400).remaining == 600
    after = limiter.charge(policy, "k", 900)
    assert not after.allowed
    assert after.remaining == 0
    # 300 units over at 1000/minute: the next unit fits after 301 emission intervals.
    assert limiter.peek(policy, "k").retry_after == pytest.approx(301 * 0.06)


def test_with_block_keeps_the_estimate_unless_settled_or_asked_to_refund_on_error() -> None:
    limiter = Limiter.from_url("memory://", clock=ManualClock(START))
    policy = Policy("tokens", "100/hour")
    with limiter.reserve(policy, "k", 10) as kept:
        assert kept.allowed
    assert not kept.held
    assert limiter.peek(policy, "k").remaining == 90
    with limiter.reserve(policy, "k", 10) as settled:
        settled.settle(3)
    assert limiter.peek(policy, "k").remaining == 87
    with pytest.raises(KeyError), limiter.reserve(policy, "k", 10) as failed:
        raise KeyError("the work failed")
    assert limiter.peek(policy, "k").remaining == 77  # kept by default
    with (
        pytest.raises(KeyError),
        limiter.reserve(policy, "k", 10, cancel_on_error=True) as refunded,
    ):
        raise KeyError("the work failed")
    assert limiter.peek(policy, "k").remaining == 77
    assert not failed.held
    assert not refunded.held


def test_async_with_and_await() -> None:
    async def main() -> None:
        limiter = AsyncLimiter.from_url("memory://", clock=ManualClock(START))
        policy = Policy("tokens", "100/hour")
        async with limiter.reserve(policy, "k", 10) as reservation:
            await reservation.settle(25)
        assert (await limiter.peek(policy, "k")).remaining == 75
        with pytest.raises(KeyError):
            async with limiter.reserve(policy, "k", 10, cancel_on_error=True):
                raise KeyError("the work failed")
        assert (await limiter.peek(policy, "k")).remaining == 75
        reservation = await limiter.reserve(policy, "k", 5)
        assert (await reservation.cancel()).remaining == 75
        await limiter.close()

    asyncio.run(main())


def test_a_reservation_a_failure_mode_admitted_charges_the_whole_actual_when_settled(
    server: RedisServer,
) -> None:
    """The store was down at the reservation (failure mode "open" admitted it, the store holds
    nothing): the settle, once the store is back, charges all of the actual cost."""
    policy = Policy("tokens", "100/hour")
    prefix = fresh_prefix()
    with server.frozen():
        down = Limiter.from_url(server.url, key_prefix=prefix, timeout=0.05, deny_cache=0)
        reservation = down.reserve(policy, "k", 10)
    assert reservation.allowed
    assert reservation.decision.degraded
    assert reservation.stamp is None
    down.breaker.reset()
    assert reservation.settle(30).remaining == 70
    assert down.peek(policy, "k").remaining == 70
    down.close()


def most_in_a_window(times: list[float], period: float) -> int:
    """The most of ``times`` (seconds, one per unit) inside any window ``[t, t + period)``."""
    ordered = sorted(times)
    return max(
        (sum(1 for u in ordered if t <= u < t + period) for t in ordered),
        default=0,
    )


@pytest.mark.parametrize("algorithm", ["gcra", "token_bucket"])
def test_a_refund_gives_back_only_what_still_counts_on_gcra(
    make_limiter: MakeLimiter, algorithm: str
) -> None:
    """Issue #32: a reservation of 6 on 10 per 10 s, then 10.5 s later 10 hits pass (the 6 have
    come back by themselves), then ``settle(0)``: the refund finds nothing of the 6 still ahead
    and gives nothing back, so nothing more passes in the next 0.1 s (it let 6 more through:
    16 within 0.1 s). At the reservation's own instant a refund still gives back all of it,
    and a little later the part of its emission not yet passed."""
    clock = ManualClock(START)
    limiter = make_limiter(clock=clock, deny_cache=0)
    policy = Policy("p", "10/10 seconds", algorithm)
    admitted: list[float] = []
    reservation = limiter.reserve(policy, "u", cost=6)
    assert reservation.allowed
    clock.set(START + 10.5)
    for _ in range(10):
        assert limiter.hit(policy, "u").allowed
        admitted.append(clock())
    after = reservation.settle(0)
    assert not after.allowed
    assert after.remaining == 0
    for step in range(11):  # every 10 ms for 0.1 s
        clock.set(START + 10.5 + step / 100)
        for _ in range(10):
            if limiter.hit(policy, "u").allowed:
                admitted.append(clock())
    assert len(admitted) == 10
    assert most_in_a_window(admitted, 10.0) <= 10

    # At its own instant, all of it comes back; 3 s on, the 3 units still ahead of now.
    clock.set(START + 100)
    whole = limiter.reserve(policy, "v", cost=6)
    assert whole.settle(0).remaining == 10
    part = limiter.reserve(policy, "w", cost=6)
    for _ in range(4):
        assert limiter.hit(policy, "w").allowed  # the TAT is 10 s ahead: the bucket is empty
    clock.set(START + 103)
    assert limiter.peek(policy, "w").remaining == 3
    assert part.settle(0).remaining == 6  # 3 came back by themselves, 3 refunded
    assert limiter.reserve(policy, "w", cost=6).allowed
    assert not limiter.hit(policy, "w").allowed


def test_a_refund_lifts_this_processs_cached_denial(backend: str, key_prefix: str) -> None:
    limiter = Limiter.from_url(backend, key_prefix=key_prefix, clock=ManualClock(START + 0.5))
    policy = Policy("tokens", "10/hour")
    big = limiter.reserve(policy, "k", 10)
    assert not limiter.hit(policy, "k").allowed  # cached here now
    big.settle(2)
    assert limiter.hit(policy, "k").allowed
    limiter.close()


# == the scripts equal their references =========================================================

CASES = [*LOG_CASES, "sliding_window", "fixed_window", "gcra", "gcra_burst", "token_bucket"]


@SHRINK_TIMEOUT
@pytest.mark.parametrize("case", CASES)
@settings(ALGORITHM_SETTINGS, max_examples=60)
@given(data=st.data())
def test_scripts_equal_the_references_with_reservations(
    server: RedisServer, case: str, data: st.DataObject
) -> None:
    """Reserves, settles up and down, cancels, hits and charges, with the clock moving both
    ways: the script and its reference reply alike and hold the same state at every step."""
    policy = data.draw(algorithm_policies(case), label="policy")
    top = max(rate.limit for rate in policy.rates)
    periods = [rate.period_us for rate in policy.rates]
    direct = Direct(server, policy)
    prefix = fresh_prefix()
    now = int(START * 1_000_000)
    tokens = itertools.count()
    held: list[tuple[str, int, int]] = []  # (key, estimate, stamp) of reservations not settled
    try:
        for step in range(data.draw(st.integers(1, 30), label="steps")):
            kind = data.draw(
                st.sampled_from(["reserve", "reserve", "settle", "cancel", "hit", "charge", "time"])
            )
            where = f"step {step}: {kind} at {now}"
            key = f"{prefix}:{data.draw(st.integers(0, 1))}"
            token = f"t{next(tokens):x}"
            if kind == "time":
                how = data.draw(st.sampled_from(["advance", "boundary"]))
                op = draw_time_op(data.draw, how, periods)
                after = moved(now, op, data.draw(st.booleans()), 0)
                now = after if after is not None else now
            elif kind in ("reserve", "hit"):
                cost = data.draw(st.integers(1, top + 1))
                mode = RESERVE if kind == "reserve" else HIT
                reply = direct.agree(key, now, cost, mode, token, where)
                if kind == "reserve" and reply[0] == 1:
                    assert len(reply) == 2 + 3 * len(policy.rates), where
                    held.append((key, cost, reply[-1]))
                else:
                    assert len(reply) == 1 + 3 * len(policy.rates), where
            elif kind == "charge":
                # Up to the largest cost: the counters' caps, the log's limit of entries.
                cost = data.draw(st.one_of(st.integers(0, 3 * top), st.just(2**53)))
                direct.agree(key, now, cost, CHARGE, "", where)
            elif held:
                key, estimate, stamp = held.pop(data.draw(st.integers(0, len(held) - 1)))
                actual = 0 if kind == "cancel" else data.draw(st.integers(0, 3 * top))
                if actual > estimate:
                    direct.agree(key, now, actual - estimate, CHARGE, "", where)
                else:
                    direct.agree(key, now, estimate - actual, REFUND, str(stamp), where)
            else:
                direct.agree(key, now, 1, PEEK, token, where)
    finally:
        direct.client.close()


# == the model: a frozen clock, the sum of what was used =========================================


@pytest.mark.parametrize("algorithm", RATE_ALGORITHMS)
@settings(ALGORITHM_SETTINGS, max_examples=25)
@given(data=st.data())
def test_reservations_match_the_model_with_a_frozen_clock(
    backend: str, algorithm: str, data: st.DataObject
) -> None:
    limit = data.draw(st.integers(1, 40), label="limit")
    policy = Policy("m", f"{limit}/hour", algorithm)
    limiter = Limiter.from_url(
        backend,
        key_prefix=fresh_prefix(),
        clock=ManualClock(workers.FROZEN_AT),
        **exact_options(backend),
    )
    used = 0
    held: list[Any] = []
    try:
        for _ in range(data.draw(st.integers(1, 25), label="steps")):
            kind = data.draw(st.sampled_from(["reserve", "reserve", "settle", "cancel", "charge"]))
            if kind == "reserve":
                cost = data.draw(st.integers(1, limit + 1))
                reservation = limiter.reserve(policy, "k", cost)
                assert reservation.allowed == (used + cost <= limit)
                if reservation.allowed:
                    used += cost
                    held.append(reservation)
                    assert reservation.decision.remaining == limit - used
            elif kind == "charge":
                cost = data.draw(st.integers(1, 2 * limit))
                used += cost
                assert limiter.charge(policy, "k", cost).remaining == max(limit - used, 0)
            elif held:
                reservation = held.pop(data.draw(st.integers(0, len(held) - 1)))
                actual = 0 if kind == "cancel" else data.draw(st.integers(0, 2 * limit))
                used += actual - reservation.estimate
                after = reservation.settle(actual) if kind == "settle" else reservation.cancel()
                assert after.remaining == max(limit - used, 0)
                assert after.allowed == (used + 1 <= limit)
            assert limiter.peek(policy, "k").remaining == max(limit - used, 0)
    finally:
        limiter.close()


# == exact across processes =======================================================================

LIMIT = 1000
PROCESSES, THREADS, ROUNDS_EACH = 4, 16, 6


def _expected_wait(algorithm: str, overrun: int) -> float:
    """The wait for one unit after ``overrun`` units past the limit, at the frozen instant."""
    if algorithm in ("gcra", "token_bucket"):
        return (overrun + 1) * 3600 / LIMIT  # the debt, one emission interval a unit
    if algorithm == "fixed_window":
        return 3600 - workers.FROZEN_AT % 3600  # the window's end
    if algorithm == "sliding_log":
        return 3600.0  # every entry was logged at the frozen instant
    # sliding_window: in the next window, where this one's count weighs (W - e) / W.
    used = LIMIT + overrun
    elapsed_ms = int(workers.FROZEN_AT * 1000) % 3_600_000
    return (3_600_000 - elapsed_ms + 3_600_000 - (LIMIT - 1) * 3_600_000 // used) / 1000


@pytest.mark.parametrize("algorithm", RATE_ALGORITHMS)
def test_reservations_are_exact_across_processes(server: RedisServer, algorithm: str) -> None:
    """4 processes x 16 threads reserve 1-20 and settle 0-30 (or cancel) on a 1,000 per hour
    policy, the clock frozen: at the end a peek shows 1,000 minus the settled actuals (0, with
    the wait the overrun costs, when they exceed it), and no reservation was admitted once the
    actuals settled before it began had reached the limit."""
    ctx = multiprocessing.get_context("spawn")
    key_prefix = f"reserve-{uuid.uuid4().hex[:12]}"
    spec = {"name": "tokens", "rates": f"{LIMIT}/hour", "algorithm": algorithm, "burst": None}
    results = workers.run_processes(
        ctx,
        workers.threaded_reservations,
        PROCESSES,
        url=server.url,
        key_prefix=key_prefix,
        spec=spec,
        threads=THREADS,
        rounds=ROUNDS_EACH,
        barrier=ctx.Barrier(PROCESSES * THREADS),
    )
    settles = sorted(event for result in results for event in result["settled"])
    reserves = [event for result in results for event in result["reserved"]]
    total = sum(actual for _, actual in settles)
    assert len(reserves) == PROCESSES * THREADS * ROUNDS_EACH
    with Limiter.from_url(
        server.url, clock=workers.frozen_clock, **workers.exact_options(key_prefix)
    ) as limiter:
        decision = limiter.peek(workers.round_policy(spec), "shared")
    assert decision.remaining == max(LIMIT - total, 0)
    if total >= LIMIT:
        assert not decision.allowed
        assert decision.retry_after == pytest.approx(_expected_wait(algorithm, total - LIMIT))
        # Once the actuals settled reach the limit, every reservation begun later is denied.
        running = 0
        for ended, actual in settles:
            running += actual
            if running >= LIMIT:
                late = [allowed for began, allowed in reserves if began > ended]
                assert late
                assert not any(late)
                break
    else:
        assert decision.allowed
        assert math.isclose(decision.remaining, LIMIT - total)


# == the web: outcome-counted and reported costs ================================================


def test_asgi_failed_logins_in_flight_count_so_only_the_limit_reach_the_handler() -> None:
    """10 wrong passwords at once on a 3 per minute rule counted on 401: while the first ones
    are still in the handler, their reservations hold the budget, so exactly 3 run; a success
    (200) gives its reservation back."""
    from ratekeeper.asgi import RateLimitMiddleware, Rule

    policy = Policy("login", "3/minute")
    limiter = AsyncLimiter.from_url("memory://", clock=ManualClock(workers.FROZEN_AT))
    runs = 0
    inside = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        if runs == 3:
            inside.set()
        await inside.wait()  # everyone admitted is in the handler at once
        ok = dict(scope["headers"]).get(b"x-password") == b"right"
        await send({"type": "http.response.start", "status": 200 if ok else 401, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    limited = RateLimitMiddleware(
        app,
        limiter=limiter,
        rules=[Rule("/login", policy, deduct_when=lambda status: status == 401)],
    )

    async def main() -> None:
        async with asgi_client(limited) as http:
            wrong = {"x-password": "wrong"}
            replies = await asyncio.gather(*(http.post("/login", headers=wrong) for _ in range(10)))
            assert sorted(r.status_code for r in replies) == [401] * 3 + [429] * 7
            assert runs == 3
            later = await asyncio.gather(*(http.post("/login", headers=wrong) for _ in range(10)))
            assert {r.status_code for r in later} == {429}
            assert runs == 3
        await limiter.close()

    asyncio.run(main())


def test_a_success_gives_its_reservation_back() -> None:
    from ratekeeper.asgi import RateLimitMiddleware, Rule

    policy = Policy("login", "3/minute")
    limiter = AsyncLimiter.from_url("memory://", clock=ManualClock(workers.FROZEN_AT))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    limited = RateLimitMiddleware(
        app, limiter=limiter, rules=[Rule("/login", policy, deduct_when=lambda s: s == 401)]
    )

    async def main() -> None:
        async with asgi_client(limited) as http:
            replies = [await http.post("/login") for _ in range(6)]
            assert {r.status_code for r in replies} == {200}
            assert replies[-1].headers["ratelimit"] == '"login";r=3;t=0'
        assert (await limiter.peek(policy, "ip:203.0.113.7")).remaining == 3
        await limiter.close()

    asyncio.run(main())


@pytest.mark.parametrize("algorithm", RATE_ALGORITHMS)
def test_a_streamed_response_is_charged_the_tokens_it_reports(
    backend: str, key_prefix: str, algorithm: str
) -> None:
    """A route streams its answer and reports 700 tokens after its last chunk, on a 1,000 per
    minute token policy with an estimate of 200: the first request is admitted and charged
    700, the second admitted (200 fits) and charged 700, the third denied with the real
    wait."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from ratekeeper.asgi import RateLimitMiddleware, Rule

    tokens = Policy("tokens", "1000/minute", algorithm)
    clock = ManualClock(workers.FROZEN_AT)
    limiter = AsyncLimiter.from_url(
        backend, key_prefix=key_prefix, clock=clock, **exact_options(backend)
    )

    async def chat(request: Request) -> StreamingResponse:
        async def stream() -> Any:
            for word in ("to", "be", "or", "not"):
                yield word.encode()
            request.state.ratekeeper_cost = 700  # the usage the model reported, at the end

        return StreamingResponse(stream())

    app = Starlette(routes=[Route("/v1/chat", chat, methods=["POST"])])
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        rules=[Rule("/v1/chat", tokens, cost=200, reported_cost=True)],
    )

    async def main() -> None:
        async with asgi_client(app) as http:
            first = await http.post("/v1/chat")
            assert first.status_code == 200
            assert first.content == b"tobeornot"
            assert (await limiter.peek(tokens, "ip:203.0.113.7")).remaining == 300
            second = await http.post("/v1/chat")
            assert second.status_code == 200
            after = await limiter.peek(tokens, "ip:203.0.113.7", 200)
            assert after.remaining == 0
            assert not after.allowed
            third = await http.post("/v1/chat")
            assert third.status_code == 429
            assert third.json()["retry_after"] == pytest.approx(after.retry_after)
        await limiter.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "policy",
    [
        Policy("p", Rate(1, 0.003), "sliding_window"),  # 2**53 / 3 rounds in doubles
        Policy("p", Rate(2**52 // 3_600_000, 3600), "sliding_window"),  # at the bound
        Policy("p", Rate(2**52, 1), "fixed_window"),
        Policy("p", Rate(1, 1), "gcra"),
        Policy("p", "3/minute", "sliding_log"),
    ],
    ids=["sliding_window-3ms", "sliding_window-bound", "fixed_window", "gcra", "sliding_log"],
)
def test_the_largest_charge_stays_exact(server: RedisServer, policy: Policy) -> None:
    """A charge of 2**53 is capped where the arithmetic stays exact, alike on both sides."""
    direct = Direct(server, policy)
    now = int(START * 1_000_000)
    key = f"{fresh_prefix()}:k"
    try:
        direct.agree(key, now, 2**53, CHARGE, "", "charge")
        direct.agree(key, now, 1, PEEK, "", "peek")
        direct.agree(key, now + 1000, 2**53, CHARGE, "", "again")
    finally:
        direct.client.close()
