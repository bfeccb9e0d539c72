"""ratekeeper beside its floors (C clients of the same script) and its peers, in one run.

One private Redis/Valkey server on a free loopback port (never 6379), pinned to one CPU; this
process and the ``redis-benchmark`` it starts run on the others (when there are two or more).
Every round runs every case for ``--seconds`` on an empty store (``FLUSHALL``,
``CONFIG RESETSTAT`` before each case), the case order rotating between rounds, so every ratio
pairs runs of the same round. ``--identities`` are hit in turn under a limit that admits nearly
everything: ``1000/minute`` for the log-based algorithms, ``1000000/minute`` for the counters.

Cases (``sync``: one blocking caller; ``async64``: 64 asyncio tasks sharing one limiter):

* ``ratekeeper/{sync,async64}/<algorithm>``: ``Limiter`` / ``AsyncLimiter.from_url(url,
  **store_only()).hit(policy, identity)`` (``_harness.store_only``: errors raise, 10 s timeouts, a
  breaker that never opens, no deny cache) for sliding_log, sliding_window, fixed_window and gcra;
* ``redis-benchmark/c1-P1``: ``redis-benchmark -c 1 -P 1`` of ``EVALSHA`` of ratekeeper's own
  sliding_log script with the KEYS/ARGV ``Limiter.hit`` sends (``__rand_int__`` in the key):
  the round-trip floor of one caller;
* ``redis-benchmark/c50-P16``: the same with ``-c 50 -P 16``: the server's ceiling;
* ``limits/{sync,async64}/<strategy>``: ``MovingWindowRateLimiter``, ``FixedWindowRateLimiter``
  and ``SlidingWindowCounterRateLimiter`` over ``RedisStorage`` (async: ``limits.aio`` on
  ``async+redis://`` with ``implementation="redispy"``);
* ``pyrate/sync/sliding_log``: PyrateLimiter's ``Limiter`` over one ``RedisBucket`` per identity
  (its documented ``BucketFactory`` routing), ``try_acquire(identity, blocking=False)``;
* ``raw/sync/evalsha``: redis-py ``evalsha`` of the same script and calls;
* ``raw/async/pipeline64``: the same calls, 64 per ``redis.asyncio`` pipeline round trip;
* ``deny_cache/{on,off}``: one identity whose ``10/minute`` is spent, then ``--deny-hits`` hits
  in this process, ``Limiter`` with its default deny cache and with ``deny_cache=0``.

Reported per case: the median over rounds of decisions/s, p50/p99 latency per call, server us
per decision (``INFO commandstats``: the time of the script calls over the decisions) and the
fraction admitted; then the ratios against the floors and peers, each the median of per-round
ratios. The middleware section of the page comes from ``benchmarks/asgi_middleware.py``'s last
results (``benchmarks/results/asgi_middleware.json``), if any.

Run: ``python benchmarks/compare.py [--seconds 1] [--rounds 9] [--quick] [--out DIR]``
Writes ``docs/performance.md``, ``docs/performance.png`` and ``benchmarks/results/compare.json``
(``--quick``: a short smoke run into a temporary directory unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gc
import io
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import limits
import limits.aio.storage
import limits.storage
import pyrate_limiter
import redis
import redis.asyncio
from _harness import (
    RATIO_HEADERS,
    Runner,
    Sample,
    Server,
    ServerBinary,
    async_loop,
    console,
    event_loop,
    find_binary,
    machine_cpu,
    machine_info,
    markdown_table,
    max_load,
    pin_clients,
    print_table,
    ratio_cells,
    ratio_row,
    rotations,
    run_case,
    server_facts,
    store_only,
    summarize,
    sync_loop,
)
from _peers import FIXED_WINDOW, MOVING_WINDOW, PEERS, SLIDING_WINDOW_COUNTER, STRATEGIES, Strategy
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import ratekeeper
from ratekeeper import AsyncLimiter, Limiter, Policy
from ratekeeper._algorithms.scripts import Script
from ratekeeper._engine.core import Core

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DOCS = REPO / "docs"
RESULTS = HERE / "results" / "compare.json"
MIDDLEWARE_RESULTS = HERE / "results" / "asgi_middleware.json"
MARKDOWN_NAME = "performance.md"
CHART_NAME = "performance.png"
JSON_NAME = "compare.json"

LOG_RATE = "1000/minute"  # sliding logs keep one entry per hit
COUNTER_RATE = "1000000/minute"
DENY_RATE = "10/minute"
POLICY_NAME = "bench"
ALGORITHMS = ("sliding_log", "sliding_window", "fixed_window", "gcra")
#: The most server time per decision each algorithm may take against its peer (``_peers.PEERS``).
MOST_SERVER_TIME = {"sliding_log": 1.0, "sliding_window": 1.25, "fixed_window": 1.25, "gcra": 1.25}
PIPELINE = 64
#: (clients, pipeline) of the two redis-benchmark runs: one caller's floor, the server's ceiling.
FLOOR = (1, 1)
CEILING = (50, 16)


def bench_name(clients: int, pipeline: int) -> str:
    return f"redis-benchmark/c{clients}-P{pipeline}"


@dataclass
class Case:
    """One benchmarked configuration: how to run it for a duration and how to clean up."""

    name: str
    family: str  # ratekeeper, limits, pyrate, floor, deny_cache
    runner: Runner
    close: Callable[[], None]
    #: Called after each run, before the next FLUSHALL (e.g. to count what a run admitted).
    after: Callable[[Sample], None] | None = None
    #: (p50, p99) us per round, for a case whose latencies come from elsewhere (redis-benchmark).
    reported_latency_us: list[tuple[float, float]] = field(default_factory=list)


# --- the raw script calls ratekeeper makes -----------------------------------------------------

#: KEYS, the ARGV before the per-call token and the ARGV after it (all of ARGV when no token).
RawCall = tuple[tuple[str, ...], tuple[Any, ...], tuple[Any, ...]]


@dataclass(frozen=True)
class ScriptCalls:
    """The script ``Limiter.hit`` runs and, per identity, its KEYS and ARGV split around the
    per-call token, if the script takes one (a token must stay unique per call)."""

    script: Script
    calls: list[RawCall]
    has_token: bool


def script_calls(policy: Policy, identities: Sequence[str]) -> ScriptCalls:
    core = Core()
    calls: list[RawCall] = []
    script = None
    has_token = False
    for identity in identities:
        call = core.hit_call(policy, identity, 1)
        script = call.script
        if call.token in call.args:
            has_token = True
            at = call.args.index(call.token)
            calls.append((call.keys, call.args[:at], call.args[at + 1 :]))
        else:
            calls.append((call.keys, call.args, ()))
    assert script is not None
    return ScriptCalls(script, calls, has_token)


def tokens() -> Callable[[], str]:
    """Unique tokens, as ratekeeper makes them: a random nonce and a counter."""
    nonce = os.urandom(6).hex()
    serial = itertools.count()
    return lambda: f"{nonce}{next(serial):x}"


def find_benchmark() -> str | None:
    """redis-benchmark on PATH, else valkey-benchmark, else None."""
    return shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")


# --- the cases ---------------------------------------------------------------------------------


class Builder:
    """Makes every case against one server, one event loop and one list of identities."""

    def __init__(
        self, server: Server, loop: asyncio.AbstractEventLoop, args: argparse.Namespace
    ) -> None:
        self.server = server
        self.url = server.url
        self.loop = loop
        self.args = args
        self.identities = [f"user:{i}" for i in range(args.identities)]

    def _await(self, awaitable: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(awaitable)

    def ratekeeper(self, algorithm: str, concurrent: bool) -> Case:
        rate = LOG_RATE if algorithm == "sliding_log" else COUNTER_RATE
        policy = Policy(POLICY_NAME, rate, algorithm=algorithm)
        options = store_only()
        if not concurrent:
            limiter = Limiter.from_url(self.url, **options)
            hit = limiter.hit
            return Case(
                f"ratekeeper/sync/{algorithm}",
                "ratekeeper",
                sync_loop(lambda identity: hit(policy, identity).allowed, self.identities),
                limiter.close,
            )

        async def make() -> AsyncLimiter:
            return AsyncLimiter.from_url(self.url, **options)

        alimiter: AsyncLimiter = self._await(make())
        ahit = alimiter.hit

        async def hit_async(identity: str) -> bool:
            return (await ahit(policy, identity)).allowed

        return Case(
            f"ratekeeper/async{self.args.tasks}/{algorithm}",
            "ratekeeper",
            async_loop(self.loop, hit_async, self.identities, self.args.tasks),
            lambda: self._await(alimiter.close()),
        )

    def limits(self, strategy: Strategy, concurrent: bool) -> Case:
        item = limits.parse(LOG_RATE if strategy.log else COUNTER_RATE)
        if not concurrent:
            pool = redis.ConnectionPool.from_url(self.url)
            storage = limits.storage.RedisStorage(self.url, connection_pool=pool)
            limiter = strategy.sync(storage)
            return Case(
                f"limits/sync/{strategy.case}",
                "limits",
                sync_loop(partial(limiter.hit, item), self.identities),
                pool.disconnect,
            )

        async def make() -> tuple[Any, redis.asyncio.ConnectionPool]:
            apool = redis.asyncio.ConnectionPool.from_url(self.url)
            astorage = limits.aio.storage.RedisStorage(
                "async+" + self.url, implementation="redispy", connection_pool=apool
            )
            return strategy.aio(astorage), apool

        alimiter, apool = self._await(make())
        return Case(
            f"limits/async{self.args.tasks}/{strategy.case}",
            "limits",
            async_loop(self.loop, partial(alimiter.hit, item), self.identities, self.args.tasks),
            lambda: self._await(apool.aclose()),
        )

    def pyrate(self) -> Case:
        """PyrateLimiter as its README sets it up: a ``RedisBucket`` made with ``init`` on a
        redis-py client, one bucket per key through a ``BucketFactory`` whose ``create`` also
        schedules the bucket's leak, wall-clock timestamps (``WallClock``, for state shared
        through Redis), ``try_acquire(name, blocking=False)`` to fail fast."""
        pr = pyrate_limiter
        rates = [pr.Rate(1000, pr.Duration.MINUTE)]  # LOG_RATE
        pool = redis.ConnectionPool.from_url(self.url)
        client = redis.Redis(connection_pool=pool)

        class PerIdentity(pr.BucketFactory):
            def __init__(self) -> None:
                self.clock = pr.WallClock()
                self.buckets: dict[str, pr.AbstractBucket] = {}
                # The background leak would otherwise run every 10 s over every bucket, during
                # other libraries' cases too; a benchmark that empties the store needs none.
                self.leak_interval = 3_600_000

            def wrap_item(self, name: str, weight: int = 1) -> pr.RateItem:
                return pr.RateItem(name, self.clock.now(), weight=weight)

            def get(self, item: pr.RateItem) -> pr.AbstractBucket:
                if item.name not in self.buckets:
                    self.buckets[item.name] = self.create(
                        pr.RedisBucket.init, rates, client, f"pyrate:{item.name}"
                    )
                return self.buckets[item.name]

        factory = PerIdentity()
        for identity in self.identities:  # make every bucket (a SCRIPT LOAD each) before timing
            factory.get(factory.wrap_item(identity))
        limiter = pr.Limiter(factory)

        def close() -> None:
            limiter.close()
            pool.disconnect()

        return Case(
            "pyrate/sync/sliding_log",
            "pyrate",
            sync_loop(partial(limiter.try_acquire, blocking=False), self.identities),
            close,
        )

    def _loaded_calls(self) -> ScriptCalls:
        calls = script_calls(
            Policy(POLICY_NAME, LOG_RATE, algorithm="sliding_log"), self.identities
        )
        admin = self.server.client()
        sha = admin.script_load(calls.script.source)
        admin.close()
        assert sha == calls.script.sha, (sha, calls.script.sha)
        return calls

    def raw_sync(self) -> Case:
        calls = self._loaded_calls()
        client = redis.Redis.from_url(self.url)
        evalsha = client.evalsha
        sha = calls.script.sha
        token = tokens()

        def hit(call: RawCall) -> int:
            keys, head, tail = call
            if calls.has_token:
                return evalsha(sha, len(keys), *keys, *head, token(), *tail)[0]
            return evalsha(sha, len(keys), *keys, *head)[0]

        return Case("raw/sync/evalsha", "raw", sync_loop(hit, calls.calls), client.close)

    def raw_pipelined(self) -> Case:
        """64 EVALSHA per round trip of a ``redis.asyncio`` pipeline (no MULTI); each call's
        latency is its pipeline's, from queueing the first call to the last reply."""
        calls = self._loaded_calls()

        async def make() -> redis.asyncio.Redis:
            return redis.asyncio.Redis.from_url(self.url)

        client: redis.asyncio.Redis = self._await(make())
        sha = calls.script.sha
        token = tokens()
        subjects = calls.calls

        async def drive(duration_ns: int) -> tuple[int, int, list[int], int]:
            clock = time.perf_counter_ns
            lat: list[int] = []
            k = len(subjects)
            i = admitted = 0
            start = clock()
            deadline = start + duration_ns
            while True:
                t0 = clock()
                pipe = client.pipeline(transaction=False)
                for _ in range(PIPELINE):
                    keys, head, tail = subjects[i % k]
                    fresh = (token(),) if calls.has_token else ()
                    pipe.evalsha(sha, len(keys), *keys, *head, *fresh, *tail)
                    i += 1
                replies = await pipe.execute()
                t1 = clock()
                lat.extend([t1 - t0] * PIPELINE)
                admitted += sum(int(reply[0]) for reply in replies)
                if t1 >= deadline:
                    return i, t1 - start, lat, admitted

        return Case(
            f"raw/async/pipeline{PIPELINE}",
            "raw",
            lambda duration_ns: self._await(drive(duration_ns)),
            lambda: self._await(client.aclose()),
        )

    def redis_benchmark(self, path: str, clients: int, pipeline: int) -> Case:
        """The same script from ``redis-benchmark -c clients -P pipeline``: ``__rand_int__``
        (``-r``: one of ``--identities`` values) stands in the key's hash tag (and, if the
        script takes a token, twice in it). It runs on the client CPUs, as this process does."""
        core = Core()
        sample = "sample-identity"
        call = core.hit_call(Policy(POLICY_NAME, LOG_RATE, algorithm="sliding_log"), sample, 1)
        tag = core.keys.tag(POLICY_NAME, sample)
        if any(tag not in key for key in call.keys):
            raise RuntimeError(f"no hash tag {tag!r} in {call.keys}: cannot template the keys")
        placeholder = "r" * (len(tag) - 12) + "__rand_int__"  # the same length once expanded
        keys = [key.replace(tag, placeholder) for key in call.keys]
        argv = ["rb__rand_int____rand_int__" if a == call.token else str(a) for a in call.args]
        admin = self.server.client()
        admin.script_load(call.script.source)
        command = [
            path,
            "-h", "127.0.0.1",
            "-p", str(self.server.port),
            "-c", str(clients),
            "-P", str(pipeline),
            "-r", str(len(self.identities)),
            "--csv",
        ]  # fmt: skip
        script = ["EVALSHA", call.script.sha, str(len(keys)), *keys, *argv]
        rate = [0.0]  # requests/s of the last run: sizes the next one (-n) to --seconds
        case: Case

        def run(duration_ns: int) -> tuple[int, int, list[int], int]:
            n = max(500, int(rate[0] * duration_ns / 1e9)) if rate[0] else 1_000
            out = subprocess.run(
                [*command, "-n", str(n), *script],
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            ).stdout
            header, *_, row = csv.reader(io.StringIO(out))
            fields = dict(zip(header, row, strict=True))
            rate[0] = float(fields["rps"])
            case.reported_latency_us.append(
                (float(fields["p50_latency_ms"]) * 1000, float(fields["p99_latency_ms"]) * 1000)
            )
            return n, int(n / rate[0] * 1e9), [], 0

        log_pattern = keys[0].replace(placeholder, "*")

        def after(sample: Sample) -> None:
            # Admitted = entries written: one per admitted hit of cost 1, whatever the log is.
            found = list(admin.scan_iter(match=log_pattern, count=1000))
            pipe = admin.pipeline(transaction=False)
            for key in found:
                pipe.type(key)
            sizes = admin.pipeline(transaction=False)
            for key, reply in zip(found, pipe.execute(), strict=True):
                kind = reply.decode() if isinstance(reply, bytes) else reply
                if kind == "zset":
                    sizes.zcard(key)
                elif kind == "list":
                    sizes.llen(key)
            entries = sum(sizes.execute())
            sample.admitted = min(entries, sample.calls)
            failed = sum(
                fields.get("failed_calls", 0.0) + fields.get("rejected_calls", 0.0)
                for fields in sample.commandstats.values()
            )
            if failed:
                raise RuntimeError(f"{bench_name(clients, pipeline)}: {failed:.0f} failed calls")

        case = Case(bench_name(clients, pipeline), "floor", run, admin.close, after)
        return case

    def deny_cache(self, on: bool) -> Case:
        """``--deny-hits`` hits of one identity whose limit is spent (a fresh identity per run,
        spent before timing); ``deny_cache`` at its default or 0."""
        limiter = Limiter.from_url(self.url, **store_only(deny_cache=on))
        policy = Policy(POLICY_NAME + "-deny", DENY_RATE)
        limit = policy.rates[0].limit
        serial = itertools.count()
        hits = self.args.deny_hits

        def run(duration_ns: int) -> tuple[int, int, list[int], int]:
            identity = f"denied:{next(serial)}"
            for _ in range(limit):
                limiter.hit(policy, identity)
            hit = limiter.hit
            # A fixed count: the deny cache answers in about a microsecond.
            return sync_loop(lambda who: hit(policy, who).allowed, [identity], count=hits)(0)

        return Case(f"deny_cache/{'on' if on else 'off'}", "deny_cache", run, limiter.close)

    def cases(self, console: Console) -> tuple[list[Case], dict[str, str]]:
        """Every case in run order, and the reason for each one skipped.

        The order puts the two sides of every ratio next to each other, so that they run back
        to back in every round (the rotation keeps neighbours together, but for one pair per
        round): load that comes and goes on a shared machine then hits both alike."""
        sync, concurrent = partial(self.ratekeeper, concurrent=False), True
        bench = find_benchmark()
        skipped: dict[str, str] = {}
        floors: dict[tuple[int, int], list[Case]] = {FLOOR: [], CEILING: []}
        for shape in (FLOOR, CEILING):
            if bench is None:
                skipped[bench_name(*shape)] = "no redis-benchmark or valkey-benchmark on PATH"
                console.print(f"[yellow]skipping {bench_name(*shape)}:[/] no redis-benchmark")
            else:
                floors[shape].append(self.redis_benchmark(bench, *shape))
        cases = [
            sync("sliding_log"),
            *floors[FLOOR],
            self.limits(MOVING_WINDOW, concurrent=False),
            self.raw_sync(),
            self.pyrate(),
            sync("sliding_window"),
            self.limits(SLIDING_WINDOW_COUNTER, concurrent=False),
            sync("fixed_window"),
            self.limits(FIXED_WINDOW, concurrent=False),
            sync("gcra"),
            self.ratekeeper("sliding_log", concurrent),
            *floors[CEILING],
            self.limits(MOVING_WINDOW, concurrent),
            self.raw_pipelined(),
            self.ratekeeper("sliding_window", concurrent),
            self.limits(SLIDING_WINDOW_COUNTER, concurrent),
            self.ratekeeper("fixed_window", concurrent),
            self.limits(FIXED_WINDOW, concurrent),
            self.ratekeeper("gcra", concurrent),
            self.deny_cache(on=True),
            self.deny_cache(on=False),
        ]
        return cases, skipped


def display_order(cases: list[Case]) -> list[Case]:
    """Floors, ratekeeper sync, ratekeeper async, limits sync, limits async, PyrateLimiter, raw
    redis-py, deny cache; run order within each."""
    families = ["floor", "ratekeeper", "limits", "pyrate", "raw", "deny_cache"]
    return sorted(cases, key=lambda c: (families.index(c.family), "/sync/" not in c.name))


# --- measuring ---------------------------------------------------------------------------------


def run_once(console: Console, admin: redis.Redis, case: Case, seconds: float) -> Sample:
    """One run of a case; run again once if the store failed it (a stalled machine can keep a
    loopback call waiting past the timeout): a second failure stops the benchmark."""
    try:
        sample = run_case(admin, case.runner, int(seconds * 1e9))
    except ratekeeper.StorageError as exc:
        console.print(f"[yellow]{case.name}: {exc}; running it again[/]")
        sample = run_case(admin, case.runner, int(seconds * 1e9))
    if case.after is not None:
        case.after(sample)
    return sample


def measure(
    console: Console, admin: redis.Redis, cases: list[Case], args: argparse.Namespace
) -> dict[str, list[Sample]]:
    """A discarded warm-up run of each case (connections, script caches, code paths), then
    ``--rounds`` rounds in rotating order."""
    # What exists now lives for the whole run: out of the collector's way, so the collection
    # before each run (harness.reset) is short, even inside a test process.
    gc.freeze()
    for case in cases:
        run_once(console, admin, case, args.warmup)
        case.reported_latency_us.clear()
    samples: dict[str, list[Sample]] = {case.name: [] for case in cases}
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("rounds", total=args.rounds * len(cases))
        for r, order in rotations(cases, args.rounds):
            for case in order:
                progress.update(task, description=f"round {r + 1}/{args.rounds} {case.name}")
                sample = run_once(console, admin, case, args.seconds)
                samples[case.name].append(sample)
                load = sample.foreign_cpus
                other = "" if load is None else f"  other load {load:.2f} CPU"
                progress.console.print(
                    f"round {r + 1}/{args.rounds}  {case.name:34s} {sample.rate:11,.0f}/s{other}"
                )
                progress.advance(task)
    return samples


def summarize_case(case: Case, samples: list[Sample]) -> dict[str, Any]:
    out = summarize(samples, family=case.family)
    if case.reported_latency_us:
        out["latency_us"] = {
            "p50": sorted(v[0] for v in case.reported_latency_us)[len(samples) // 2],
            "p99": sorted(v[1] for v in case.reported_latency_us)[len(samples) // 2],
            "source": "redis-benchmark's own, per request, median over rounds",
        }
    else:
        out["latency_us"]["source"] = "per call, all rounds pooled"
    return out


@dataclass(frozen=True)
class Goal:
    label: str
    ours: str
    theirs: str
    metric: str  # "rate" (decisions/s) or "server_us" (server us per decision)
    target: float | None  # None: reported beside, no goal
    at_least: bool = True


def goals(tasks: int) -> list[Goal]:
    sync_log, async_log = "ratekeeper/sync/sliding_log", f"ratekeeper/async{tasks}/sliding_log"
    floor, ceiling = bench_name(*FLOOR), bench_name(*CEILING)
    out = [
        Goal("one sync caller, sliding_log / redis-benchmark -c 1 -P 1 (round-trip floor)",
             sync_log, floor, "rate", 0.85),
        Goal("limits MovingWindow, one sync caller / redis-benchmark -c 1 -P 1",
             "limits/sync/moving_window", floor, "rate", None),
        Goal("redis-py evalsha, one sync caller / redis-benchmark -c 1 -P 1",
             "raw/sync/evalsha", floor, "rate", None),
        Goal(f"{tasks} asyncio tasks, sliding_log / redis-benchmark -c 50 -P 16 (server ceiling)",
             async_log, ceiling, "rate", 0.8),
        Goal(f"limits.aio MovingWindow, {tasks} tasks / redis-benchmark -c 50 -P 16",
             f"limits/async{tasks}/moving_window", ceiling, "rate", None),
        Goal(f"redis-py asyncio pipeline of {PIPELINE} / redis-benchmark -c 50 -P 16",
             f"raw/async/pipeline{PIPELINE}", ceiling, "rate", None),
        Goal("sync sliding_log / limits MovingWindow sync", sync_log, "limits/sync/moving_window",
             "rate", 1.25),
        Goal(f"async{tasks} sliding_log / limits.aio MovingWindow async{tasks}", async_log,
             f"limits/async{tasks}/moving_window", "rate", 3.0),
        Goal("sync sliding_log / PyrateLimiter RedisBucket sync", sync_log,
             "pyrate/sync/sliding_log", "rate", None),
    ]  # fmt: skip
    for algorithm, most in MOST_SERVER_TIME.items():
        peer = PEERS[algorithm].case
        out.append(
            Goal(
                f"server us/decision: {algorithm} / limits {peer}",
                f"ratekeeper/sync/{algorithm}",
                f"limits/sync/{peer}",
                "server_us",
                most,
                at_least=False,
            )
        )
    out.append(Goal("deny cache on / off (hits/s)", "deny_cache/on", "deny_cache/off", "rate", 20))
    return out


def evaluate(samples: dict[str, list[Sample]], tasks: int) -> list[dict[str, Any]]:
    def series(name: str, metric: str) -> list[float]:
        return [s.rate if metric == "rate" else s.server_us for s in samples[name]]

    out = []
    for goal in goals(tasks):
        names = {"ours": goal.ours, "theirs": goal.theirs, "metric": goal.metric}
        if goal.ours not in samples or goal.theirs not in samples:
            out.append(
                {"goal": goal.label, "target": goal.target, "at_least": goal.at_least,
                 "skipped": "a case was skipped", **names}
            )  # fmt: skip
            continue
        ours, theirs = series(goal.ours, goal.metric), series(goal.theirs, goal.metric)
        out.append(ratio_row(goal.label, ours, theirs, goal.target, goal.at_least, **names))
    return out


# --- reporting ---------------------------------------------------------------------------------

CASE_HEADERS = (
    "case",
    "decisions/s (median)",
    "min-max",
    "p50 us",
    "p99 us",
    "server us/decision",
    "scripts/decision",
    "admitted",
)


def case_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, s in summary.items():
        d = s["decisions_per_s"]
        star = "" if s["latency_us"]["source"].startswith("per call") else "*"
        rows.append(
            [
                f"`{name}`",
                f"{d['median']:,.0f}",
                f"{d['min']:,.0f}-{d['max']:,.0f}",
                f"{s['latency_us']['p50']:.1f}{star}",
                f"{s['latency_us']['p99']:.1f}{star}",
                f"{s['server_us_per_decision']:.2f}",
                f"{s['scripts_per_decision']:.2f}",
                f"{s['admitted_fraction']:.1%}",
            ]
        )
    return rows


FAMILY_COLORS = {
    "ratekeeper": "#1f77b4",
    "limits": "#ff7f0e",
    "pyrate": "#2ca02c",
    "floor": "#7f7f7f",
    "raw": "#bcbd22",
    "deny_cache": "#9467bd",
    "web": "#17becf",
}


def draw_chart(
    path: Path, summary: dict[str, Any], title: str, middleware: dict[str, Any] | None
) -> None:
    """Horizontal bars of median decisions/s per case (min-max whiskers); the deny-cache pair,
    local answers orders of magnitude faster, on its own log-scale panel; the middleware's
    requests/s under uvicorn and wrk on a third, when its results are there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import StrMethodFormatter

    panels: list[tuple[list[str], dict[str, Any], str, bool]] = [
        (
            [n for n, s in summary.items() if s["family"] != "deny_cache"],
            {n: s["decisions_per_s"] for n, s in summary.items()},
            "decisions/s (median over rounds; whiskers: min-max)",
            False,
        ),
        (
            [n for n, s in summary.items() if s["family"] == "deny_cache"],
            {n: s["decisions_per_s"] for n, s in summary.items()},
            "hits/s of one spent identity (log scale)",
            True,
        ),
    ]
    if middleware is not None:
        cases = middleware["cases"]
        panels.append(
            (
                [f"uvicorn/{n}" for n in cases],
                {f"uvicorn/{n}": c["requests_per_s"] for n, c in cases.items()},
                f"requests/s, uvicorn + {middleware['config']['load'].strip('`')}",
                False,
            )
        )
    panels = [p for p in panels if p[0]]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(10, 0.34 * sum(len(p[0]) for p in panels) + 1.2 * len(panels) + 1),
        gridspec_kw={"height_ratios": [len(p[0]) + 0.6 for p in panels]},
        squeeze=False,
    )
    for (names, values, label, log), row in zip(panels, axes, strict=True):
        ax = row[0]
        medians = [values[n]["median"] for n in names]
        lows = [m - values[n]["min"] for m, n in zip(medians, names, strict=True)]
        highs = [values[n]["max"] - m for m, n in zip(medians, names, strict=True)]
        colors = [
            FAMILY_COLORS[summary[n]["family"]] if n in summary else FAMILY_COLORS["web"]
            for n in names
        ]
        y = range(len(names))
        ax.barh(y, medians, xerr=[lows, highs], color=colors, capsize=2, ecolor="#555555")
        ax.set_yticks(list(y), names, fontsize=8)
        ax.invert_yaxis()
        for i, (m, high) in enumerate(zip(medians, highs, strict=True)):
            ax.text(m + high, i, f"  {m:,.0f}", va="center", fontsize=7)
        if log:
            ax.set_xscale("log")
        else:
            ax.xaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
        ax.set_xlabel(label)
        ax.margins(x=0.15)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def regenerate_command(argv: list[str]) -> str:
    return shlex.join(["python", "benchmarks/compare.py", *argv])


CASE_NOTES = f"""\
| case | what runs, per decision |
| --- | --- |
| `redis-benchmark/c1-P1` | `redis-benchmark -c 1 -P 1 -r <identities>` of `EVALSHA` of ratekeeper's sliding_log script with the KEYS/ARGV `Limiter.hit` sends, `__rand_int__` in the key: the round-trip floor of one caller |
| `redis-benchmark/c50-P16` | the same with `-c 50 -P 16`: the server's ceiling for this script |
| `ratekeeper/sync/<algorithm>` | `Limiter.from_url(url, failure_mode="raise", timeout=10, connect_timeout=10, deny_cache=0, breaker=<one that never opens>).hit(policy, identity)`, one caller |
| `ratekeeper/asyncN/<algorithm>` | the same with `AsyncLimiter`, N asyncio tasks sharing it |
| `limits/sync/<strategy>` | `limits` `MovingWindowRateLimiter` / `FixedWindowRateLimiter` / `SlidingWindowCounterRateLimiter` over `RedisStorage`, `.hit(item, identity)` |
| `limits/asyncN/<strategy>` | `limits.aio` strategies over `RedisStorage("async+redis://...", implementation="redispy")`, N tasks |
| `pyrate/sync/sliding_log` | PyrateLimiter `Limiter` over a `BucketFactory` that makes one `RedisBucket.init(...)` per identity, `try_acquire(identity, blocking=False)` |
| `raw/sync/evalsha` | redis-py `evalsha` of the same script and calls (built before timing) |
| `raw/async/pipeline{PIPELINE}` | the same calls, {PIPELINE} per `redis.asyncio` pipeline round trip |
| `deny_cache/on`, `deny_cache/off` | one identity whose `{DENY_RATE}` is spent, hit again and again by one caller, with the default deny cache and with `deny_cache=0` |
"""  # noqa: E501


def machine_lines(m: dict[str, Any]) -> list[str]:
    server = m.get("server", {})
    dirty = " + uncommitted changes in src/" if m.get("ratekeeper_src_uncommitted_changes") else ""
    return markdown_table(
        ("", ""),
        [
            ["CPU", f"{m.get('cpu_model') or m.get('processor') or m['machine']}, "
                    f"{m['cpu_count']} cores"],
            ["pinning", m.get("pinning", "-")],
            ["OS", m["platform"]],
            ["Python", f"{m['python_implementation']} {m['python']}"],
            ["server", f"{server.get('flavor', '?')}-server {server.get('version', '?')}"],
            ["redis-benchmark", m.get("redis_benchmark") or "not found"],
            ["ratekeeper", f"{m['ratekeeper']} (commit {str(m.get('ratekeeper_commit'))[:12]}"
                           f"{dirty}, source sha256 {m['ratekeeper_source_sha256'][:12]})"],
            ["redis-py / hiredis", f"{m['redis_py']} / {m['hiredis'] or 'not installed'}"],
            ["limits", m["limits"]],
            ["pyrate-limiter", m["pyrate-limiter"]],
        ],
    )  # fmt: skip


def middleware_results(path: Path) -> dict[str, Any] | None:
    """``asgi_middleware.py``'s last results, if there are any (in the current format)."""
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data if "table" in data else None


def middleware_lines(data: dict[str, Any] | None) -> list[str]:
    """The page's section on the middleware under uvicorn and wrk."""
    if data is None:
        return []
    m = data["machine"]
    cfg = data["config"]
    lines = [
        "## Middleware under uvicorn and wrk",
        "",
        f"From `benchmarks/asgi_middleware.py` ({data['created']}, ratekeeper commit "
        f"{str(m.get('ratekeeper_commit'))[:12]}"
        f"{' + uncommitted changes' if m.get('ratekeeper_src_uncommitted_changes') else ''}): "
        f"{cfg['app']}, served by {cfg['server']}, loaded by {cfg['load']}; "
        f"{cfg['rounds']} rounds of {cfg['seconds_per_case']:g} s per case in rotating order; "
        f"{m.get('pinning', '')}. Requests/s are wrk's; uvicorn's CPU per request is read "
        "from /proc; ratios are medians of per-round ratios to the bare app.",
        "",
    ]
    lines += markdown_table(data["table"]["headers"], data["table"]["rows"])
    lines += ["", *[f"- {note}" for note in data.get("notes", [])], ""]
    lines += markdown_table(RATIO_HEADERS, ratio_cells(data["goals"]))
    return [*lines, ""]


def render_markdown(results: dict[str, Any], chart_name: str) -> str:
    m = results["machine"]
    cfg = results["config"]
    lines = [
        "# Performance",
        "",
        "<!-- Generated by benchmarks/compare.py: edit that script, not this file. -->",
        f"Generated by `benchmarks/compare.py` on {results['created']}. To regenerate "
        f"(about {duration(cfg['expected_seconds'])}, plus about "
        "2 min for the middleware section):",
        "",
        "```sh",
        "pip install -e '.[bench]'   # and redis-benchmark (redis-tools) and wrk on PATH",
        "python benchmarks/asgi_middleware.py",
        cfg["command"],
        "```",
        "",
        "## Machine",
        "",
        *machine_lines(m),
        "",
        "## Set-up",
        "",
        f"One private server on loopback; {m.get('pinning', 'not pinned')}: this process and "
        "`redis-benchmark` never share the server's core. The machine is shared and noisy "
        "(other jobs, including test suites, ran on both cores during these runs), so "
        "absolute numbers move from run to run; the rounds interleave every case and every "
        f"ratio is the median of per-round ratios. Each of {cfg['rounds']} round(s) runs every "
        f"case for {cfg['seconds_per_case']:g} s (the deny-cache cases: {cfg['deny_hits']:,} "
        "hits) on an empty store (`FLUSHALL SYNC`, `CONFIG RESETSTAT` first), the case order "
        f"rotating between rounds. {cfg['identities']:,} identities are hit in turn under "
        f"`{LOG_RATE}` (sliding logs: sliding_log, MovingWindow, PyrateLimiter, raw, "
        f"redis-benchmark) or `{COUNTER_RATE}` (counters), so nearly every hit is admitted.",
        "",
        CASE_NOTES,
        "Server us per decision: the `INFO commandstats` time of the script calls (`EVALSHA`; "
        "the commands a script runs are inside its time) over the decisions. Latency: per call, "
        "from just before it is issued to its result (async: including waiting for the event "
        "loop; pipelined: the pipeline's round trip); percentiles interpolate linearly between "
        "ranks.",
        "",
        "## Ratios",
        "",
        *markdown_table(RATIO_HEADERS, ratio_cells(results["goals"])),
        "",
        "## Results",
        "",
        f"![decisions/s per case]({chart_name})",
        "",
        *markdown_table(CASE_HEADERS, case_rows(results["cases"])),
    ]
    for name, reason in results["skipped"].items():
        lines.append(f"| `{name}` | skipped: {reason} | | | | | | |")
    if any(not s["latency_us"]["source"].startswith("per call") for s in results["cases"].values()):
        lines += ["", "\\* redis-benchmark's own latency per request."]
    lines += ["", *middleware_lines(results.get("middleware"))]
    worst, steal = (
        max((v or 0.0 for s in results["cases"].values() for v in s[key]), default=0.0)
        for key in ("foreign_load_cpus_per_round", "steal_cpus_per_round")
    )
    lines += [
        "## Caveats",
        "",
        "- The machine is shared: other processes used up to "
        f"{worst:.2f} CPU during a case in this run, and the hypervisor stole up to "
        f"{steal:.2f} CPU. Pinning keeps client and server off each other's core, not off "
        "other jobs'; compare the paired ratios, not absolute numbers across runs.",
        "- The cases do different work on the server: limits' moving window is a list stamped "
        "with client time and returns a bool; ratekeeper's scripts read the server's `TIME` and "
        "return remaining/reset/retry for a `Decision`; PyrateLimiter's bucket is a sorted set "
        "stamped with client time and its keys never expire (its background leak trims them; "
        "it is set to run hourly here, so its cost is not in these numbers).",
        "- redis-benchmark's decisions/s and latency are its own report; its admitted fraction "
        "counts the log entries written. It draws identities at random (`-r`), the others in "
        "turn.",
        "",
    ]
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, help="seconds per case per round (default 1)")
    parser.add_argument("--rounds", type=int, help="rounds (default 9)")
    parser.add_argument("--warmup", type=float, help="seconds per case, discarded (default 0.5)")
    parser.add_argument("--identities", type=int, default=10_000)
    parser.add_argument("--tasks", type=int, default=64, help="asyncio tasks of async cases")
    parser.add_argument("--deny-hits", type=int, default=10_000)
    parser.add_argument(
        "--quick", action="store_true", help="a short smoke run, into a temporary directory"
    )
    parser.add_argument("--out", type=Path, help="directory for the .md, .png and .json")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, short in (("seconds", 1.0, 0.3), ("rounds", 9, 1), ("warmup", 0.5, 0.1)):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    if args.seconds <= 0 or args.rounds < 1 or args.warmup < 0:
        parser.error("--seconds and --rounds must be positive, --warmup not negative")
    if args.identities < 1 or args.tasks < 1 or args.deny_hits < 1:
        parser.error("--identities, --tasks and --deny-hits must be positive")
    return args


def outputs(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """(markdown, chart, json) paths."""
    if args.out is not None:
        folder = args.out
    elif args.quick:
        folder = Path(tempfile.mkdtemp(prefix="ratekeeper-compare-"))
    else:
        return DOCS / MARKDOWN_NAME, DOCS / CHART_NAME, RESULTS
    return folder / MARKDOWN_NAME, folder / CHART_NAME, folder / JSON_NAME


def benchmark_version(path: str | None) -> str | None:
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def run_all(
    console: Console, args: argparse.Namespace, binary: ServerBinary
) -> tuple[list[Case], dict[str, list[Sample]], dict[str, str], dict[str, Any], str]:
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        with event_loop() as loop, Server(binary) as server:
            pinning = pin_clients()
            console.print(pinning)
            admin = server.client()
            console.print(f"setting up ({args.identities:,} identities) ...")
            cases, skipped = Builder(server, loop, args).cases(console)
            try:
                samples = measure(console, admin, cases, args)
                facts = server_facts(server)
            finally:
                gc.unfreeze()
                for case in cases:
                    case.close()
                admin.close()
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)  # an in-process caller (the test) gets it back
    return cases, samples, skipped, facts, pinning


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    markdown, chart, raw = outputs(args)
    out = console()
    binary = find_binary()
    bench_path = find_benchmark()
    n_cases = 2 * len(ALGORITHMS) + 2 * len(STRATEGIES) + 7
    # Each run also flushes the store and reads its statistics: about 0.3 s on this machine.
    expected = n_cases * (args.rounds * (args.seconds + 0.3) + args.warmup) + 15
    out.print(
        f"server: {binary.flavor} {binary.version} ({binary.path}); ratekeeper "
        f"{ratekeeper.__version__}, redis-py {version('redis')}, limits {version('limits')}, "
        f"pyrate-limiter {version('pyrate-limiter')}; {os.cpu_count()} CPUs; "
        f"{args.rounds} rounds x {args.seconds:g} s per case, about {expected:.0f} s"
    )
    started = time.monotonic()
    cpu0 = machine_cpu()
    cases, samples, skipped, server_info, pinning = run_all(out, args, binary)
    summary = {c.name: summarize_case(c, samples[c.name]) for c in display_order(cases)}
    ratios = evaluate(samples, args.tasks)
    print_table(out, "decisions/s (median over rounds), latency per call, server cost",
                [*CASE_HEADERS, "other load CPU (max)"],
                [[*row, f"{max_load(samples[name]) or 0:.2f}"]
                 for row, name in zip(case_rows(summary), summary, strict=True)])  # fmt: skip
    print_table(out, "ratios: medians of per-round ratios", RATIO_HEADERS, ratio_cells(ratios))
    cpu1 = machine_cpu()
    results: dict[str, Any] = {
        "benchmark": "compare",
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine_info(
            server_info,
            "limits",
            "pyrate-limiter",
            redis_benchmark=benchmark_version(bench_path),
            pinning=pinning,
        ),
        "config": {
            "command": regenerate_command(argv),
            "seconds_per_case": args.seconds,
            "rounds": args.rounds,
            "warmup_seconds": args.warmup,
            "identities": args.identities,
            "tasks": args.tasks,
            "pipeline": PIPELINE,
            "deny_hits": args.deny_hits,
            "log_rate": LOG_RATE,
            "counter_rate": COUNTER_RATE,
            "deny_rate": DENY_RATE,
            "redis_benchmark": {"floor": FLOOR, "ceiling": CEILING},
            "cases": [case.name for case in cases] + list(skipped),
            "expected_seconds": expected,
            "wall_seconds": time.monotonic() - started,
            "machine_busy_cpu_seconds": None if cpu0 is None or cpu1 is None else cpu1[0] - cpu0[0],
        },
        "cases": summary,
        "skipped": skipped,
        "goals": ratios,
        "middleware": middleware_results(MIDDLEWARE_RESULTS),
    }
    for path in (markdown, chart, raw):
        path.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(results, indent=2) + "\n")
    title = (
        f"ratekeeper {ratekeeper.__version__} vs floors and peers, {server_info['flavor']} "
        f"{server_info['version']}, {os.cpu_count()} cores, {results['created']}"
    )
    draw_chart(chart, summary, title, results["middleware"])
    markdown.write_text(render_markdown(results, chart.name))
    out.print(f"wrote {markdown}, {chart} and {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
