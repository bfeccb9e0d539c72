"""Hypothesis strategies for the property tests: policies, identities and operation sequences.

A scenario is a few policies, a few identities and a list of operations:

* ``Advance(us)``: move the clock forward (0 included, so many operations share one instant);
* ``Hit(policy, identity, cost)`` and ``Peek(policy, identity, cost)``, with cost up to one
  above the policy's largest limit (so "can never pass" is exercised);
* ``Reset(policy, identity)``.

Policies and identities are referred to by index into the scenario's lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from ratekeeper import Policy, Rate
from ratekeeper._keys import Identity

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
