"""How often the sliding_window estimate decides differently from the exact sliding_log.

A synthetic trace (fixed seed) of over a million requests from 2,000 identities, in simulated
time, is replayed through ``Limiter.from_url("memory://", clock=clock)``: a ``ManualClock`` set to
each request's time. The memory backend runs the pure-Python references of the Lua scripts (the
property tests prove them identical to the scripts), so no server is needed and simulated hours
take seconds. Both policies are ``100/minute``: one ``sliding_window``, one ``sliding_log``.

Traffic, per identity, active for 2-8 minutes starting somewhere in the first 10 minutes:

* ``poisson``  (50%): Poisson arrivals at m x the limit's rate, m log-uniform in [0.5, 3];
* ``bursty``   (30%): on/off, Poisson at 3-10 x the limit's rate while on (on ~ Exp(mean 10 s),
  off ~ Exp(mean 50 s));
* ``ramp``     (20%): a Poisson rate ramping linearly from 0.25 x to 2.5 x the limit's rate.

Two comparisons are reported:

1. **Straightforward replay** (the headline): each algorithm sees the whole trace and decides
   on its own. Once they decide one request differently, their states differ (each consumed
   differently), so later differences are partly consequences of earlier ones.
2. **Against its own history**: each sliding_window decision is checked against the exact rule
   applied to the requests sliding_window itself admitted (fewer than 100 of them in the
   trailing 60 s). This isolates the estimate's own error from that divergence. The same check on
   sliding_log's decisions must find no difference (a self-check of the harness).

Run: ``.venv/bin/python benchmarks/accuracy.py [--seed 20260101] [--identities 2000]``
Results: tables on stdout and ``benchmarks/results/accuracy.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness as harness
from rich.console import Console

from ratekeeper import Limiter, ManualClock, Policy

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "accuracy.json"

LIMIT = 100
PERIOD = 60.0
RATE = f"{LIMIT}/minute"
#: The simulation's epoch: a whole number of hours, so windows start on round times.
BASE = 1_800_000_000.0
PROFILES = (("poisson", 0.5), ("bursty", 0.3), ("ramp", 0.2))
#: Offered load (mean rate while active / the limit's rate): upper bound, label.
LOAD_BUCKETS = ((0.8, "< 0.8x"), (1.2, "0.8-1.2x"), (2.0, "1.2-2x"), (math.inf, ">= 2x"))
#: The approximations compared with the exact sliding_log; sliding_window is the subject.
DEFAULT_ALGORITHMS = ["sliding_window", "fixed_window"]


@dataclass(frozen=True)
class Identity:
    name: str
    profile: str
    start: float
    duration: float
    params: dict[str, float]


def poisson(rng: random.Random, rate: float, start: float, end: float) -> Iterator[float]:
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return
        yield t


def bursty(
    rng: random.Random, on_rate: float, mean_on_off: tuple[float, float], start: float, end: float
) -> Iterator[float]:
    # Start at a random phase: on with probability mean_on / (mean_on + mean_off).
    mean_on, mean_off = mean_on_off
    t = start
    on = rng.random() < mean_on / (mean_on + mean_off)
    while t < end:
        length = rng.expovariate(1 / (mean_on if on else mean_off))
        if on:
            yield from poisson(rng, on_rate, t, min(t + length, end))
        t += length
        on = not on


def ramp(
    rng: random.Random, rate_from: float, rate_to: float, start: float, end: float
) -> Iterator[float]:
    """A Poisson process whose rate moves linearly from rate_from to rate_to (thinning)."""
    top = max(rate_from, rate_to)
    for t in poisson(rng, top, start, end):
        rate = rate_from + (rate_to - rate_from) * (t - start) / (end - start)
        if rng.random() * top < rate:
            yield t


def make_trace(seed: int, identities: int) -> tuple[list[Identity], list[tuple[float, int]]]:
    """The identities and every request as (seconds after BASE, identity index), time-sorted."""
    rng = random.Random(seed)
    unit = LIMIT / PERIOD  # the limit's average rate, requests per second
    names = [name for name, _ in PROFILES]
    weights = [share for _, share in PROFILES]
    people: list[Identity] = []
    events: list[tuple[float, int]] = []
    for index in range(identities):
        profile = rng.choices(names, weights)[0]
        start = rng.uniform(0, 600)
        duration = rng.uniform(120, 480)
        end = start + duration
        params: dict[str, float]
        if profile == "poisson":
            m = math.exp(rng.uniform(math.log(0.5), math.log(3.0)))
            params = {"rate_x_limit": m}
            times = poisson(rng, m * unit, start, end)
        elif profile == "bursty":
            m = rng.uniform(3.0, 10.0)
            params = {"on_rate_x_limit": m, "mean_on_s": 10.0, "mean_off_s": 50.0}
            times = bursty(rng, m * unit, (10.0, 50.0), start, end)
        else:
            params = {"rate_from_x_limit": 0.25, "rate_to_x_limit": 2.5}
            times = ramp(rng, 0.25 * unit, 2.5 * unit, start, end)
        people.append(Identity(f"id-{index:05d}", profile, start, duration, params))
        events.extend((round(t, 6), index) for t in times)
    events.sort()
    return people, events


@dataclass
class Tally:
    """One approximate algorithm against sliding_log, over one group of requests."""

    decisions: int = 0
    admitted: int = 0
    log_admitted: int = 0
    differ: int = 0
    false_admits: int = 0  # the approximation admitted, sliding_log denied
    false_denies: int = 0  # the approximation denied, sliding_log admitted
    own_over: int = 0  # admitted although its own admits in the trailing window were at the limit
    own_under: int = 0  # denied although its own admits in the trailing window left room

    def record(self, admitted: bool, log_admitted: bool, room: bool, n: int = 1) -> None:
        """n decisions alike; ``room``: the exact rule on this algorithm's own admits admits."""
        self.decisions += n
        self.admitted += admitted * n
        self.log_admitted += log_admitted * n
        if admitted != log_admitted:
            self.differ += n
            if admitted:
                self.false_admits += n
            else:
                self.false_denies += n
        if admitted and not room:
            self.own_over += n
        elif room and not admitted:
            self.own_under += n

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(vars(self))
        n = self.decisions or 1
        d["differ_share"] = self.differ / n
        d["false_admit_share"] = self.false_admits / n
        d["false_deny_share"] = self.false_denies / n
        d["own_history_wrong"] = self.own_over + self.own_under
        d["own_history_wrong_share"] = (self.own_over + self.own_under) / n
        return d


def load_bucket(person: Identity, requests: int) -> str:
    """The identity's offered load: its mean request rate while active over the limit's rate."""
    load = requests / person.duration / (LIMIT / PERIOD)
    for bound, label in LOAD_BUCKETS:
        if load < bound:
            return label
    return LOAD_BUCKETS[-1][1]


def replay(
    people: list[Identity],
    events: list[tuple[float, int]],
    algorithms: list[str],
    deny_cache: int | None = None,
) -> dict[str, Any]:
    clock = ManualClock(BASE)
    options = {} if deny_cache is None else {"deny_cache": deny_cache}
    limiter = Limiter.from_url("memory://", clock=clock, **options)
    log = Policy("log", RATE, "sliding_log")
    policies = [Policy(name, RATE, name) for name in algorithms]
    window_us = log.rates[0].period_us
    counts = Counter(index for _, index in events)
    groups = [
        ("all", person.profile, "load " + load_bucket(person, counts[i]))
        for i, person in enumerate(people)
    ]
    labels = ["all", *(name for name, _ in PROFILES), *("load " + b for _, b in LOAD_BUCKETS)]
    # outcomes[name][identity][code]: decisions by code = 4 * admitted + 2 * log admitted + room,
    # summed into Tally groups at the end (cheaper than a Tally update per group per request).
    outcomes = {name: [[0] * 8 for _ in people] for name in algorithms}
    # Each algorithm's own admits per identity (microseconds), for the exact rule and the peak.
    own = {name: [deque[int]() for _ in people] for name in [*algorithms, "sliding_log"]}
    peak = {name: [0] * len(people) for name in [*algorithms, "sliding_log"]}
    self_check_mismatches = 0
    hit, set_clock = limiter.hit, clock.set

    def exact(name: str, index: int, cut: int) -> deque[int]:
        admits = own[name][index]
        while admits and admits[0] <= cut:
            admits.popleft()
        return admits

    for offset, index in events:
        now = BASE + offset
        set_clock(now)
        now_us = int(now * 1_000_000)  # exactly what the limiter's core computes
        cut = now_us - window_us  # the exact rule: fewer than LIMIT admits in (now - W, now]
        identity = people[index].name
        a_log = hit(log, identity).allowed
        admits = exact("sliding_log", index, cut)
        if (len(admits) < LIMIT) != a_log:
            self_check_mismatches += 1
        if a_log:
            admits.append(now_us)
            peak["sliding_log"][index] = max(peak["sliding_log"][index], len(admits))
        for policy in policies:
            name = policy.algorithm
            a = hit(policy, identity).allowed
            admits = exact(name, index, cut)
            room = len(admits) < LIMIT
            if a:
                admits.append(now_us)
                peak[name][index] = max(peak[name][index], len(admits))
            outcomes[name][index][4 * a + 2 * a_log + room] += 1
    limiter.close()

    tallies = {name: {label: Tally() for label in labels} for name in algorithms}
    for name in algorithms:
        for index, by_code in enumerate(outcomes[name]):
            for code, n in enumerate(by_code):
                for label in groups[index]:
                    tallies[name][label].record(bool(code & 4), bool(code & 2), bool(code & 1), n)

    def peaks(values: list[int]) -> dict[str, Any]:
        over = [v for v in values if v > LIMIT]
        return {
            "max_admitted_in_any_trailing_window": max(values),
            "identities_over_limit": len(over),
            "identities": len(values),
            "mean_peak_of_those_over": statistics.fmean(over) if over else None,
        }

    return {
        "algorithms": {
            name: {label: tally.as_dict() for label, tally in tallies[name].items()}
            for name in algorithms
        },
        "peak": {name: peaks(values) for name, values in peak.items()},
        "identities_by_group": dict(Counter(label for g in groups for label in g)),
        "self_check_mismatches": self_check_mismatches,
    }


def print_results(console: Console, result: dict[str, Any]) -> None:
    ids = result["identities_by_group"]
    for name, by_label in result["algorithms"].items():
        rows = []
        for label, t in by_label.items():
            n = t["decisions"] or 1
            rows.append(
                [
                    label,
                    f"{ids.get(label, 0):,}",
                    f"{t['decisions']:,}",
                    f"{t['admitted']:,} ({t['admitted'] / n:.1%})",
                    f"{t['log_admitted']:,} ({t['log_admitted'] / n:.1%})",
                    f"{t['differ']:,}",
                    f"{t['differ_share']:.2%}",
                    f"{t['false_admits']:,} ({t['false_admit_share']:.2%})",
                    f"{t['false_denies']:,} ({t['false_deny_share']:.2%})",
                    f"{t['own_over']:,}",
                    f"{t['own_under']:,}",
                ]
            )
        harness.print_table(
            console,
            f"{name} vs sliding_log, {RATE}: straightforward replay (each sees the full trace "
            "and decides on its own)",
            ("requests of", "ids", "decisions", f"{name}\nadmitted", "sliding_log\nadmitted",
             "differ", "differ %", f"false admits\n({name} yes,\nlog no)",
             f"false denies\n({name} no,\nlog yes)", "vs own history:\nadmitted over",
             "vs own history:\ndenied with room"),
            rows,
        )  # fmt: skip
    rows = []
    for name, peak in result["peak"].items():
        mean = peak["mean_peak_of_those_over"]
        rows.append(
            [
                name,
                str(peak["max_admitted_in_any_trailing_window"]),
                f"{peak['identities_over_limit']:,} of {peak['identities']:,}",
                "-" if mean is None else f"{mean:.1f}",
            ]
        )
    harness.print_table(
        console,
        f"most admits of one identity in any trailing {PERIOD:g} s (limit {LIMIT})",
        ("algorithm", "max", "identities ever over", "their mean peak"),
        rows,
    )
    console.print(
        "Harness self-check (sliding_log's decisions vs the exact rule on its own admits): "
        f"{result['self_check_mismatches']} mismatches."
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seed", type=int, default=20260101)
    parser.add_argument("--identities", type=int, default=2_000)
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=DEFAULT_ALGORITHMS,
        choices=["sliding_window", "fixed_window", "gcra"],
        help="approximations to compare with sliding_log (sliding_window is the study, "
        "fixed_window context; adding gcra takes the run past 2 minutes on 2 cores)",
    )
    parser.add_argument(
        "--deny-cache",
        type=int,
        default=None,
        help="the limiter's local cache of exact denials (entries; 0 = off; default: the "
        "library's default). It answers repeated denials without the store and must not change "
        "any decision: compare a run with --deny-cache 0",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.identities < 1:
        parser.error("--identities must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = harness.console()
    started = time.perf_counter()
    people, events = make_trace(args.seed, args.identities)
    generated = time.perf_counter()
    profiles = Counter(person.profile for person in people)
    span = events[-1][0] - events[0][0] if events else 0.0
    console.print(
        f"trace: {len(events):,} requests from {len(people):,} identities "
        f"({', '.join(f'{n} {c:,}' for n, c in sorted(profiles.items()))}) over "
        f"{span / 60:.1f} simulated minutes; seed {args.seed}; built in {generated - started:.1f} s"
    )
    result = replay(people, events, args.algorithms, args.deny_cache)
    finished = time.perf_counter()
    decisions = len(events) * (1 + len(args.algorithms))
    console.print(f"replayed in {finished - generated:.1f} s ({decisions:,} decisions)")
    print_results(console, result)
    if result["self_check_mismatches"]:
        console.print("[red]self-check failed: the exact-rule bookkeeping is wrong[/red]")
    elapsed = time.perf_counter() - started
    console.print(f"total {elapsed:.1f} s")

    output = {
        "benchmark": "accuracy",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": harness.machine_info(None, load_average_1min_at_end=os.getloadavg()[0]),
        "config": {
            "seed": args.seed,
            "identities": args.identities,
            "rate": RATE,
            "exact": "sliding_log",
            "compared": args.algorithms,
            "backend": "memory:// with a ManualClock",
            "deny_cache": "library default" if args.deny_cache is None else args.deny_cache,
            "profiles": dict(PROFILES),
            "load_buckets": [label for _, label in LOAD_BUCKETS],
            "identity_activity_s": [120, 480],
            "identity_start_s": [0, 600],
        },
        "trace": {
            "requests": len(events),
            "identities_by_profile": dict(profiles),
            "simulated_seconds": span,
        },
        "replay": "straightforward: each algorithm sees the full trace and decides on its own",
        "result": result,
        "seconds": {
            "generate": generated - started,
            "replay": finished - generated,
            "total": elapsed,
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=2) + "\n")
    console.print(f"wrote {args.output}")
    return 1 if result["self_check_mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
