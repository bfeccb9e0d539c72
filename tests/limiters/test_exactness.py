"""Exactness under concurrency: never one admission too many, and none too few.

Every test uses windows of a minute or more, so nothing slides out of the window while it runs
and the exact number of admissions is known in advance. The algorithm rounds freeze the client
clock in every process (epoch-aligned windows cannot roll over, nothing refills), and the
lease test checks that no more than the limit is ever held at once.

Limiters here fail with an error rather than guess (``workers.exact_options``): a decision
made by a failure mode while the machine is loaded would make exact counts meaningless.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from ratekeeper import Limiter, ManualClock, Policy

from ..support import workers
from ..support.servers import RedisServer

PROCESSES = 4
THREADS = 16
HITS_EACH = 20
LIMIT = 100


def _log_length(url: str, limiter: Limiter, policy: Policy, identity: str) -> int:
    """Entries in the log of ``identity``, read with a client of our own."""
    (key,) = limiter.keys(policy, identity)
    client = redis.Redis.from_url(url)
    try:
        return int(client.llen(key))
    finally:
        client.close()


def _assert_exhausted(limiter: Limiter, policy: Policy, identity: str) -> None:
    decision = limiter.peek(policy, identity)
    assert not decision.allowed
    assert decision.remaining == 0
    assert decision.retry_after is not None
    assert decision.retry_after > 0


def _assert_exactly_the_limit(
    server: RedisServer, key_prefix: str, policy: Policy, results: list[dict[str, Any]], hits: int
) -> None:
    """Every hit was answered, exactly LIMIT were admitted, and the log holds LIMIT entries."""
    admitted = sum(result["admitted"] for result in results)
    denied = sum(result["denied"] for result in results)
    assert admitted + denied == hits
    assert admitted == LIMIT
    with Limiter.from_url(server.url, **workers.exact_options(key_prefix)) as limiter:
        assert _log_length(server.url, limiter, policy, "shared") == LIMIT
        _assert_exhausted(limiter, policy, "shared")


def test_processes_times_threads_admit_exactly_the_limit(server: RedisServer, key_prefix: str):
    """4 spawned processes x 16 threads, 1,280 hits on one identity: exactly 100 pass."""
    ctx = multiprocessing.get_context("spawn")
    policy = Policy("exact", f"{LIMIT}/minute")
    results = workers.run_processes(
        ctx,
        workers.threaded_hits,
        PROCESSES,
        url=server.url,
        key_prefix=key_prefix,
        policy_name=policy.name,
        rates=f"{LIMIT}/minute",
        identity="shared",
        threads=THREADS,
        hits_per_thread=HITS_EACH,
        cost=1,
        barrier=ctx.Barrier(PROCESSES * THREADS),
    )
    _assert_exactly_the_limit(server, key_prefix, policy, results, PROCESSES * THREADS * HITS_EACH)


@pytest.mark.parametrize("batching", [True, False], ids=["batching", "no-batching"])
def test_processes_times_async_tasks_admit_exactly_the_limit(
    server: RedisServer, key_prefix: str, batching: bool
):
    """4 spawned processes x 16 asyncio tasks, 1,280 hits on one identity: exactly 100 pass,
    with batching on (the default) and off."""
    ctx = multiprocessing.get_context("spawn")
    policy = Policy("exact", f"{LIMIT}/minute")
    results = workers.run_processes(
        ctx,
        workers.async_hits,
        PROCESSES,
        url=server.url,
        key_prefix=key_prefix,
        policy_name=policy.name,
        rates=f"{LIMIT}/minute",
        identity="shared",
        tasks=THREADS,
        hits_per_task=HITS_EACH,
        barrier=ctx.Barrier(PROCESSES),
        batching=batching,
    )
    _assert_exactly_the_limit(server, key_prefix, policy, results, PROCESSES * THREADS * HITS_EACH)


# --- Every algorithm, across processes ------------------------------------------------------------

#: Hits per thread (and per task) in each round: 4 x 16 x 4 = 256 hits for at most 100 units.
ROUND_HITS = 4


@dataclass(frozen=True)
class Round:
    """One algorithm under contention: ``expect`` units are admitted, exactly.

    ``frozen`` rounds use the client clock ``workers.frozen_clock`` (the middle of a UTC day) in
    every process, so epoch-aligned windows cannot roll over and nothing refills during a run;
    the others use the store's clock with windows so long (a day, an hour for the log) that
    nothing leaves them or refills while the test runs (GCRA refills one of 100/day per 864 s).
    """

    name: str
    rates: str
    algorithm: str
    frozen: bool
    expect: int
    burst: int | None = None

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rates": self.rates,
            "algorithm": self.algorithm,
            "frozen": self.frozen,
            "burst": self.burst,
        }

    def policy(self) -> Policy:
        return workers.round_policy(self.spec())


ROUNDS = [
    Round("sliding_log", "100/hour", "sliding_log", frozen=False, expect=100),
    Round("sliding_log-frozen", "100/hour", "sliding_log", frozen=True, expect=100),
    Round("fixed_window", "100/day", "fixed_window", frozen=True, expect=100),
    Round("fixed_window-2-rates", "30/hour;100/day", "fixed_window", frozen=True, expect=30),
    # Approximate in general; exact here: a fresh window with no previous window to weigh.
    Round("sliding_window", "100/day", "sliding_window", frozen=True, expect=100),
    Round("gcra", "100/day", "gcra", frozen=True, expect=100),
    Round("gcra-store-clock", "100/day", "gcra", frozen=False, expect=100),
    Round("gcra-2-rates", "30/hour;100/day", "gcra", frozen=True, expect=30),
    Round("token_bucket", "100/day", "token_bucket", frozen=True, expect=100),
    Round("token_bucket-burst", "1000/hour", "token_bucket", frozen=True, expect=100, burst=100),
]


def _run_rounds(server: RedisServer, mode: str) -> tuple[str, list[dict[str, Any]]]:
    """One spawn of PROCESSES processes that play every round in turn on ``server``."""
    ctx = multiprocessing.get_context("spawn")
    key_prefix = f"rounds-{mode}-{uuid.uuid4().hex[:12]}"
    common: dict[str, Any] = {
        "url": server.url,
        "key_prefix": key_prefix,
        "rounds": [round_.spec() for round_ in ROUNDS],
        "identity": "shared",
    }
    if mode == "threads":
        results = workers.run_processes(
            ctx,
            workers.threaded_rounds,
            PROCESSES,
            **common,
            threads=THREADS,
            hits_per_thread=ROUND_HITS,
            barrier=ctx.Barrier(PROCESSES * THREADS),
        )
    else:
        results = workers.run_processes(
            ctx,
            workers.async_rounds,
            PROCESSES,
            **common,
            tasks=THREADS,
            hits_per_task=ROUND_HITS,
            barrier=ctx.Barrier(PROCESSES),
            batching=mode == "async",  # "async-unbatched": batching off
        )
    return key_prefix, results


@pytest.fixture(scope="module")
def round_runs(servers: dict[str, RedisServer]) -> Any:
    """``run(server, mode)``: the outcome of all rounds, played once per flavor and mode.

    One spawn of processes serves every algorithm (each round behind its own barrier), which
    keeps this module fast; a failed run is remembered, not repeated for every algorithm.
    """
    outcomes: dict[tuple[str, str], Any] = {}

    def run(server: RedisServer, mode: str) -> tuple[str, list[dict[str, Any]]]:
        slot = (server.binary.flavor, mode)
        if slot not in outcomes:
            try:
                outcomes[slot] = _run_rounds(server, mode)
            except Exception as exc:
                outcomes[slot] = exc
        outcome = outcomes[slot]
        if isinstance(outcome, Exception):
            raise AssertionError(f"the {mode} run on {slot[0]} failed") from outcome
        return outcome

    return run


def _assert_round_state(url: str, key_prefix: str, round_: Round) -> None:
    """The store agrees: the identity is exhausted, and the stored counts say ``expect``."""
    policy = round_.policy()
    clock = workers.frozen_clock if round_.frozen else None
    with Limiter.from_url(url, clock=clock, **workers.exact_options(key_prefix)) as limiter:
        _assert_exhausted(limiter, policy, "shared")
        (key,) = limiter.keys(policy, "shared")
        client = redis.Redis.from_url(url, decode_responses=True)
        try:
            if round_.algorithm == "sliding_log":
                assert int(client.llen(key)) == round_.expect
            elif round_.algorithm in ("fixed_window", "sliding_window"):
                stored = client.hgetall(key)
                assert stored["c1"] == str(round_.expect)
                if round_.algorithm == "sliding_window":
                    assert stored["p1"] == "0"
            elif round_.frozen:
                # GCRA: the TAT (q + r / limit ms) is exactly `expect` emission intervals ahead.
                stored = client.hgetall(key)
                rate = policy.rates[0]
                tat = int(stored["q1"]) * rate.limit + int(stored["r1"])  # in 1/limit ms
                now_ms = int(workers.FROZEN_AT * 1000)
                assert tat == now_ms * rate.limit + round_.expect * rate.period_ms
        finally:
            client.close()


@pytest.mark.parametrize("mode", ["threads", "async", "async-unbatched"])
@pytest.mark.parametrize("round_", ROUNDS, ids=[round_.name for round_ in ROUNDS])
def test_every_algorithm_admits_exactly_its_promise_across_processes(
    server: RedisServer, round_runs: Any, round_: Round, mode: str
):
    """4 spawned processes x 16 threads (or asyncio tasks, batched or not) hit one identity 256
    times under each algorithm: exactly the promised number pass, not one more, not one fewer."""
    key_prefix, results = round_runs(server, mode)
    admitted = sum(result["counts"][round_.name][0] for result in results)
    denied = sum(result["counts"][round_.name][1] for result in results)
    assert admitted + denied == PROCESSES * THREADS * ROUND_HITS
    assert admitted == round_.expect
    _assert_round_state(server.url, key_prefix, round_)


# --- Concurrency leases, across processes ---------------------------------------------------------

LEASES = 10
LEASE_ITERATIONS = 8


def test_processes_times_threads_never_hold_more_leases_than_the_limit(
    server: RedisServer, key_prefix: str
):
    """4 spawned processes x 16 threads take and release leases of one identity (10 at once).

    First all 64 acquire together and the granted hold on until everyone has tried: exactly 10
    get one. Then each thread loops acquire / check / release. Holders never see more than 10
    leases on the server, the shared in-flight count (a lower bound of the leases really held)
    never exceeds 10, every granted lease is released while still held, and at the end the
    sorted set is gone and exactly 10 units can be taken again.
    """
    ctx = multiprocessing.get_context("spawn")
    rates = f"{LEASES} per 60 seconds"
    policy = Policy("leases", rates, algorithm="concurrency")
    in_flight = ctx.Array("i", 2)
    results = workers.run_processes(
        ctx,
        workers.threaded_leases,
        PROCESSES,
        url=server.url,
        key_prefix=key_prefix,
        policy_name=policy.name,
        rates=rates,
        identity="shared",
        threads=THREADS,
        iterations=LEASE_ITERATIONS,
        barrier=ctx.Barrier(PROCESSES * THREADS),
        in_flight=in_flight,
    )

    def total(name: str) -> int:
        return sum(result[name] for result in results)

    workers_ = PROCESSES * THREADS
    assert total("first_wave") == LEASES
    assert total("acquired") + total("denied") == workers_ * (1 + LEASE_ITERATIONS)
    assert total("denied") >= workers_ - LEASES  # the limit was reached
    assert total("acquired") > LEASES  # and capacity came back after releases
    assert total("released") == total("acquired")
    assert total("overfull") == 0
    assert 1 <= max(result["max_seen"] for result in results) <= LEASES
    assert in_flight[0] == 0
    assert in_flight[1] == LEASES  # reached in the first wave, never exceeded

    with Limiter.from_url(server.url, **workers.exact_options(key_prefix)) as limiter:
        (key,) = limiter.keys(policy, "shared")
        client = redis.Redis.from_url(server.url)
        try:
            assert client.exists(key) == 0  # released to the last, the sorted set is deleted
            assert limiter.peek(policy, "shared").remaining == LEASES
            leases = [limiter.acquire(policy, "shared") for _ in range(LEASES + 1)]
            assert [lease.allowed for lease in leases] == [True] * LEASES + [False]
            assert int(client.zcard(key)) == LEASES
            assert [lease.release() for lease in leases] == [True] * LEASES + [False]
            assert client.exists(key) == 0
        finally:
            client.close()


def test_forked_children_do_not_reuse_the_parents_log_members(server: RedisServer, key_prefix: str):
    """Children forked after the parent made calls stay exact on one shared log.

    The log was a sorted set, where two calls with the same token wrote the same members and
    the limit could be exceeded; it is a list now and needs no unique members, so this test no
    longer proves that tokens differ after a fork (lease members still need them to).
    """
    policy = Policy("forked", f"{LIMIT}/minute")
    per_child = 30
    with Limiter.from_url(server.url, **workers.exact_options(key_prefix)) as limiter:
        # Advance the parent's token counter, on an identity of its own.
        for _ in range(5):
            assert limiter.hit(policy, "parent").allowed
        results = workers.run_processes(
            multiprocessing.get_context("fork"),
            workers.sequential_hits,
            PROCESSES,
            url=server.url,
            key_prefix=key_prefix,
            policy_name=policy.name,
            rates=f"{LIMIT}/minute",
            identity="shared",
            hits=per_child,
        )
    _assert_exactly_the_limit(server, key_prefix, policy, results, PROCESSES * per_child)


@pytest.mark.parametrize("clock", ["store", "frozen"])
def test_a_thousand_fast_hits_admit_exactly_500(backend: str, key_prefix: str, clock: str):
    """Many hits in the same millisecond (or, frozen, the same microsecond) all count.

    A log keyed by timestamp would merge hits that share one and admit more than the limit.
    """
    options = workers.exact_options(key_prefix, server=backend != "memory://")
    if clock == "frozen":
        options["clock"] = ManualClock()
    policy = Policy("burst", "500/minute")
    with Limiter.from_url(backend, **options) as limiter:
        decisions = [limiter.hit(policy, "burst") for _ in range(1000)]
        allowed = [decision.allowed for decision in decisions]
        assert sum(allowed) == 500
        assert allowed == [True] * 500 + [False] * 500
        assert [d.remaining for d in decisions[:500]] == list(range(499, -1, -1))
        assert all(d.remaining == 0 and d.retry_after is not None for d in decisions[500:])
        _assert_exhausted(limiter, policy, "burst")
        if backend != "memory://":
            assert _log_length(backend, limiter, policy, "burst") == 500


def _options(backend: str, key_prefix: str) -> dict[str, Any]:
    """Limiter options that count exactly; on a server, a timeout that never fires under load."""
    return workers.exact_options(key_prefix, server=backend != "memory://")


def _hit_in_threads(threads: int, body: Any) -> tuple[int, list[BaseException]]:
    """Run ``body(index)`` in ``threads`` threads started together; sum what they return."""
    barrier = threading.Barrier(threads)
    lock = threading.Lock()
    total = 0
    errors: list[BaseException] = []

    def run(index: int) -> None:
        nonlocal total
        try:
            barrier.wait(30)
            admitted = body(index)
        except BaseException as exc:
            with lock:
                errors.append(exc)
            return
        with lock:
            total += admitted

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return total, errors


def test_cost_weighted_threads_never_exceed_the_limit(backend: str, key_prefix: str):
    """Threads spending 3 units a hit fill 99 of 100: one more hit of 3 would not fit."""
    policy = Policy("weighted", f"{LIMIT}/minute")
    with Limiter.from_url(backend, **_options(backend, key_prefix)) as limiter:

        def body(_: int) -> int:
            admitted = 0
            for _ in range(15):
                if limiter.hit(policy, "w", cost=3).allowed:
                    admitted += 3
            return admitted

        total, errors = _hit_in_threads(8, body)
        assert errors == []
        assert 98 <= total <= LIMIT
        assert total == (LIMIT // 3) * 3
        decision = limiter.peek(policy, "w", cost=3)
        assert not decision.allowed
        assert decision.remaining == LIMIT - total
        assert limiter.peek(policy, "w", cost=1).allowed
        if backend != "memory://":
            assert _log_length(backend, limiter, policy, "w") == total


def test_mixed_costs_fill_the_limit_exactly(backend: str, key_prefix: str):
    """Threads with random costs keep going until a hit of cost 1 is denied: the window is
    then exactly full, so the admitted costs add up to the limit, not one unit more or less."""
    policy = Policy("mixed", f"{LIMIT}/minute")
    with Limiter.from_url(backend, **_options(backend, key_prefix)) as limiter:

        def body(index: int) -> int:
            rng = random.Random(index)
            admitted = 0
            for _ in range(1000):
                cost = rng.choice((1, 2, 3, 5, 7))
                decision = limiter.hit(policy, "m", cost=cost)
                if decision.allowed:
                    admitted += cost
                elif cost == 1:
                    return admitted
            raise AssertionError("a hit of cost 1 was never denied")

        total, errors = _hit_in_threads(8, body)
        assert errors == []
        assert total == LIMIT
        _assert_exhausted(limiter, policy, "m")
        if backend != "memory://":
            assert _log_length(backend, limiter, policy, "m") == LIMIT


def test_large_costs_are_counted_unit_by_unit(backend: str, key_prefix: str):
    """Costs above the script's ZADD batch size (200 members) are written in full."""
    policy = Policy("large", "1000/minute")
    with Limiter.from_url(backend, **_options(backend, key_prefix)) as limiter:
        assert limiter.hit(policy, "l", cost=450).remaining == 550
        assert limiter.hit(policy, "l", cost=401).remaining == 149
        denied = limiter.hit(policy, "l", cost=150)
        assert not denied.allowed
        assert denied.remaining == 149
        assert limiter.hit(policy, "l", cost=149).remaining == 0
        _assert_exhausted(limiter, policy, "l")
        if backend != "memory://":
            assert _log_length(backend, limiter, policy, "l") == 1000


def test_multi_rate_threads_admit_exactly_the_tightest_limit(backend: str, key_prefix: str):
    """With two rates, the tighter one caps the total, exactly, under contention."""
    policy = Policy("multi", "30/minute;100/hour")
    with Limiter.from_url(backend, **_options(backend, key_prefix)) as limiter:

        def body(_: int) -> int:
            return sum(limiter.hit(policy, "mr").allowed for _ in range(10))

        total, errors = _hit_in_threads(8, body)
        assert errors == []
        assert total == 30
        decision = limiter.peek(policy, "mr")
        assert not decision.allowed
        assert decision.limit == 30
        if backend != "memory://":
            assert _log_length(backend, limiter, policy, "mr") == 30
