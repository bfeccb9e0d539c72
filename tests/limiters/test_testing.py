"""``ratekeeper.testing``: the helpers users test their code with (the suite uses them too)."""

from __future__ import annotations

import asyncio
import doctest

import pytest

import ratekeeper.testing
from ratekeeper import AsyncLimiter, Limiter, Policy, StorageResponseError
from ratekeeper.testing import (
    AsyncFlakyStorage,
    FlakyStorage,
    ManualClock,
    RecordingMetrics,
    decision,
)


def test_the_module_example_runs() -> None:
    assert doctest.testmod(ratekeeper.testing, raise_on_error=True).attempted > 0


def test_a_flaky_store_fails_as_told_and_the_failure_mode_decides() -> None:
    store = FlakyStorage(fail_with=StorageResponseError("LOADING"))
    metrics = RecordingMetrics()
    policy = Policy("api", "1/minute")
    with Limiter(store, clock=store.clock, metrics=metrics) as limiter:
        assert limiter.hit(policy, "a").allowed
        store.down = True
        assert limiter.hit(policy, "a").reason == "store_error/open"
        store.down = False
        store.clock.advance(60)
        assert limiter.hit(policy, "a").reason is None
    assert store.calls == 3
    assert metrics.reasons == [None, "store_error/open", None]
    assert [ok for _, ok in metrics.store_calls] == [True, True, True]  # the store answered


def test_the_async_flaky_store() -> None:
    store = AsyncFlakyStorage(clock=ManualClock())
    policy = Policy("api", "5/minute")

    async def main() -> list[str | None]:
        async with AsyncLimiter(store, clock=store.clock, failure_mode="closed") as limiter:
            first = await limiter.hit(policy, "a")
            store.sync.down = True
            second = await limiter.hit(policy, "a")
            return [first.reason, second.reason]

    assert asyncio.run(main()) == [None, "unavailable/closed"]
    assert store.sync.calls == 2


@pytest.mark.parametrize("allowed", [True, False])
def test_a_decision_for_a_handler_under_test(allowed: bool) -> None:
    made = decision(allowed, rate="10/minute", policy="api")
    assert (made.allowed, made.limit, made.policy) == (allowed, 10, "api")
    assert made.remaining == (9 if allowed else 0)
    assert made.retry_after == (None if allowed else 60.0)


def test_a_decision_from_a_policy_and_its_rate() -> None:
    policy = Policy("search", "5/second;100/hour")
    made = decision(False, rate=policy.rates[1], policy=policy)
    assert (made.policy, made.rate, made.limit) == ("search", policy.rates[1], 100)
    assert made.retry_after == 3600.0
