"""Property: the memory backend (the Python reference) and the Lua script on a real server make
identical decisions for any sequence of hits, peeks, resets and clock moves, for every
algorithm.

Both limiters get the same ``ManualClock`` through ``clock=``, so both see the same instants. A
naive model written from the documented semantics of each algorithm is a third opinion, so a
bug shared by the two mirrored implementations cannot hide:

* sliding_log: count the admitted units whose time is in ``(now - window, now]``;
* fixed_window and sliding_window: the admitted units of each epoch-aligned window, from the
  history of admissions, put through the documented formula in exact fractions;
* gcra: the theoretical arrival time as an exact fraction of a millisecond;
* concurrency: the leases held, each with its expiry.

On top of that, invariants that follow from each algorithm's definition are checked on the
history of what was admitted (e.g. a fixed window never admits more than its limit). With a
clock that also moves back (clients whose clocks disagree), each script is compared with its
reference alone, reply by reply.

The limiters under test decide with the store alone: no deny cache (its own property is below),
failure mode ``raise`` (a store error must fail the test, not turn into a degraded decision),
generous timeouts and a breaker that ignores slow calls, so a loaded machine cannot change an
outcome.

Limiters are built inside the test body: Hypothesis runs many examples per fixture instance,
and each example needs fresh state (a fresh key prefix, a fresh memory store). A server's keys
expire in real time while the clock here is manual, so every key must outlive the example: the
shortest TTL is the 1 s margin, and each example must run well within it (a few ms per call).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ratekeeper.testing
from ratekeeper import AsyncLimiter, CircuitBreaker, Decision, Limiter, ManualClock, Policy, Rate
from ratekeeper._algorithms import (
    CHARGE,
    HIT,
    PEEK,
    REFUND,
    RELEASE,
    RESERVE,
    Reply,
    decode_args,
    encode_args,
    get_algorithm,
)
from ratekeeper._algorithms.concurrency import _Leases
from ratekeeper._algorithms.keyspace import Keyspace
from ratekeeper._algorithms.scripts import load_script
from ratekeeper._engine.keys import Identity, identity_bytes

from ..support.clocks import ExactClock
from ..support.servers import RedisServer
from ..support.strategies import (
    ALGORITHM_CASES,
    BOUNDARY_CASES,
    LOG_CASES,
    START,
    Acquire,
    Advance,
    AlgorithmOp,
    AlgorithmScenario,
    Boundary,
    Hit,
    Peek,
    Release,
    Reset,
    Scenario,
    WaitRetry,
    algorithm_policies,
    algorithm_scenarios,
    boundary_scenarios,
    burst_of,
    capacity,
    draw_time_op,
    scenarios,
)

_prefixes = itertools.count()


def fresh_prefix() -> str:
    return f"prop{next(_prefixes)}"


def exact_options(url: str) -> dict[str, Any]:
    """Options under which the store alone decides every call (see the module docstring)."""
    options: dict[str, Any] = {
        "deny_cache": 0,
        "failure_mode": "raise",
        "breaker": CircuitBreaker(slow_call=60.0),
    }
    if not url.startswith("memory://"):
        options.update(timeout=10.0, connect_timeout=10.0)
    return options


#: One rate's part of a decision: (rate, remaining, reset in us, retry in us: None when this
#: rate admits, math.inf when it never can).
Row = tuple[Rate, int, int, float | None]


def pick(policy: Policy, allowed: bool, rows: list[Row]) -> Decision:
    """The decision the documented choice of rate makes of ``rows``."""
    if allowed:
        # The rate with the fewest units left; ties: the longest reset, then the first.
        best = max(rows, key=lambda r: (-r[1], r[2]))
    else:
        # The denying rate with the longest wait; ties: the longest reset, then the first.
        best = max((r for r in rows if r[3] is not None), key=lambda r: (r[3], r[2]))
    rate, remaining, reset, retry = best
    return ratekeeper.testing.decision(
        allowed,
        rate=rate,
        remaining=remaining,
        reset_after=reset / 1_000_000,
        retry_after=None if retry is None else retry / 1_000_000,
        policy=policy.name,
    )


def state_key(policy: Policy, identity: Identity) -> tuple[str, bytes]:
    return (policy.name, identity_bytes(identity))


class Model:
    """Sliding-window log semantics as documented, with no shortcuts: one time per unit."""

    def __init__(self) -> None:
        self.logs: dict[tuple[str, bytes], list[int]] = defaultdict(list)

    def reset(self, policy: Policy, identity: Identity) -> None:
        self.logs.pop(state_key(policy, identity), None)

    def decide(
        self, policy: Policy, identity: Identity, cost: int, now: int, *, peek: bool
    ) -> Decision:
        log = self.logs[state_key(policy, identity)]
        windows = [sorted(t for t in log if t > now - rate.period_us) for rate in policy.rates]
        allowed = all(
            len(inside) + cost <= rate.limit
            for rate, inside in zip(policy.rates, windows, strict=True)
        )
        consume = allowed and not peek
        rows: list[Row] = []
        for rate, inside in zip(policy.rates, windows, strict=True):
            count, limit, window = len(inside), rate.limit, rate.period_us
            used = count + cost if consume else count
            retry: float | None = None
            if count + cost > limit:
                # Units in excess of the limit must leave the window, oldest first.
                retry = (
                    math.inf if cost > limit else inside[count + cost - limit - 1] + window - now
                )
            newest = now if consume else (inside[-1] if inside else None)
            reset = newest + window - now if newest is not None else 0
            rows.append((rate, max(limit - used, 0), reset, retry))
        if consume:
            log.extend([now] * cost)
        return pick(policy, allowed, rows)


def check_invariants(decision: Decision, policy: Policy, cost: int) -> None:
    assert decision.policy == policy.name
    assert decision.rate in policy.rates
    assert decision.limit == decision.rate.limit
    assert 0 <= decision.remaining <= decision.limit
    assert 0 <= decision.reset_after <= decision.rate.period
    if decision.allowed:
        assert decision.retry_after is None
    elif cost > min(rate.limit for rate in policy.rates):
        assert decision.retry_after == math.inf
    else:
        assert decision.retry_after is not None
        assert 0 < decision.retry_after <= decision.rate.period


class Run:
    """Replays one scenario, collecting what each side decided."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.clock = ManualClock(START)
        self.elapsed_us = 0
        self.model = Model()

    def now_us(self) -> int:
        return int(self.clock() * 1_000_000)

    def advance(self, op: Advance) -> None:
        # Set, not advance: no float drift accumulates over a sequence.
        self.elapsed_us += op.us
        self.clock.set(START + self.elapsed_us / 1_000_000)

    def expect(self, op: Hit | Peek) -> Decision:
        policy = self.scenario.policies[op.policy]
        identity = self.scenario.identities[op.identity]
        expected = self.model.decide(
            policy, identity, op.cost, self.now_us(), peek=isinstance(op, Peek)
        )
        check_invariants(expected, policy, op.cost)
        return expected


def run_sync(scenario: Scenario, memory: Limiter, remote: Limiter, run: Run) -> None:
    for step, op in enumerate(scenario.ops):
        if isinstance(op, Advance):
            run.advance(op)
            continue
        policy = scenario.policies[op.policy]
        identity = scenario.identities[op.identity]
        if isinstance(op, Reset):
            memory.reset(policy, identity)
            remote.reset(policy, identity)
            run.model.reset(policy, identity)
            continue
        method = "hit" if isinstance(op, Hit) else "peek"
        on_memory = getattr(memory, method)(policy, identity, op.cost)
        on_server = getattr(remote, method)(policy, identity, op.cost)
        assert on_server == on_memory, f"step {step}: {op}"
        assert on_memory == run.expect(op), f"step {step}: {op}"


# A failure shrinks by replaying sequences against a real server, which can take minutes:
# more than pytest's default timeout, which would hide the minimal example.
SHRINK_TIMEOUT = pytest.mark.timeout(900)

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@SHRINK_TIMEOUT
@SETTINGS
@given(scenario=scenarios())
def test_memory_and_server_agree(server: RedisServer, scenario: Scenario) -> None:
    run = Run(scenario)
    prefix = fresh_prefix()
    with (
        Limiter.from_url(
            "memory://", key_prefix=prefix, clock=run.clock, **exact_options("memory://")
        ) as memory,
        Limiter.from_url(
            server.url, key_prefix=prefix, clock=run.clock, **exact_options(server.url)
        ) as remote,
    ):
        run_sync(scenario, memory, remote, run)


async def run_async(scenario: Scenario, url: str, run: Run) -> None:
    prefix = fresh_prefix()
    async with (
        AsyncLimiter.from_url(
            "memory://", key_prefix=prefix, clock=run.clock, **exact_options("memory://")
        ) as memory,
        AsyncLimiter.from_url(
            url, key_prefix=prefix, clock=run.clock, **exact_options(url)
        ) as remote,
    ):
        for step, op in enumerate(scenario.ops):
            if isinstance(op, Advance):
                run.advance(op)
                continue
            policy = scenario.policies[op.policy]
            identity = scenario.identities[op.identity]
            if isinstance(op, Reset):
                await memory.reset(policy, identity)
                await remote.reset(policy, identity)
                run.model.reset(policy, identity)
                continue
            if isinstance(op, Hit):
                on_memory = await memory.hit(policy, identity, op.cost)
                on_server = await remote.hit(policy, identity, op.cost)
            else:
                on_memory = await memory.peek(policy, identity, op.cost)
                on_server = await remote.peek(policy, identity, op.cost)
            assert on_server == on_memory, f"step {step}: {op}"
            assert on_memory == run.expect(op), f"step {step}: {op}"


@SHRINK_TIMEOUT
@settings(SETTINGS, max_examples=40)
@given(scenario=scenarios(max_ops=30))
def test_async_memory_and_server_agree(servers: dict[str, RedisServer], scenario: Scenario) -> None:
    server = servers.get("valkey") or next(iter(servers.values()))
    asyncio.run(run_async(scenario, server.url, Run(scenario)))


@SHRINK_TIMEOUT
@SETTINGS
@given(scenario=scenarios(max_ops=40, max_policies=1))
def test_memory_matches_model_without_server(scenario: Scenario) -> None:
    """The reference alone against the model, with the key expiry of the memory keyspace
    driven by the manual clock (a server's keys expire in real time instead)."""
    run = Run(scenario)
    with Limiter.from_url(
        "memory://", key_prefix=fresh_prefix(), clock=run.clock, **exact_options("memory://")
    ) as memory:
        for step, op in enumerate(scenario.ops):
            if isinstance(op, Advance):
                run.advance(op)
            elif isinstance(op, Reset):
                memory.reset(scenario.policies[op.policy], scenario.identities[op.identity])
                run.model.reset(scenario.policies[op.policy], scenario.identities[op.identity])
            else:
                policy = scenario.policies[op.policy]
                identity = scenario.identities[op.identity]
                method = memory.hit if isinstance(op, Hit) else memory.peek
                assert method(policy, identity, op.cost) == run.expect(op), f"step {step}: {op}"


# == every algorithm =========================================================================
#
# Models: each decides from its own record of what was admitted, in exact arithmetic.


class History:
    """What each (policy, identity) had admitted, as (time in us, cost), since its reset."""

    def __init__(self) -> None:
        self.admitted: dict[tuple[str, bytes], list[tuple[int, int]]] = defaultdict(list)

    def reset(self, policy: Policy, identity: Identity) -> None:
        self.admitted.pop(state_key(policy, identity), None)


class FixedWindowModel(History):
    """A count per epoch-aligned window ``[k W, (k + 1) W)``; older windows count nothing."""

    def decide(
        self, policy: Policy, identity: Identity, cost: int, now: int, *, peek: bool
    ) -> Decision:
        admitted = self.admitted[state_key(policy, identity)]
        counted = []
        for rate in policy.rates:
            start = now - now % rate.period_us
            counted.append((start, sum(c for t, c in admitted if t >= start)))
        allowed = all(
            count + cost <= rate.limit
            for rate, (_, count) in zip(policy.rates, counted, strict=True)
        )
        consume = allowed and not peek
        rows: list[Row] = []
        for rate, (start, count) in zip(policy.rates, counted, strict=True):
            used = count + cost if consume else count
            ends = start + rate.period_us
            retry: float | None = None
            if count + cost > rate.limit:
                retry = math.inf if cost > rate.limit else ends - now
            rows.append((rate, max(rate.limit - used, 0), ends - now if used > 0 else 0, retry))
        if consume:
            admitted.append((now, cost))
        return pick(policy, allowed, rows)


class SlidingWindowModel(History):
    """The documented estimate ``prev * (W - e) / W + curr`` in exact fractions, ``e`` the
    whole milliseconds elapsed in the current aligned window, ``prev`` and ``curr`` the units
    admitted in the previous and current aligned windows."""

    def decide(
        self, policy: Policy, identity: Identity, cost: int, now: int, *, peek: bool
    ) -> Decision:
        admitted = self.admitted[state_key(policy, identity)]
        states = []
        for rate in policy.rates:
            window, wms = rate.period_us, rate.period_ms
            start = now - now % window
            curr = sum(c for t, c in admitted if t >= start)
            prev = sum(c for t, c in admitted if start - window <= t < start)
            elapsed_ms = (now - start) // 1000
            weight = Fraction(prev * (wms - elapsed_ms), wms)
            states.append((start, curr, prev, weight))
        allowed = all(
            weight + curr + cost <= rate.limit
            for rate, (_, curr, _, weight) in zip(policy.rates, states, strict=True)
        )
        consume = allowed and not peek
        rows: list[Row] = []
        for rate, (start, curr, prev, weight) in zip(policy.rates, states, strict=True):
            limit, window, wms = rate.limit, rate.period_us, rate.period_ms
            used = curr + cost if consume else curr
            remaining = max(math.floor(limit - used - weight), 0)
            if used > 0:
                reset = start + 2 * window - now  # counted now, weighted through the next window
            elif prev > 0:
                reset = start + window - now
            else:
                reset = 0
            retry: float | None = None
            if cost > limit:
                retry = math.inf
            elif weight + curr + cost > limit:
                if curr + cost <= limit:
                    # Later in this window: the first whole ms e' where the weight fits.
                    at = math.ceil(wms - Fraction((limit - curr - cost) * wms, prev))
                    retry = start + at * 1000 - now
                else:
                    # In the next window, where this window's count becomes the previous one.
                    at = math.ceil(wms - Fraction((limit - cost) * wms, curr))
                    retry = start + window + at * 1000 - now
            rows.append((rate, remaining, reset, retry))
        if consume:
            admitted.append((now, cost))
        return pick(policy, allowed, rows)


class GcraModel(History):
    """The theoretical arrival time (TAT) per rate as an exact fraction of a millisecond, with
    emission interval ``T = period / limit``, burst ``B``, and time ``t`` in whole ms: a cost
    ``c`` fits when ``max(TAT, t) + c T - t <= B T``, and admitting it sets ``TAT`` to
    ``max(TAT, t) + c T``."""

    def __init__(self) -> None:
        super().__init__()
        self.tats: dict[tuple[str, bytes], dict[int, Fraction]] = defaultdict(dict)

    def reset(self, policy: Policy, identity: Identity) -> None:
        super().reset(policy, identity)
        self.tats.pop(state_key(policy, identity), None)

    def decide(
        self, policy: Policy, identity: Identity, cost: int, now: int, *, peek: bool
    ) -> Decision:
        tats = self.tats[state_key(policy, identity)]
        t = now // 1000
        states = []
        for i, rate in enumerate(policy.rates):
            interval = Fraction(rate.period_ms, rate.limit)
            tat = tats.get(i)
            ahead = max(tat - t, Fraction(0)) if tat is not None else Fraction(0)
            states.append((interval, burst_of(policy, i), ahead))
        allowed = all(ahead + cost * tau <= burst * tau for tau, burst, ahead in states)
        consume = allowed and not peek
        rows: list[Row] = []
        for i, (rate, (tau, burst, ahead)) in enumerate(zip(policy.rates, states, strict=True)):
            after = ahead + cost * tau if consume else ahead
            remaining = max(math.floor(burst - after / tau), 0)
            reset = max(math.ceil((t + after) * 1000) - now, 0) if after > 0 else 0
            retry: float | None = None
            if cost > burst:
                retry = math.inf
            elif ahead + cost * tau > burst * tau:
                retry = math.ceil(t + ahead + cost * tau - burst * tau) * 1000 - now
            rows.append((rate, remaining, reset, retry))
            if consume:
                tats[i] = t + after
        if consume:
            self.admitted[state_key(policy, identity)].append((now, cost))
        return pick(policy, allowed, rows)


@dataclass
class ModelLease:
    key: tuple[str, bytes]
    expires: int
    cost: int
    held: bool


class ConcurrencyModel(History):
    """Leases: at most ``limit`` units held at once; a lease expires ``period`` after it was
    taken; releasing a lease that is still held frees it and says so."""

    def __init__(self) -> None:
        super().__init__()
        self.leases: list[ModelLease] = []

    def reset(self, policy: Policy, identity: Identity) -> None:
        for lease in self.leases:
            if lease.key == state_key(policy, identity):
                lease.held = False

    def live(self, key: tuple[str, bytes], now: int) -> list[ModelLease]:
        return [x for x in self.leases if x.key == key and x.held and x.expires > now]

    def acquire(
        self, policy: Policy, identity: Identity, cost: int, now: int, *, peek: bool
    ) -> tuple[Decision, ModelLease]:
        (rate,) = policy.rates
        key = state_key(policy, identity)
        live = self.live(key, now)
        count = sum(x.cost for x in live)
        allowed = count + cost <= rate.limit
        retry: float | None = None
        if cost > rate.limit:
            retry = math.inf
        elif not allowed:
            # The units in excess of the limit must expire first, earliest first.
            units = sorted(x.expires for x in live for _ in range(x.cost))
            retry = units[count + cost - rate.limit - 1] - now
        lease = ModelLease(key, now + rate.period_us, cost, held=allowed and not peek)
        if lease.held:
            self.leases.append(lease)
            live.append(lease)
        used = sum(x.cost for x in live)
        reset = max(x.expires for x in live) - now if live else 0
        return pick(policy, allowed, [(rate, max(rate.limit - used, 0), reset, retry)]), lease

    def decide(
        self, policy: Policy, identity: Identity, cost: int, now: int, *, peek: bool
    ) -> Decision:
        return self.acquire(policy, identity, cost, now, peek=peek)[0]

    @staticmethod
    def release(lease: ModelLease, now: int) -> bool:
        held = lease.held and lease.expires > now
        lease.held = False
        return held


AnyModel = Model | FixedWindowModel | SlidingWindowModel | GcraModel | ConcurrencyModel

MODELS: dict[str, Callable[[], AnyModel]] = {
    "sliding_log": Model,
    "fixed_window": FixedWindowModel,
    "sliding_window": SlidingWindowModel,
    "gcra": GcraModel,
    "token_bucket": GcraModel,
    "concurrency": ConcurrencyModel,
}


# Invariants that follow from each algorithm's definition, on what was actually admitted.


def check_decision(decision: Decision, policy: Policy, cost: int) -> None:
    """Bounds every decision of ``policy`` keeps, per algorithm."""
    algorithm = policy.algorithm
    gcra = algorithm in ("gcra", "token_bucket")
    assert decision.policy == policy.name
    assert decision.rate in policy.rates
    assert decision.limit == decision.rate.limit
    assert not decision.degraded
    assert decision.reason is None
    index = policy.rates.index(decision.rate)
    rate = decision.rate
    burst = burst_of(policy, index) if gcra else rate.limit
    assert 0 <= decision.remaining <= burst
    if gcra:
        # Nothing stays stored longer than the burst's worth of emission intervals.
        longest = math.ceil(Fraction(burst * rate.period_us, rate.limit)) / 1_000_000
    elif algorithm == "sliding_window":
        longest = 2 * rate.period  # counted now, weighted through the next window
    else:
        longest = rate.period
    assert 0 <= decision.reset_after <= longest
    capacities = [burst_of(policy, i) if gcra else r.limit for i, r in enumerate(policy.rates)]
    if decision.allowed:
        assert decision.retry_after is None
    elif cost > min(capacities):
        assert decision.retry_after == math.inf
    else:
        assert decision.retry_after is not None
        assert 0 < decision.retry_after <= longest + (0.001 if gcra else 0)


def check_history(policy: Policy, admitted: list[tuple[int, int]]) -> None:
    """What one identity had admitted since its last reset, against the algorithm's promise."""
    algorithm = policy.algorithm
    for index, rate in enumerate(policy.rates):
        if algorithm == "sliding_log":
            # No window (t - W, t] ever holds more than the limit.
            for t, _ in admitted:
                inside = sum(c for u, c in admitted if t - rate.period_us < u <= t)
                assert inside <= rate.limit, (rate, t, admitted)
        elif algorithm in ("fixed_window", "sliding_window"):
            # Both count per aligned window, and neither admits more than the limit in one.
            per_window: dict[int, int] = defaultdict(int)
            for t, cost in admitted:
                per_window[t // rate.period_us] += cost
            assert max(per_window.values(), default=0) <= rate.limit, (rate, dict(per_window))
        elif algorithm in ("gcra", "token_bucket"):
            # Between any two admissions, at t_i <= t_j in whole ms, the admitted cost is at
            # most burst + floor((t_j - t_i) * limit / period_ms): the TAT advances by the
            # cost times T = period / limit and can run at most burst * T ahead of the clock.
            burst = burst_of(policy, index)
            for i in range(len(admitted)):
                total = 0
                for j in range(i, len(admitted)):
                    total += admitted[j][1]
                    elapsed_ms = admitted[j][0] // 1000 - admitted[i][0] // 1000
                    bound = burst + elapsed_ms * rate.limit // rate.period_ms
                    assert total <= bound, (rate, burst, admitted[i : j + 1])


class Replies:
    """A storage wrapper keeping every raw script reply, so that the two sides can be compared
    on every rate, not only on the one a decision reports."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.replies: list[list[int]] = []

    def run(self, script: Any, keys: tuple[str, ...], args: tuple[int | str, ...]) -> list[int]:
        reply = [int(value) for value in self.storage.run(script, keys, args)]
        self.replies.append(reply)
        return reply

    def delete(self, keys: tuple[str, ...]) -> int:
        return int(self.storage.delete(keys))

    def close(self) -> None:
        self.storage.close()


class AsyncReplies(Replies):
    async def run(  # type: ignore[override]
        self, script: Any, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> list[int]:
        reply = [int(value) for value in await self.storage.run(script, keys, args)]
        self.replies.append(reply)
        return reply

    async def delete(self, keys: tuple[str, ...]) -> int:  # type: ignore[override]
        return int(await self.storage.delete(keys))

    async def close(self) -> None:  # type: ignore[override]
        await self.storage.close()


class Side:
    """One limiter under test, driven blockingly whichever its API."""

    def __init__(self, url: str, prefix: str, clock: ManualClock, loop: Any = None) -> None:
        self.loop = loop
        options = exact_options(url)
        if loop is None:
            self.limiter: Any = Limiter.from_url(url, key_prefix=prefix, clock=clock, **options)
            self.replies = Replies(self.limiter.storage)
        else:
            self.limiter = AsyncLimiter.from_url(url, key_prefix=prefix, clock=clock, **options)
            self.replies = AsyncReplies(self.limiter.storage)
        self.limiter.storage = self.replies

    def _do(self, result: Any) -> Any:
        return result if self.loop is None else self.loop.run_until_complete(result)

    def hit(self, policy: Policy, identity: Identity, cost: int) -> Decision:
        return self._do(self.limiter.hit(policy, identity, cost))  # type: ignore[no-any-return]

    def peek(self, policy: Policy, identity: Identity, cost: int) -> Decision:
        return self._do(self.limiter.peek(policy, identity, cost))  # type: ignore[no-any-return]

    def reset(self, policy: Policy, identity: Identity) -> None:
        self._do(self.limiter.reset(policy, identity))

    def acquire(self, policy: Policy, identity: Identity, cost: int) -> Any:
        acquiring = self.limiter.acquire(policy, identity, cost)
        if self.loop is None:
            return acquiring

        async def take() -> Any:
            return await acquiring

        return self.loop.run_until_complete(take())

    def release(self, lease: Any) -> bool:
        return bool(self._do(lease.release()))

    def close(self) -> None:
        self._do(self.limiter.close())


@dataclass
class Granted:
    """A lease that was granted, as the test saw it (not the model)."""

    key: tuple[str, bytes]
    expires: int
    cost: int
    released: bool = False  # by the test, through the Lease
    cleared: bool = False  # by a reset of its identity


class AlgorithmRun:
    """Replays one scenario on a memory and a server limiter and checks every step against
    each other, the model and the invariants."""

    def __init__(self, scenario: AlgorithmScenario, algorithm: str) -> None:
        self.scenario = scenario
        self.now = int(START * 1_000_000)
        self.clock = ExactClock(self.now)
        self.model = MODELS[algorithm]()
        self.last_retry: int | None = None
        self.admitted: dict[tuple[str, bytes], list[tuple[int, int]]] = defaultdict(list)
        self.leases: list[tuple[Any, Any, ModelLease, Granted | None]] = []
        self.granted: list[Granted] = []

    def move(self, op: AlgorithmOp) -> bool:
        """Apply ``op`` if it moves the clock; whether it did."""
        if isinstance(op, Advance):
            self.now += op.us
        elif isinstance(op, Boundary):
            self.now = max(self.now, (self.now // op.period_us + 1) * op.period_us + op.nudge_us)
        elif isinstance(op, WaitRetry):
            if self.last_retry is not None:
                self.now += max(self.last_retry + op.nudge_us, 0)
        else:
            return False
        self.clock.set_us(self.now)
        return True

    def held_units(self, key: tuple[str, bytes]) -> int:
        return sum(
            g.cost
            for g in self.granted
            if g.key == key and not (g.released or g.cleared) and g.expires > self.now
        )

    def play(self, memory: Side, remote: Side) -> None:
        for step, op in enumerate(self.scenario.ops):
            where = f"step {step}: {op}"
            if self.move(op):
                continue
            if isinstance(op, Release):
                self.release(op, memory, remote, where)
            elif isinstance(op, Reset):
                self.reset(op, memory, remote)
            else:
                self.call(op, memory, remote, where)

    def reset(self, op: Reset, memory: Side, remote: Side) -> None:
        policy = self.scenario.policies[op.policy]
        identity = self.scenario.identities[op.identity]
        memory.reset(policy, identity)
        remote.reset(policy, identity)
        self.model.reset(policy, identity)
        key = state_key(policy, identity)
        self.admitted.pop(key, None)
        for granted in self.granted:
            if granted.key == key:
                granted.cleared = True

    def call(self, op: Hit | Peek | Acquire, memory: Side, remote: Side, where: str) -> None:
        policy = self.scenario.policies[op.policy]
        identity = self.scenario.identities[op.identity]
        key = state_key(policy, identity)
        if isinstance(op, Acquire):
            assert isinstance(self.model, ConcurrencyModel)
            on_memory_lease = memory.acquire(policy, identity, op.cost)
            on_server_lease = remote.acquire(policy, identity, op.cost)
            on_memory, on_server = on_memory_lease.decision, on_server_lease.decision
            expected, model_lease = self.model.acquire(
                policy, identity, op.cost, self.now, peek=False
            )
            for side_lease in (on_memory_lease, on_server_lease):
                assert side_lease.allowed == side_lease.decision.allowed, where
                assert side_lease.held == side_lease.allowed, where
        else:
            method = "hit" if isinstance(op, Hit) else "peek"
            on_memory = getattr(memory, method)(policy, identity, op.cost)
            on_server = getattr(remote, method)(policy, identity, op.cost)
            expected = self.model.decide(
                policy, identity, op.cost, self.now, peek=isinstance(op, Peek)
            )
        assert remote.replies.replies[-1] == memory.replies.replies[-1], where
        assert on_server == on_memory, where
        assert on_memory == expected, where
        check_decision(on_memory, policy, op.cost)
        if not on_memory.allowed and on_memory.retry_after != math.inf:
            assert on_memory.retry_after is not None
            self.last_retry = round(on_memory.retry_after * 1_000_000)
        if on_memory.allowed and isinstance(op, Hit):
            self.admitted[key].append((self.now, op.cost))
            check_history(policy, self.admitted[key])
        if isinstance(op, Acquire):
            granted = None
            if on_memory.allowed:
                (rate,) = policy.rates
                granted = Granted(key, self.now + rate.period_us, op.cost)
                self.granted.append(granted)
            self.leases.append((on_memory_lease, on_server_lease, model_lease, granted))
            # Never more units held than the limit, whatever was released or expired.
            assert self.held_units(key) <= policy.rates[0].limit, where

    def release(self, op: Release, memory: Side, remote: Side, where: str) -> None:
        if not self.leases:
            return
        index = op.lease % len(self.leases)
        on_memory_lease, on_server_lease, model_lease, granted = self.leases[index]
        assert isinstance(self.model, ConcurrencyModel)
        before = len(memory.replies.replies), len(remote.replies.replies)
        on_memory = memory.release(on_memory_lease)
        on_server = remote.release(on_server_lease)
        # A lease never granted, or released already, answers without asking the store.
        calls = len(memory.replies.replies) - before[0], len(remote.replies.replies) - before[1]
        asks = granted is not None and not granted.released
        assert calls[0] == calls[1] == (1 if asks else 0), where
        if calls[0]:
            assert remote.replies.replies[-1] == memory.replies.replies[-1], where
        assert on_server is on_memory, where
        assert on_memory is self.model.release(model_lease, self.now), where
        assert not on_memory_lease.held, where
        assert not on_server_lease.held, where
        if granted is not None:
            granted.released = True


ALGORITHM_SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    # No "explain" phase: it replays the failing example many times over, against a server.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)


def play(scenario: AlgorithmScenario, algorithm: str, url: str, *, loop: Any = None) -> None:
    run = AlgorithmRun(scenario, algorithm)
    prefix = fresh_prefix()
    memory = Side("memory://", prefix, run.clock, loop)
    try:
        remote = Side(url, prefix, run.clock, loop)
        try:
            run.play(memory, remote)
        finally:
            remote.close()
    finally:
        memory.close()


def algorithm_of(case: str) -> str:
    return {"gcra_burst": "gcra", "sliding_log_long": "sliding_log"}.get(case, case)


@SHRINK_TIMEOUT
@pytest.mark.parametrize("case", [*LOG_CASES, *ALGORITHM_CASES])
@ALGORITHM_SETTINGS
@given(data=st.data())
def test_every_algorithm_memory_server_and_model_agree(
    server: RedisServer, case: str, data: st.DataObject
) -> None:
    """For each algorithm and server flavor: the reference and the script return the same
    replies and decisions at every step, the model agrees, and the invariants hold. The ops
    include sub-millisecond steps, window starts and the exact instant a denial named."""
    scenario = data.draw(algorithm_scenarios(case), label="scenario")
    play(scenario, algorithm_of(case), server.url)


@SHRINK_TIMEOUT
@pytest.mark.parametrize("case", ALGORITHM_CASES)
@settings(ALGORITHM_SETTINGS, max_examples=12)
@given(data=st.data())
def test_every_algorithm_agrees_through_the_async_api(
    servers: dict[str, RedisServer], case: str, data: st.DataObject
) -> None:
    """The same through AsyncLimiter (its lease is awaited and released as a coroutine)."""
    server = servers.get("valkey") or next(iter(servers.values()))
    scenario = data.draw(algorithm_scenarios(case, max_ops=25), label="scenario")
    loop = asyncio.new_event_loop()
    try:
        play(scenario, algorithm_of(case), server.url, loop=loop)
    finally:
        loop.close()


@SHRINK_TIMEOUT
@pytest.mark.parametrize("case", BOUNDARY_CASES)
@settings(ALGORITHM_SETTINGS, max_examples=100)
@given(data=st.data())
def test_validation_bounds_are_exact(server: RedisServer, case: str, data: st.DataObject) -> None:
    """Limits, bursts and costs at the bounds each policy check allows (sliding_window
    limit x period_ms <= 2**52, gcra burst x period_ms <= 2**52, counter limits up to 2**52): the
    script's arithmetic in Lua doubles must still be exact, as the reference's is."""
    scenario = data.draw(boundary_scenarios(case), label="scenario")
    play(scenario, algorithm_of(case), server.url)


# == a clock that goes back ==================================================================

#: A TTL margin so long that no key expires during an example on either side. The memory
#: keyspace expires keys on the scenario's clock and a server on its own, and with a clock that
#: moves back and forth the two would disagree about expiry, which is not what is tested here.
LONG_MARGIN_MS = 10**9


def moved(now: int, op: AlgorithmOp, back: bool, last_retry: int) -> int | None:
    """The clock after ``op`` when ``op`` moves it, backwards if ``back``; else None."""
    sign = -1 if back else 1
    if isinstance(op, Advance):
        return now + sign * op.us
    if isinstance(op, Boundary):
        return (now // op.period_us + sign) * op.period_us + op.nudge_us
    if isinstance(op, WaitRetry):
        return now + sign * max(last_retry + op.nudge_us, 0)
    return None


class Direct:
    """One policy's script on a server and its reference on a keyspace, called with the ARGV
    the core builds (and a margin that outlives any example)."""

    def __init__(self, server: RedisServer, policy: Policy) -> None:
        self.algorithm = get_algorithm(policy.algorithm)
        self.script = load_script(self.algorithm.script)
        self.rates = [(rate.limit, rate.period_us) for rate in policy.rates]
        self.extra = self.algorithm.extra_args(policy)
        self.keyspace = Keyspace()
        self.client = server.client()
        self.client.script_load(self.script.source)

    def agree(self, key: str, now: int, cost: int, mode: int, token: str, where: str) -> Reply:
        """Make one call on both sides: they must reply alike and then hold the same state.
        Returns the reply."""
        args = encode_args(
            now,
            cost=cost,
            mode=mode,
            token=token,
            margin_ms=LONG_MARGIN_MS,
            rates=self.rates,
            extra=self.extra,
        )
        got = [int(value) for value in self.client.evalsha(self.script.sha, 1, key, *args)]
        want = self.algorithm.reference(self.keyspace, (key,), decode_args(args, now))
        assert got == want, where
        on_server, in_reference = self.states(key, now)
        assert on_server == in_reference, where
        return got

    def states(self, key: str, now: int) -> tuple[Any, Any]:
        """What the server and the reference hold under ``key``, in one form: a hash as a dict
        of integers, leases as (expiry, member) pairs in order, a log as its times in order;
        None for no key."""
        value = self.keyspace.get(key, now)
        if isinstance(value, _Leases):
            value = sorted((score, member) for member, score in value.scores.items())
        kind = self.client.type(key)
        on_server: Any = None
        if kind == b"hash":
            on_server = {k.decode(): int(v) for k, v in self.client.hgetall(key).items()}
        elif kind == b"zset":
            pairs = self.client.zrange(key, 0, -1, withscores=True)
            on_server = [(int(score), member.decode()) for member, score in pairs]
        elif kind == b"list":  # a log: its times, oldest first
            on_server = [int(t) for t in self.client.lrange(key, 0, -1)]
        return on_server, value

    def delete(self, key: str) -> None:
        self.keyspace.delete([key])
        self.client.delete(key)


@SHRINK_TIMEOUT
@pytest.mark.parametrize("case", [*LOG_CASES, *ALGORITHM_CASES])
@settings(ALGORITHM_SETTINGS, max_examples=60)
@given(data=st.data())
def test_scripts_equal_the_references_when_the_clock_goes_back(
    server: RedisServer, case: str, data: st.DataObject
) -> None:
    """Clients whose clocks disagree send times out of order, and a script must still return
    what its reference returns. A scenario's clock moves are replayed with some of them turned
    backwards, and each call goes to the script and to the reference directly: the raw replies
    must be equal at every step, and so must the state stored (a difference there, such as an
    entry pruned on one side only, may show in a reply only much later). The models assume a
    clock that only moves forward, so they are not consulted."""
    scenario = data.draw(algorithm_scenarios(case, max_policies=1), label="scenario")
    backwards = data.draw(
        st.lists(st.booleans(), min_size=len(scenario.ops), max_size=len(scenario.ops)),
        label="backwards",
    )
    direct = Direct(server, scenario.policies[0])
    prefix = fresh_prefix()
    now = int(START * 1_000_000)
    tokens = itertools.count()
    leases: list[tuple[str, str, int]] = []  # (key, token, cost) of each lease granted
    last_retry = 0
    try:
        for step, (op, back) in enumerate(zip(scenario.ops, backwards, strict=True)):
            where = f"step {step}: {op}{' backwards' if back else ''} at {now}"
            after = moved(now, op, back, last_retry)
            if after is not None:
                now = after
            elif isinstance(op, Reset):
                direct.delete(f"{prefix}:{op.identity}")
            elif isinstance(op, Release):
                if leases:
                    key, token, cost = leases[op.lease % len(leases)]
                    direct.agree(key, now, cost, RELEASE, token, where)
            else:
                assert isinstance(op, (Hit, Peek, Acquire))
                key, token = f"{prefix}:{op.identity}", f"t{next(tokens):x}"
                mode = PEEK if isinstance(op, Peek) else HIT
                reply = direct.agree(key, now, op.cost, mode, token, where)
                if isinstance(op, Acquire) and reply[0] == 1:
                    leases.append((key, token, op.cost))
                waits = [retry for retry in reply[3::3] if retry >= 0]
                if not reply[0] and waits:
                    last_retry = max(waits)
    finally:
        direct.client.close()


# == reservations: refunds and charges, the clock both ways ==================================

#: The cases whose policies take reservations (all but concurrency).
RESERVATION_CASES = (*LOG_CASES, *(case for case in ALGORITHM_CASES if case != "concurrency"))
#: What a step of the reservations' property does, weighted.
RESERVATION_OPS = ["reserve"] * 3 + ["settle"] * 3 + ["hit"] * 2 + ["charge", "peek"] + ["time"] * 3


@dataclass
class Counted:
    """One call that counted units on a key: a hit, a reservation (less what was refunded of
    it) or a charge, at its clock's time in us; ``admitted`` for a hit or a reservation (a
    charge is counted whatever the limit)."""

    at: int
    units: int
    admitted: bool


def check_counted(policy: Policy, events: list[Counted]) -> None:
    """The admission that ends ``events`` kept the limit, with everything counted before it
    (charges included, refunds taken off): the units in its window of each rate (the log: the
    last ``period``; the window counters: its aligned window) are at most the limit, and for
    gcra the units between any earlier admission and it at most the burst plus what the rate
    refills meanwhile (as ``check_history``)."""
    last = events[-1]
    for index, rate in enumerate(policy.rates):
        window = rate.period_us
        if policy.algorithm == "sliding_log":
            inside = sum(e.units for e in events if last.at - window < e.at <= last.at)
            assert inside <= rate.limit, (rate, events)
        elif policy.algorithm in ("fixed_window", "sliding_window"):
            start = last.at - last.at % window
            inside = sum(e.units for e in events if start <= e.at < start + window)
            assert inside <= rate.limit, (rate, events)
        else:
            burst = burst_of(policy, index)
            total = 0
            for first in reversed(events):
                total += first.units
                if first.admitted:
                    elapsed_ms = last.at // 1000 - first.at // 1000
                    bound = burst + elapsed_ms * rate.limit // rate.period_ms
                    assert total <= bound, (rate, burst, events)


Held = tuple[str, int, int, "Counted | None"]


def settle_one(
    direct: Direct,
    data: st.DataObject,
    held: list[Held],
    counted: dict[str, list[Counted]],
    now: int,
    where: str,
) -> None:
    """Settle or cancel one of the reservations ``held``: a charge of the overrun, counted
    now, or a refund of the rest, taken off the reservation's entry."""
    key, estimate, stamp, event = held.pop(data.draw(st.integers(0, len(held) - 1)))
    actual = data.draw(st.one_of(st.just(0), st.integers(0, 2 * estimate)))  # 0: a cancel
    if actual > estimate:
        direct.agree(key, now, actual - estimate, CHARGE, "", where)
        counted[key].append(Counted(now, actual - estimate, admitted=False))
    else:
        direct.agree(key, now, estimate - actual, REFUND, str(stamp), where)
        if event is not None:
            event.units = actual


@SHRINK_TIMEOUT
@pytest.mark.parametrize("case", RESERVATION_CASES)
@settings(ALGORITHM_SETTINGS, max_examples=100)
@given(data=st.data())
def test_reservations_keep_the_limit_and_the_scripts_equal_the_references(
    server: RedisServer, case: str, data: st.DataObject
) -> None:
    """Reserves, settles (refunds and charges), cancels, hits and peeks on two keys, with the
    clock moving forward and, as when instances' clocks disagree, back: the script and its
    reference reply alike and hold the same state at every step, and no admission ever takes
    a window past the limit (a refund takes back only what still counts).

    The limit is checked on the calls since the clock last moved back: the instances whose
    clocks agree (a stretch of one clock), whatever the others counted before, whose
    reservations may still be refunded in it. Across a move back no window is defined
    that every algorithm keeps (an aligned window forgotten for a later one counts again)."""
    policy = data.draw(algorithm_policies(case), label="policy")
    top = capacity(policy)
    periods = [rate.period_us for rate in policy.rates]
    direct = Direct(server, policy)
    prefix = fresh_prefix()
    now = int(START * 1_000_000)
    tokens = itertools.count()
    # Per key, what the current stretch counted; the reservations held: key, cost, stamp and
    # their entry in the stretch that made them (None once the clock moved back since).
    counted: dict[str, list[Counted]] = defaultdict(list)
    held: list[Held] = []
    try:
        for step in range(data.draw(st.integers(1, 40), label="steps")):
            kind = data.draw(st.sampled_from(RESERVATION_OPS))
            where = f"step {step}: {kind} at {now}"
            key = f"{prefix}:{data.draw(st.sampled_from([0, 0, 0, 1]))}"
            if kind == "time":
                how = data.draw(st.sampled_from(["advance", "advance", "boundary"]))
                back = data.draw(st.integers(0, 4)) == 0
                after = moved(now, draw_time_op(data.draw, how, periods), back, 0)
                if after is not None and after < now:
                    counted.clear()  # another instance's clock: a new stretch
                    held = [(k, c, stamp, None) for k, c, stamp, _ in held]
                now = after if after is not None else now
            elif kind in ("reserve", "hit"):
                cost = data.draw(st.integers(1, top + 1))
                mode = RESERVE if kind == "reserve" else HIT
                reply = direct.agree(key, now, cost, mode, f"t{next(tokens):x}", where)
                if reply[0] == 1:
                    event = Counted(now, cost, admitted=True)
                    counted[key].append(event)
                    check_counted(policy, counted[key])
                    if kind == "reserve":
                        held.append((key, cost, reply[-1], event))
            elif kind == "charge":  # limiter.charge: no reservation
                cost = data.draw(st.integers(0, 3 * top))
                direct.agree(key, now, cost, CHARGE, "", where)
                counted[key].append(Counted(now, cost, admitted=False))
            elif kind == "settle" and held:
                settle_one(direct, data, held, counted, now, where)
            else:
                direct.agree(key, now, data.draw(st.integers(1, top)), PEEK, "", where)
    finally:
        direct.client.close()


# == the deny cache ==========================================================================


@SHRINK_TIMEOUT
@pytest.mark.parametrize(
    "case", [*LOG_CASES, *(case for case in ALGORITHM_CASES if case != "concurrency")]
)
@settings(ALGORITHM_SETTINGS, max_examples=100)
@given(data=st.data())
def test_deny_cache_never_changes_a_decision(case: str, data: st.DataObject) -> None:
    """A limiter with its deny cache (the default) decides exactly as one without: a cached
    denial is labelled ``reason='deny_cache'`` and is otherwise the store's decision, with the
    same exact retry_after (math.inf for a cost no rate can ever admit)."""
    scenario = data.draw(algorithm_scenarios(case, max_policies=1), label="scenario")
    run = AlgorithmRun(scenario, algorithm_of(case))
    options = {"clock": run.clock, "failure_mode": "raise"}
    with (
        Limiter.from_url("memory://", **options) as cached,
        Limiter.from_url("memory://", deny_cache=0, **options) as exact,
    ):
        for step, op in enumerate(scenario.ops):
            if run.move(op):
                continue
            assert isinstance(op, (Hit, Peek, Reset))
            policy = scenario.policies[op.policy]
            identity = scenario.identities[op.identity]
            if isinstance(op, Reset):
                cached.reset(policy, identity)
                exact.reset(policy, identity)
                continue
            method = "hit" if isinstance(op, Hit) else "peek"
            got = getattr(cached, method)(policy, identity, op.cost)
            want = getattr(exact, method)(policy, identity, op.cost)
            assert got.reason in (None, "deny_cache"), f"step {step}: {op}"
            assert replace(got, reason=None) == want, f"step {step}: {op}"
            if not want.allowed and want.retry_after != math.inf:
                assert want.retry_after is not None
                run.last_retry = round(want.retry_after * 1_000_000)
