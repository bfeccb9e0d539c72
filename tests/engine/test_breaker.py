"""Unit tests of the circuit breaker, on a fake clock: no I/O, no sleeping.

The breaker's clock is injected, so every test moves time by hand and checks the exact state,
``retry_after`` and ``open_for`` at each step.
"""

from __future__ import annotations

import itertools
import random
import threading
from typing import Any

import pytest

import ratekeeper
from ratekeeper import ConfigError, Limiter
from ratekeeper._engine.breaker import BreakerState, CircuitBreaker
from ratekeeper.testing import ManualClock

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

FAST = 0.001  # a call well under slow_call
SLOW = 0.5  # a call well over slow_call


def make(clock: ManualClock, **options: Any) -> CircuitBreaker:
    """A breaker where only the trigger under test can fire, unless a test says otherwise."""
    settings: dict[str, Any] = {
        "window": 10.0,
        "min_calls": 1_000,
        "failure_ratio": 0.5,
        "slow_call": 0.020,
        "slow_ratio": 0.8,
        "consecutive_failures": 1_000,
        "open_for": 1.0,
        "max_open_for": 8.0,
        "probes": 2,
        "clock": clock,
    }
    settings.update(options)
    return CircuitBreaker(**settings)


def trip(breaker: CircuitBreaker) -> None:
    """Open a closed breaker with failures in a row."""
    assert breaker.state is CLOSED
    for _ in range(breaker.consecutive_failures):
        assert breaker.allow()
        breaker.record(False, FAST)
    assert breaker.state is OPEN


def probe(breaker: CircuitBreaker, ok: bool = True, latency: float = FAST) -> None:
    assert breaker.state is HALF_OPEN
    assert breaker.allow()
    breaker.record(ok, latency)


def close_by_probes(breaker: CircuitBreaker, clock: ManualClock) -> None:
    clock.advance(breaker.retry_after())
    for _ in range(breaker.probes):
        probe(breaker)
    assert breaker.state is CLOSED


# --- opening -------------------------------------------------------------------------------------


def test_starts_closed_and_allows_every_call():
    clock = ManualClock(1_000.0)
    breaker = make(clock)
    assert breaker.state is CLOSED
    assert all(breaker.allow() for _ in range(100))
    assert breaker.retry_after() == 0.0
    assert breaker.open_for == 1.0


def test_opens_after_consecutive_failures():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=3)
    for _ in range(2):
        breaker.record(False, FAST)
    assert breaker.state is CLOSED
    breaker.record(True, FAST)  # a success breaks the streak
    for _ in range(2):
        breaker.record(False, FAST)
    assert breaker.state is CLOSED
    breaker.record(False, FAST)
    assert breaker.state is OPEN
    assert breaker.retry_after() == 1.0


def test_failure_ratio_waits_for_min_calls():
    clock = ManualClock(1_000.0)
    breaker = make(clock, min_calls=10, failure_ratio=0.5)
    # 5 failures in 9 calls: over the ratio, but fewer calls than min_calls.
    for i in range(9):
        breaker.record(i % 2 == 1, FAST)
    assert breaker.state is CLOSED
    breaker.record(True, FAST)  # the 10th call: 5 failures of 10 reach the ratio
    assert breaker.state is OPEN


def test_failure_ratio_below_threshold_stays_closed():
    clock = ManualClock(1_000.0)
    breaker = make(clock, min_calls=10, failure_ratio=0.5)
    outcomes = [False, True, True] * 10  # a third fail
    for ok in outcomes:
        breaker.record(ok, FAST)
    assert breaker.state is CLOSED


def test_opens_on_slow_calls_alone():
    clock = ManualClock(1_000.0)
    breaker = make(clock, min_calls=5, slow_call=0.020, slow_ratio=0.8)
    for _ in range(4):
        breaker.record(True, 0.050)
    assert breaker.state is CLOSED  # every call succeeded, and too few yet
    breaker.record(True, 0.050)
    assert breaker.state is OPEN


def test_a_call_exactly_at_slow_call_is_not_slow():
    clock = ManualClock(1_000.0)
    breaker = make(clock, min_calls=5, slow_call=0.020, slow_ratio=0.8)
    for _ in range(50):
        breaker.record(True, 0.020)
    assert breaker.state is CLOSED


def test_slow_ratio_below_threshold_stays_closed():
    clock = ManualClock(1_000.0)
    breaker = make(clock, min_calls=5, slow_ratio=0.8)
    for i in range(50):
        breaker.record(True, SLOW if i % 2 else FAST)  # half slow < 80%
    assert breaker.state is CLOSED


def test_outcomes_older_than_the_window_are_forgotten():
    clock = ManualClock(1_000.0)
    breaker = make(clock, window=10.0, min_calls=4, failure_ratio=0.5)
    for _ in range(3):
        breaker.record(False, FAST)
    clock.advance(10.5)  # the three failures leave the window
    breaker.record(False, FAST)
    for _ in range(3):
        breaker.record(True, FAST)
    assert breaker.state is CLOSED  # 1 failure in 4, not 4 in 7


def test_outcomes_inside_the_window_still_count():
    """The contrast to the test above: half a window apart, the same calls do trip it."""
    clock = ManualClock(1_000.0)
    breaker = make(clock, window=10.0, min_calls=4, failure_ratio=0.5)
    for _ in range(3):
        breaker.record(False, FAST)
    clock.advance(5.0)
    breaker.record(False, FAST)  # 4 failures of 4 calls
    assert breaker.state is OPEN


def test_opens_as_soon_as_ratio_reached_inside_window():
    clock = ManualClock(1_000.0)
    breaker = make(clock, window=10.0, min_calls=4, failure_ratio=0.5)
    for _ in range(3):
        breaker.record(False, FAST)
    clock.advance(5.0)
    breaker.record(True, FAST)  # 3 failures of 4 calls, all inside the window
    assert breaker.state is OPEN


# --- open and half-open --------------------------------------------------------------------------


def test_open_allows_no_call_until_open_for_elapsed():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, open_for=1.0)
    trip(breaker)
    assert not any(breaker.allow() for _ in range(100))
    clock.advance(0.25)
    assert breaker.retry_after() == pytest.approx(0.75)
    assert not breaker.allow()
    clock.advance(0.7)
    assert breaker.state is OPEN
    assert not breaker.allow()
    clock.advance(0.05)
    assert breaker.retry_after() == 0.0
    assert breaker.state is HALF_OPEN


def test_a_late_reply_while_open_changes_nothing():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2)
    trip(breaker)
    breaker.record(True, FAST)
    breaker.record(False, FAST)
    assert breaker.state is OPEN
    assert breaker.retry_after() == 1.0


def test_half_open_lets_one_probe_at_a_time():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, probes=3)
    trip(breaker)
    clock.advance(1.0)
    assert breaker.state is HALF_OPEN
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # nobody else while it is in flight
    assert not breaker.allow()
    breaker.record(True, FAST)
    assert breaker.state is HALF_OPEN  # 1 good probe of 3
    assert breaker.allow()
    assert not breaker.allow()
    breaker.record(True, FAST)
    assert breaker.allow()
    breaker.record(True, FAST)
    assert breaker.state is CLOSED
    assert all(breaker.allow() for _ in range(10))


def test_a_probe_that_never_reports_stops_blocking_after_open_for():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, open_for=1.0)
    trip(breaker)
    clock.advance(1.0)
    assert breaker.allow()  # a probe whose caller dies
    clock.advance(0.5)
    assert not breaker.allow()
    clock.advance(0.5)
    assert breaker.allow()  # a new probe after open_for


@pytest.mark.parametrize(("ok", "latency"), [(False, FAST), (True, SLOW)], ids=["failed", "slow"])
def test_a_bad_probe_reopens_with_open_for_doubled_up_to_the_cap(ok: bool, latency: float):
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, open_for=1.0, max_open_for=5.0)
    trip(breaker)
    waits = [breaker.retry_after()]
    for _ in range(5):
        clock.advance(breaker.retry_after())
        probe(breaker, ok, latency)
        assert breaker.state is OPEN
        waits.append(breaker.retry_after())
        assert breaker.open_for == waits[-1]
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_a_bad_probe_after_good_ones_reopens():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, probes=3)
    trip(breaker)
    clock.advance(1.0)
    probe(breaker)
    probe(breaker)
    probe(breaker, ok=False)
    assert breaker.state is OPEN
    assert breaker.retry_after() == 2.0
    clock.advance(2.0)
    # The good probes before the failure do not count any more: 3 new ones are needed.
    probe(breaker)
    probe(breaker)
    assert breaker.state is HALF_OPEN
    probe(breaker)
    assert breaker.state is CLOSED


def test_reopening_soon_after_closing_doubles_open_for():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, window=10.0, open_for=1.0, max_open_for=8.0)
    trip(breaker)
    assert breaker.retry_after() == 1.0
    close_by_probes(breaker, clock)
    clock.advance(3.0)  # within the window of the closing
    trip(breaker)
    assert breaker.retry_after() == 2.0
    close_by_probes(breaker, clock)
    clock.advance(9.9)
    trip(breaker)
    assert breaker.retry_after() == 4.0


def test_staying_closed_for_a_window_forgets_the_back_off():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, window=10.0, open_for=1.0, max_open_for=8.0)
    trip(breaker)
    clock.advance(1.0)
    probe(breaker, ok=False)  # open_for 2
    clock.advance(2.0)
    probe(breaker, ok=False)  # open_for 4
    assert breaker.retry_after() == 4.0
    close_by_probes(breaker, clock)
    clock.advance(10.0)  # a whole window closed
    assert breaker.state is CLOSED
    trip(breaker)
    assert breaker.retry_after() == 1.0


def test_open_for_reports_the_next_opening_after_a_quiet_window():
    """``open_for`` is documented as "how long the next opening lasts". After a window closed
    with no calls at all, the next opening lasts the base ``open_for`` (see the test above), so
    the property must say so without needing another call to refresh it first."""
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, window=10.0, open_for=1.0, max_open_for=8.0)
    trip(breaker)
    clock.advance(1.0)
    probe(breaker, ok=False)
    assert breaker.open_for == 2.0
    close_by_probes(breaker, clock)
    clock.advance(10.0)
    assert breaker.open_for == 1.0


def test_retry_after_counts_down_and_is_zero_unless_open():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, open_for=2.0, max_open_for=8.0)
    assert breaker.retry_after() == 0.0
    trip(breaker)
    for expected in (2.0, 1.5, 1.0, 0.5):
        assert breaker.retry_after() == pytest.approx(expected)
        clock.advance(0.5)
    assert breaker.retry_after() == 0.0
    assert breaker.state is HALF_OPEN
    assert breaker.retry_after() == 0.0


def test_reset_closes_and_forgets_back_off():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2)
    trip(breaker)
    clock.advance(1.0)
    probe(breaker, ok=False)
    assert breaker.open_for == 2.0
    breaker.reset()
    assert breaker.state is CLOSED
    assert breaker.open_for == 1.0
    assert breaker.allow()
    trip(breaker)
    assert breaker.retry_after() == 1.0


# --- listeners -----------------------------------------------------------------------------------


def test_listeners_see_each_transition_once_in_order():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, probes=2)
    seen: list[tuple[BreakerState, BreakerState]] = []
    also: list[tuple[BreakerState, BreakerState]] = []
    breaker.add_listener(lambda old, new: seen.append((old, new)))
    breaker.add_listener(lambda old, new: also.append((old, new)))
    trip(breaker)
    for _ in range(5):  # reading the state does not repeat a transition
        assert breaker.state is OPEN
    clock.advance(1.0)
    for _ in range(5):
        assert breaker.state is HALF_OPEN
    probe(breaker)
    probe(breaker)
    assert breaker.state is CLOSED
    assert breaker.state is CLOSED
    expected = [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]
    assert seen == expected
    assert also == expected


def test_listeners_see_a_failed_probe_and_a_reset():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2)
    seen: list[tuple[str, str]] = []
    breaker.add_listener(lambda old, new: seen.append((str(old), str(new))))
    trip(breaker)
    clock.advance(1.0)
    probe(breaker, ok=False)
    breaker.reset()
    breaker.reset()  # already closed: no transition
    assert seen == [
        ("closed", "open"),
        ("open", "half_open"),
        ("half_open", "open"),
        ("open", "closed"),
    ]


def test_the_transition_to_half_open_is_reported_by_allow_too():
    """Nobody reads ``state``: the first ``allow()`` after open_for reports open -> half_open
    before its probe's own outcome."""
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=2, probes=1)
    seen: list[tuple[BreakerState, BreakerState]] = []
    breaker.add_listener(lambda old, new: seen.append((old, new)))
    for _ in range(2):
        breaker.record(False, FAST)
    clock.advance(1.0)
    assert breaker.allow()
    assert seen == [(CLOSED, OPEN), (OPEN, HALF_OPEN)]
    breaker.record(True, FAST)
    assert seen[-1] == (HALF_OPEN, CLOSED)


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"window": 0},
        {"window": -1.0},
        {"window": True},
        {"window": "10"},
        {"min_calls": 0},
        {"min_calls": 2.5},
        {"min_calls": True},
        {"failure_ratio": 0},
        {"failure_ratio": 1.5},
        {"failure_ratio": None},
        {"slow_call": 0},
        {"slow_call": -0.01},
        {"slow_ratio": 0},
        {"slow_ratio": 1.01},
        {"consecutive_failures": 0},
        {"consecutive_failures": 1.0},
        {"open_for": 0},
        {"open_for": float("nan")},
        {"max_open_for": 0},
        {"open_for": 5.0, "max_open_for": 2.0},
        {"probes": 0},
        {"probes": False},
    ],
    ids=repr,
)
def test_bad_configuration_is_a_config_error(options: dict[str, Any]):
    with pytest.raises(ConfigError) as excinfo:
        CircuitBreaker(**options)
    assert isinstance(excinfo.value, ValueError)


def test_extreme_valid_configuration_is_accepted():
    breaker = CircuitBreaker(
        window=0.001, min_calls=1, failure_ratio=1, slow_ratio=1, consecutive_failures=1,
        open_for=0.5, max_open_for=0.5, probes=1,
    )  # fmt: skip
    assert breaker.state is CLOSED
    assert breaker.open_for == 0.5


def test_a_limiter_refuses_a_breaker_that_is_not_one():
    with pytest.raises(ConfigError):
        Limiter.from_url("memory://", breaker=object())


def test_the_breaker_is_importable_from_the_package():
    """README: "Configure it with ``breaker=CircuitBreaker(window=..., ...)``" and "its state
    is ``limiter.breaker.state``", yet the class and its states live only in the private
    ``ratekeeper._engine.breaker``."""
    assert ratekeeper.CircuitBreaker is CircuitBreaker  # type: ignore[attr-defined]
    assert ratekeeper.BreakerState is BreakerState  # type: ignore[attr-defined]


# --- threads -------------------------------------------------------------------------------------


def test_thread_safety_smoke():
    """Eight threads allow/record at random on the real clock with tiny windows, so the breaker
    moves through every state many times. Nothing raises, and the transitions listeners saw
    form one unbroken chain from closed to the final state."""
    breaker = CircuitBreaker(
        window=0.01, min_calls=4, consecutive_failures=3, open_for=0.0005, max_open_for=0.002,
        probes=2,
    )  # fmt: skip
    lock = threading.Lock()
    seen: list[tuple[BreakerState, BreakerState]] = []
    errors: list[BaseException] = []

    def listener(old: BreakerState, new: BreakerState) -> None:
        with lock:
            seen.append((old, new))

    breaker.add_listener(listener)
    start = threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            start.wait()
            for _ in range(3_000):
                if breaker.allow():
                    breaker.record(rng.random() < 0.6, rng.choice((FAST, SLOW)))
                else:
                    _ = breaker.retry_after(), breaker.state
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    final = breaker.state
    assert final in (CLOSED, OPEN, HALF_OPEN)
    assert len(seen) > 10  # it did move around
    assert seen[0][0] is CLOSED
    for (_, new), (old, _) in itertools.pairwise(seen):
        assert new is old
    assert seen[-1][1] is final
    for old, new in seen:
        assert (old, new) in {
            (CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (HALF_OPEN, CLOSED),
        }  # fmt: skip
    breaker.reset()
    assert breaker.state is CLOSED
    assert breaker.allow()


# --- one fault, one failure ----------------------------------------------------------------------


def test_failures_of_calls_in_flight_together_are_one_fault():
    """Calls sent before a counted failure was known fail with the same fault: 64 timeouts of
    one stall are one failure, not 64; calls sent after it count again."""
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=3)
    for caller in range(64):  # sent at 0.0000-0.0189, each timing out 20 ms later
        breaker.record(False, 0.020, sent=caller * 0.0003)
    assert breaker.state is CLOSED
    assert breaker._streak == 1
    breaker.record(False, 0.020, sent=0.084)  # sent after the first was known (0.020)
    assert breaker._streak == 2
    breaker.record(False, 0.020, sent=0.090)  # in flight when that one was known (0.104)
    assert breaker._streak == 2
    breaker.record(False, 0.020, sent=0.110)  # a store that stays down keeps failing
    assert breaker.state is OPEN


def test_a_failure_reported_without_sent_always_counts():
    clock = ManualClock(1_000.0)
    breaker = make(clock, consecutive_failures=3)
    breaker.record(False, 0.020, sent=0.0)
    breaker.record(False, 0.020)
    breaker.record(False, 0.020)
    assert breaker.state is OPEN
