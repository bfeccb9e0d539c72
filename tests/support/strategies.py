"""Hypothesis strategies for the property tests: policies, identities and operation sequences.

A scenario is a few policies, a few identities and a list of operations:

* ``Advance(us)``: move the clock forward (0 included, so many operations share one instant);
* ``Hit(policy, identity, cost)`` and ``Peek(policy, identity, cost)``, with cost up to one
  above the policy's largest limit (so "can never pass" is exercised);
* ``Reset(policy, identity)``.

Policies and identities are referred to by index into the scenario's lists.

``algorithm_scenarios(case)`` makes the same for any algorithm (see ``ALGORITHM_CASES``), with
periods in milliseconds and more ways to move the clock: ``Boundary`` (to an epoch-aligned
window start, nudged by a microsecond or a millisecond) and ``WaitRetry`` (by exactly the last
denial's retry_after, nudged); for concurrency, ``Acquire`` and ``Release`` instead of ``Hit``.
``boundary_scenarios(case)`` draws limits, bursts and costs at the bounds that policy validation
allows, where the scripts' arithmetic in Lua doubles is closest to losing exactness.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from ratekeeper import Policy, Rate
from ratekeeper._engine.keys import Identity

#: A realistic epoch for ManualClock: microseconds near 1.7e15 exercise the real magnitudes.
START = 1_700_000_000.0

#: Identities worth mixing: plain, bytes, int, and the key-building edge cases.
IDENTITY_POOL: tuple[Identity, ...] = ("alice", b"\x00{}", 42, "", "}{", "\U0001f600")

#: Periods in whole seconds, 1 s to 1 h; a few favourites so rates often share boundaries.
periods = st.one_of(st.sampled_from([1, 2, 3, 5, 10, 60, 3600]), st.integers(1, 3600))


@st.composite
def rate_sets(draw: st.DrawFn, max_rates: int = 3) -> tuple[Rate, ...]:
    """One to ``max_rates`` rates with distinct periods and limits 1..20."""
    n = draw(st.integers(1, max_rates))
    chosen = draw(st.lists(periods, min_size=n, max_size=n, unique=True))
    limits = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    return tuple(Rate(limit, period) for limit, period in zip(limits, chosen, strict=True))


@st.composite
def policies(draw: st.DrawFn, name: str = "p") -> Policy:
    return Policy(name, draw(rate_sets()))


@dataclass(frozen=True)
class Advance:
    us: int


@dataclass(frozen=True)
class Hit:
    policy: int
    identity: int
    cost: int


@dataclass(frozen=True)
class Peek:
    policy: int
    identity: int
    cost: int


@dataclass(frozen=True)
class Reset:
    policy: int
    identity: int


Op = Advance | Hit | Peek | Reset


@dataclass(frozen=True)
class Scenario:
    policies: tuple[Policy, ...]
    identities: tuple[Identity, ...]
    ops: tuple[Op, ...]


def advances(period_us: list[int]) -> st.SearchStrategy[Advance]:
    """0 to 2 periods of one of the scenario's rates, in whole microseconds or milliseconds,
    with extra weight on 0 and on exact fractions of a period (window edges)."""
    period = st.sampled_from(period_us)
    # A whole period, a simple fraction of one, or just beside either: entries then sit right
    # at window edges, where off-by-one-microsecond mistakes show.
    fraction = st.sampled_from([1, 1, 1, 2, 4]).flatmap(
        lambda d: st.integers(1, 2 * d).map(lambda k: (k, d))
    )
    nudge = st.sampled_from([0, 0, -1, -1, 1, -1000, 1000])
    edge = st.tuples(period, fraction, nudge).map(
        lambda pfn: Advance(max(pfn[0] * pfn[1][0] // pfn[1][1] + pfn[2], 0))
    )
    return st.one_of(
        st.just(Advance(0)),
        st.just(Advance(0)),
        period.flatmap(lambda p: st.integers(0, 2 * p)).map(Advance),
        period.flatmap(lambda p: st.integers(0, 2 * p // 1000)).map(lambda ms: Advance(ms * 1000)),
        edge,
        edge,
        st.sampled_from([1, 999, 1000, 1001]).map(Advance),
    )


def costs(limit: int) -> st.SearchStrategy[int]:
    return st.one_of(st.just(1), st.integers(1, limit + 1))


@st.composite
def scenarios(draw: st.DrawFn, max_ops: int = 40, max_policies: int = 2) -> Scenario:
    n_policies = draw(st.integers(1, max_policies))
    drawn = tuple(draw(policies(f"p{i}")) for i in range(n_policies))
    identities = tuple(
        draw(st.lists(st.sampled_from(IDENTITY_POOL), min_size=1, max_size=3, unique=True))
    )
    period_us = sorted({rate.period_us for policy in drawn for rate in policy.rates})

    def calls(kind: type[Hit] | type[Peek]) -> st.SearchStrategy[Op]:
        return st.integers(0, n_policies - 1).flatmap(
            lambda p: st.builds(
                kind,
                st.just(p),
                st.integers(0, len(identities) - 1),
                costs(drawn[p].max_limit),
            )
        )

    kinds: dict[str, st.SearchStrategy[Op]] = {
        "hit": calls(Hit),
        "advance": advances(period_us),
        "peek": calls(Peek),
        "reset": st.builds(
            Reset, st.integers(0, n_policies - 1), st.integers(0, len(identities) - 1)
        ),
    }
    # Weighted: 8 hit, 5 advance, 3 peek, 1 reset (one_of would weigh its branches equally).
    weighted = ["hit"] * 8 + ["advance"] * 5 + ["peek"] * 3 + ["reset"]
    op = st.sampled_from(weighted).flatmap(kinds.__getitem__)
    # Draw the length first: st.lists alone keeps most sequences to a handful of operations.
    n_ops = draw(st.integers(1, max_ops))
    ops = tuple(draw(st.lists(op, min_size=n_ops, max_size=n_ops)))
    return Scenario(drawn, identities, ops)


# -- every algorithm -------------------------------------------------------------------------
#
# The O(1) algorithms count in integer milliseconds (sliding_window, gcra) or align windows to
# the epoch (fixed_window, sliding_window): their bugs live at sub-second periods, at window
# starts and one microsecond or millisecond beside them. Periods are drawn in milliseconds.

#: The algorithms with a Lua script and a Python reference to compare; "gcra_burst" is gcra
#: with an explicit ``burst=`` (one rate), "token_bucket" the alias of gcra (either form).
#: The sliding log's cases (the algorithm is the property tests' default, so it is not among
#: ALGORITHM_CASES): small limits, and limits up to 400 ("sliding_log_long").
LOG_CASES = ("sliding_log", "sliding_log_long")

ALGORITHM_CASES = (
    "sliding_window",
    "fixed_window",
    "gcra",
    "gcra_burst",
    "token_bucket",
    "concurrency",
)

#: Periods in whole milliseconds: sub-second, odd and whole ones, up to an hour.
periods_ms = st.one_of(
    st.sampled_from([1, 2, 3, 7, 10, 250, 999, 1000, 1001, 1500, 2000, 5000, 60_000]),
    st.integers(1, 3_600_000),
)


@st.composite
def ms_rate_sets(draw: st.DrawFn, max_rates: int = 3, max_limit: int = 20) -> tuple[Rate, ...]:
    """One to ``max_rates`` rates with distinct periods in milliseconds, limits 1..max_limit."""
    n = draw(st.integers(1, max_rates))
    chosen = draw(st.lists(periods_ms, min_size=n, max_size=n, unique=True))
    limits = draw(st.lists(st.integers(1, max_limit), min_size=n, max_size=n))
    return tuple(Rate(limit, ms / 1000) for limit, ms in zip(limits, chosen, strict=True))


@st.composite
def algorithm_policies(draw: st.DrawFn, case: str, name: str = "p") -> Policy:
    """A valid policy for ``case`` (one of ALGORITHM_CASES), small limits."""
    if case == "concurrency":
        # A handful of units (each is a sorted-set member); the period is the lease timeout.
        return Policy(name, draw(ms_rate_sets(max_rates=1, max_limit=6)), "concurrency")
    if case == "gcra_burst":
        rates = draw(ms_rate_sets(max_rates=1))
        # Below, at and above the limit: burst is independent of the rate.
        burst = draw(st.integers(1, 3 * rates[0].limit + 2))
        return Policy(name, rates, "gcra", burst=burst)
    if case == "token_bucket":
        if draw(st.booleans()):
            rates = draw(ms_rate_sets(max_rates=1))
            return Policy(name, rates, "token_bucket", burst=draw(st.integers(1, 25)))
        return Policy(name, draw(ms_rate_sets()), "token_bucket")
    if case == "sliding_log_long":
        # Logs of hundreds of entries: the script searches them by index (LINDEX), galloping
        # from either end, where a short log is answered by the newest entries alone.
        return Policy(name, draw(ms_rate_sets(max_limit=400)), "sliding_log")
    return Policy(name, draw(ms_rate_sets()), case)


def burst_of(policy: Policy, rate_index: int) -> int:
    """What a gcra rate admits at once: the policy's burst (one rate) or the rate's limit."""
    if policy.burst is not None:
        return policy.burst
    return policy.rates[rate_index].limit


def capacity(policy: Policy) -> int:
    """The largest capacity among the rates (limit, or burst for gcra): a cost above it is
    refused by every rate; one between the smallest and this, by some rate, forever."""
    if policy.algorithm in ("gcra", "token_bucket"):
        return max(burst_of(policy, i) for i in range(len(policy.rates)))
    return policy.max_limit


@dataclass(frozen=True)
class Boundary:
    """Move to the next multiple of ``period_us`` after now (an epoch-aligned window start),
    plus ``nudge_us``; never backwards."""

    period_us: int
    nudge_us: int


@dataclass(frozen=True)
class WaitRetry:
    """Move forward by the last denial's retry_after plus ``nudge_us`` (not below 0): the exact
    instant the algorithm said the request would pass, and one microsecond either side."""

    nudge_us: int


@dataclass(frozen=True)
class Acquire:
    policy: int
    identity: int
    cost: int


@dataclass(frozen=True)
class Release:
    """Release the ``lease``-th lease acquired so far (modulo their number); none yet: no-op."""

    lease: int


AlgorithmOp = Advance | Boundary | WaitRetry | Hit | Peek | Reset | Acquire | Release


@dataclass(frozen=True)
class AlgorithmScenario:
    policies: tuple[Policy, ...]
    identities: tuple[Identity, ...]
    ops: tuple[AlgorithmOp, ...]


#: Nudges around an exact instant: one microsecond, one millisecond, and just under one.
NUDGES = (0, 0, 0, -1, 1, -1000, 1000, 999, -999, 500)


def draw_time_op(draw: st.DrawFn, kind: str, period_us: list[int]) -> AlgorithmOp:
    """A clock move of ``kind``: "advance" (0 to 2 periods, whole us or ms, window edges and
    sub-millisecond steps), "boundary" (to a window start, nudged) or "wait" (the last
    retry_after, nudged). Drawn directly, without flatmap, so that failures shrink fast."""
    if kind == "boundary":
        return Boundary(draw(st.sampled_from(period_us)), draw(st.sampled_from(NUDGES)))
    if kind == "wait":
        return WaitRetry(draw(st.sampled_from(NUDGES)))
    how = draw(st.sampled_from(["zero", "us", "ms", "edge", "edge", "tiny"]))
    period = draw(st.sampled_from(period_us))
    if how == "zero":
        return Advance(0)
    if how == "us":
        return Advance(draw(st.integers(0, 2 * period)))
    if how == "ms":
        return Advance(1000 * draw(st.integers(0, 2 * period // 1000)))
    if how == "tiny":
        return Advance(draw(st.sampled_from([1, 999, 1000, 1001])))
    # A whole period, a simple fraction of one, or just beside either.
    denominator = draw(st.sampled_from([1, 1, 1, 2, 4]))
    numerator = draw(st.integers(1, 2 * denominator))
    nudge = draw(st.sampled_from([0, 0, -1, -1, 1, -1000, 1000]))
    return Advance(max(period * numerator // denominator + nudge, 0))


def more(draw: st.DrawFn, ops: list[AlgorithmOp], max_ops: int) -> bool:
    """Whether to draw another operation: always a first, then on with probability ~0.97.

    One draw per operation, as ``st.lists`` does, so that the shrinker can delete any
    operation (and its draw) without shifting the others; but longer sequences than
    ``st.lists`` would make (its average is about six; this one's about fifteen).
    """
    if not ops:
        return True
    return len(ops) < max_ops and draw(st.integers(0, 63)) > 1


@st.composite
def algorithm_scenarios(
    draw: st.DrawFn, case: str, max_ops: int = 40, max_policies: int = 2
) -> AlgorithmScenario:
    """Policies of one algorithm case, identities, and a sequence of operations: hits (or
    acquires and releases for concurrency), peeks, resets and clock moves of every kind."""
    n_policies = draw(st.integers(1, max_policies))
    drawn = tuple(draw(algorithm_policies(case, f"p{i}")) for i in range(n_policies))
    identities = tuple(
        draw(st.lists(st.sampled_from(IDENTITY_POOL), min_size=1, max_size=3, unique=True))
    )
    period_us = sorted({rate.period_us for policy in drawn for rate in policy.rates})
    weighted = ["hit"] * 8 + ["advance"] * 3 + ["boundary"] * 2 + ["wait"] * 2
    weighted += ["peek"] * 3 + ["reset"]
    if case == "concurrency":
        weighted += ["release"] * 5
    ops: list[AlgorithmOp] = []
    while more(draw, ops, max_ops):
        kind = draw(st.sampled_from(weighted))
        if kind in ("advance", "boundary", "wait"):
            ops.append(draw_time_op(draw, kind, period_us))
        elif kind == "release":
            ops.append(Release(draw(st.integers(0, 50))))
        else:
            p = draw(st.integers(0, n_policies - 1))
            i = draw(st.integers(0, len(identities) - 1))
            if kind == "reset":
                ops.append(Reset(p, i))
                continue
            cost = draw(costs(capacity(drawn[p])))
            if kind == "peek":
                ops.append(Peek(p, i, cost))
            else:
                ops.append(Acquire(p, i, cost) if case == "concurrency" else Hit(p, i, cost))
    return AlgorithmScenario(drawn, identities, tuple(ops))


# -- at the validation bounds ----------------------------------------------------------------
#
# Each script promises exact integer arithmetic in Lua doubles up to a bound the policy checks:
# limits up to 2**52 for the counters (gcra: 2**53 // 1001), sliding_window limit x period_ms
# <= 2**52 (a settled reservation may count twice the limit), gcra burst x period_ms <= 2**52.
# These draw limits, bursts and costs at and just below those bounds.

BOUNDARY_CASES = ("sliding_window", "fixed_window", "gcra", "gcra_burst")

MAX_INT = 2**53
COUNTER_MAX = 2**52
GCRA_MAX = 2**53 // 1001


def _near(bound: int) -> st.SearchStrategy[int]:
    """The bound itself, just below it, or anywhere up to it (never below 1)."""
    return st.one_of(
        st.just(bound), st.integers(max(bound - 3, 1), bound), st.integers(1, bound)
    ).map(lambda v: max(v, 1))


#: Periods for the bounds: mostly a few milliseconds, where limits near 2**53 / period_ms are
#: largest and Lua doubles have the least room.
boundary_periods_ms = st.one_of(st.sampled_from([1, 1, 2, 3, 7, 10, 100, 999, 1000]), periods_ms)


@st.composite
def boundary_policies(draw: st.DrawFn, case: str) -> Policy:
    ms = draw(boundary_periods_ms)
    period = ms / 1000
    if case == "sliding_window":
        limit = draw(_near(min(MAX_INT // (2 * ms), COUNTER_MAX)))
        return Policy("b", Rate(limit, period), "sliding_window")
    if case == "fixed_window":
        return Policy("b", Rate(draw(_near(COUNTER_MAX)), period), "fixed_window")
    if case == "gcra":
        return Policy("b", Rate(draw(_near(min(2**52 // ms, GCRA_MAX))), period), "gcra")
    limit = draw(st.one_of(_near(GCRA_MAX), st.integers(1, 100)))
    # burst x period_ms <= 2**52, and the refill horizon burst x period / limit <= 2**51 us.
    bound = min(2**52 // ms, 2**51 * limit // (ms * 1000))
    return Policy("b", Rate(limit, period), "gcra", burst=draw(_near(bound)))


def boundary_costs(cap: int) -> st.SearchStrategy[int]:
    """Costs that fill, nearly fill, half fill or overflow a capacity of ``cap``."""
    return st.one_of(
        st.just(1),
        st.sampled_from([cap, cap + 1, max(cap - 1, 1), cap // 2 + 1, max(cap // 3, 1)]),
        st.integers(1, cap + 1),
    ).map(lambda c: min(c, MAX_INT))


@st.composite
def boundary_scenarios(draw: st.DrawFn, case: str, max_ops: int = 16) -> AlgorithmScenario:
    policy = draw(boundary_policies(case))
    cap = capacity(policy)
    period_us = [policy.rates[0].period_us]
    weighted = ["hit"] * 6 + ["peek"] * 2 + ["advance"] * 2 + ["boundary", "wait"]
    ops: list[AlgorithmOp] = []
    while more(draw, ops, max_ops):
        kind = draw(st.sampled_from(weighted))
        if kind == "hit":
            ops.append(Hit(0, 0, draw(boundary_costs(cap))))
        elif kind == "peek":
            ops.append(Peek(0, 0, draw(boundary_costs(cap))))
        else:
            ops.append(draw_time_op(draw, kind, period_us))
    return AlgorithmScenario((policy,), ("x",), tuple(ops))
