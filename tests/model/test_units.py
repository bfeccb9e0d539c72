"""Week, month and year rates end to end: every algorithm, every backend, both APIs.

A ``ManualClock`` passed as ``clock=`` moves by whole days, so a week passes in no time and every
backend sees the same instants. The clock starts on an epoch-aligned week, where fixed windows
start, so one trace fits every store.
"""

from __future__ import annotations

import pytest

from ratekeeper import ConfigError, ManualClock, Policy, Rate

from ..conftest import MakeLimiter
from ..limiters.test_leases import Leases
from ..support import workers

DAY = 86_400.0
WEEK = 7 * DAY
YEAR = 365 * DAY
#: A Thursday 00:00 UTC: a multiple of the week, so fixed windows start here.
START = (1_700_000_000 // int(WEEK) + 1) * WEEK

#: Hits admitted on each of 15 days under "2/week" (hitting until the first denial each day),
#: and the retry_after of that denial, in days.
TRACES: dict[str, tuple[list[int], list[float]]] = {
    # Each unit frees itself exactly a week after it was taken.
    "sliding_log": ([2, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 2], [7, 6, 5, 4, 3, 2, 1] * 2 + [7]),
    # Each aligned week starts afresh.
    "fixed_window": (
        [2, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 2],
        [7, 6, 5, 4, 3, 2, 1] * 2 + [7],
    ),
    # The first week's count weighs on the second in proportion to their overlap.
    "sliding_window": (
        [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1],
        [10.5, 9.5, 8.5, 7.5, 6.5, 5.5, 4.5, 3.5, 2.5, 1.5, 0.5, 3.0, 2.0, 1.0, 7.0],
    ),
    # One unit every 3.5 days, with a burst of 2.
    "gcra": (
        [2, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1],
        [3.5, 2.5, 1.5, 0.5, 3.0, 2.0, 1.0, 3.5, 2.5, 1.5, 0.5, 3.0, 2.0, 1.0, 3.5],
    ),
}
TRACES["token_bucket"] = TRACES["gcra"]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START)


@pytest.mark.parametrize("algorithm", sorted(TRACES))
def test_two_per_week_day_by_day(
    make_limiter: MakeLimiter, backend: str, key_prefix: str, clock: ManualClock, algorithm: str
) -> None:
    options = workers.exact_options(key_prefix, server=backend != "memory://")
    limiter = make_limiter(clock=clock, **options)
    policy = Policy("weekly", "2/week", algorithm)
    admitted, retries = [], []
    for _ in range(15):
        count = 0
        while (decision := limiter.hit(policy, "user-7")).allowed:
            count += 1
            assert count <= 2
        admitted.append(count)
        assert decision.retry_after is not None
        retries.append(decision.retry_after / DAY)
        assert decision.limit == 2
        assert decision.rate is not None
        assert decision.rate.period == WEEK
        clock.advance(DAY)
    assert (admitted, retries) == TRACES[algorithm]


def test_two_leases_per_week(
    make_limiter: MakeLimiter, backend: str, api: str, key_prefix: str, clock: ManualClock
) -> None:
    """A concurrency policy's period is the lease timeout: unreleased leases free themselves
    after exactly a week."""
    options = workers.exact_options(key_prefix, server=backend != "memory://")
    leases = Leases(make_limiter(clock=clock, **options), api, backend, clock)
    try:
        policy = Policy("weekly-jobs", "2/week", "concurrency")
        assert [leases.acquire(policy, "job").allowed for _ in range(3)] == [True, True, False]
        clock.advance(WEEK - DAY)
        assert not leases.acquire(policy, "job").allowed
        clock.advance(DAY)
        assert [leases.acquire(policy, "job").allowed for _ in range(3)] == [True, True, False]
    finally:
        leases.close()


def test_a_year_a_month_and_a_week_together(
    make_limiter: MakeLimiter, backend: str, key_prefix: str, clock: ManualClock
) -> None:
    """Three rates joined with ``|``, all-or-nothing; each denial names the rate that denies."""
    options = workers.exact_options(key_prefix, server=backend != "memory://")
    limiter = make_limiter(clock=clock, **options)
    policy = Policy("yearly", "3/year|2/month|1/week", "sliding_log")

    def step(day: float, allowed: bool, period: float, retry_days: float | None) -> None:
        clock.set(START + day * DAY)
        decision = limiter.hit(policy, "u")
        assert decision.allowed is allowed
        assert decision.rate is not None
        assert decision.rate.period == period
        if retry_days is None:
            assert decision.retry_after is None
        else:
            assert decision.retry_after == retry_days * DAY

    step(0, True, WEEK, None)  # 0 left this week
    step(0, False, WEEK, 7)
    step(7, True, 30 * DAY, None)  # 0 left this month
    step(14, False, 30 * DAY, 16)
    step(30, True, YEAR, None)  # the year's 3 are spent
    step(44, False, YEAR, 321)
    step(364, False, YEAR, 1)
    step(365, True, YEAR, None)  # 0 left this year, and this week


# -- what each algorithm's arithmetic holds for a year -------------------------------------------

#: The largest limit per year each O(1) algorithm takes: limit x 31,536,000,000 ms must stay below
#: 2**53 (sliding_window) or 2**52 (gcra's burst x period).
YEAR_LIMITS = {"sliding_window": 142_808, "gcra": 142_808, "token_bucket": 142_808}


@pytest.mark.parametrize(
    "algorithm",
    ["sliding_log", "sliding_window", "fixed_window", "gcra", "token_bucket", "concurrency"],
)
def test_every_algorithm_takes_a_year(algorithm: str) -> None:
    assert Policy("p", "1000/year", algorithm).rates[0].period == YEAR


@pytest.mark.parametrize(("algorithm", "limit"), sorted(YEAR_LIMITS.items()))
def test_the_largest_yearly_limit_and_a_clear_error_above_it(algorithm: str, limit: int) -> None:
    assert Policy("p", f"{limit}/year", algorithm).rates == (Rate(limit, YEAR),)
    with pytest.raises(ConfigError, match="exact arithmetic") as info:
        Policy("p", f"{limit + 1}/year", algorithm)
    assert f"{limit + 1}/year" in str(info.value)


def test_fixed_window_takes_the_largest_limit_for_71_years() -> None:
    """2**52, its largest limit, over the longest period a rate may have (71 years: a
    window's end in epoch microseconds stays exact); one more unit, or one more year, is
    refused."""
    assert Policy("p", f"{2**52} per 71 years", "fixed_window").rates == (Rate(2**52, 71 * YEAR),)
    with pytest.raises(ConfigError, match="exact arithmetic"):
        Policy("p", f"{2**52 + 1} per 71 years", "fixed_window")
    with pytest.raises(ConfigError, match="over 71 years"):
        Policy("p", f"{2**52} per 72 years", "fixed_window")
