"""Property: the memory backend (the Python reference) and the Lua script on a real server make
identical decisions for any sequence of hits, peeks, resets and clock moves.

Both limiters get the same ``ManualClock`` through ``clock=``, so both see the same instants. A
naive model written from the documented semantics (count the admitted units whose time is in
``(now - window, now]``) is a third opinion, so a bug shared by the two mirrored
implementations cannot hide.

Limiters are built inside the test body: Hypothesis runs many examples per fixture instance,
and each example needs fresh state (a fresh key prefix, a fresh memory store).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings

from ratekeeper import AsyncLimiter, Decision, Limiter, ManualClock, Policy
from ratekeeper._keys import Identity, identity_bytes

from .servers import RedisServer
from .strategies import START, Advance, Hit, Peek, Reset, Scenario, scenarios

_prefixes = itertools.count()


def fresh_prefix() -> str:
    return f"prop{next(_prefixes)}"


class Model:
    """Sliding-window log semantics as documented, with no shortcuts: one time per unit."""

    def __init__(self) -> None:
        self.logs: dict[tuple[str, bytes], list[int]] = defaultdict(list)

    def reset(self, policy: Policy, identity: Identity) -> None:
        self.logs.pop((policy.name, identity_bytes(identity)), None)

    def decide(
        self, policy: Policy, identity: Identity, cost: int, now: int, *, peek: bool
    ) -> Decision:
        log = self.logs[(policy.name, identity_bytes(identity))]
        windows = [sorted(t for t in log if t > now - rate.period_us) for rate in policy.rates]
        allowed = all(
            len(inside) + cost <= rate.limit
            for rate, inside in zip(policy.rates, windows, strict=True)
        )
        consume = allowed and not peek
        rows = []
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
        if allowed:
            # The rate with the fewest units left; ties: the longest reset, then the first.
            best = max(rows, key=lambda r: (-r[1], r[2]))
        else:
            # The denying rate with the longest wait; ties: the longest reset, then the first.
            best = max((r for r in rows if r[3] is not None), key=lambda r: (r[3], r[2]))
        rate, remaining, reset, retry = best
        return Decision(
            allowed=allowed,
            limit=rate.limit,
            remaining=remaining,
            reset_after=reset / 1_000_000,
            retry_after=None if retry is None else retry / 1_000_000,
            policy=policy.name,
            rate=rate,
        )


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
        Limiter.from_url("memory://", key_prefix=prefix, clock=run.clock) as memory,
        Limiter.from_url(server.url, key_prefix=prefix, clock=run.clock) as remote,
    ):
        run_sync(scenario, memory, remote, run)


async def run_async(scenario: Scenario, url: str, run: Run) -> None:
    prefix = fresh_prefix()
    async with (
        AsyncLimiter.from_url("memory://", key_prefix=prefix, clock=run.clock) as memory,
        AsyncLimiter.from_url(url, key_prefix=prefix, clock=run.clock) as remote,
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
    with Limiter.from_url("memory://", key_prefix=fresh_prefix(), clock=run.clock) as memory:
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
