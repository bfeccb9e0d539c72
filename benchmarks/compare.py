"""ratekeeper beside limits, PyrateLimiter and the raw client and server ceilings, in one run.

One private Redis/Valkey server on a free loopback port (never 6379). Every round runs every case
for ``--seconds`` on an empty store (``FLUSHALL``, ``CONFIG RESETSTAT`` before each case), the case
order rotating between rounds, so every ratio pairs runs of the same round. ``--identities`` are
hit in turn under a limit that admits nearly everything: ``1000/minute`` for the log-based
algorithms (ratekeeper's sliding_log is capped at 10,000 entries), ``1000000/minute`` for the
counters.

Cases (``sync``: one blocking caller; ``async64``: 64 asyncio tasks sharing one client):

* ``ratekeeper/{sync,async64}/<algorithm>``: ``Limiter`` / ``AsyncLimiter.from_url(url,
  failure_mode="raise", timeout=2, connect_timeout=2, deny_cache=0).hit(policy, identity)`` for
  sliding_log, sliding_window, fixed_window and gcra;
* ``limits/{sync,async64}/<strategy>``: ``MovingWindowRateLimiter``, ``FixedWindowRateLimiter``
  and ``SlidingWindowCounterRateLimiter`` over ``RedisStorage`` (async: ``limits.aio`` on
  ``async+redis://`` with ``implementation="redispy"``);
* ``pyrate/sync/sliding_log``: PyrateLimiter's ``Limiter`` over one ``RedisBucket`` per identity
  (its documented ``BucketFactory`` routing), ``try_acquire(identity, blocking=False)``;
* ``raw/sync/evalsha``: redis-py ``evalsha`` of ratekeeper's own sliding_log script with the
  KEYS/ARGV ``Limiter.hit`` sends: the ceiling for one blocking client of that script;
* ``raw/async/pipeline64``: the same calls, 64 per ``redis.asyncio`` pipeline round trip: the
  ceiling of redis-py's asyncio pipelines;
* ``redis-benchmark/evalsha``: the same script from ``redis-benchmark -c 50 -P 16 -r N``: the
  server ceiling (skipped, with the reason printed, when no redis-benchmark is on PATH);
* ``deny_cache/{on,off}``: one identity whose ``10/minute`` is spent, then ``--deny-hits`` hits
  in this process, ``Limiter`` with its default deny cache and with ``deny_cache=0``.

Reported per case: the median over rounds of decisions/s, p50/p99 latency per call, server us per
decision (``INFO commandstats``: the time of every command the clients sent, found through
``MONITOR`` during the warm-up, divided by the decisions) and the fraction admitted; then the
goal ratios, each the median of per-round ratios.

Run: ``.venv/bin/python benchmarks/compare.py [--seconds 2] [--rounds 5] [--quick] [--out DIR]``
Writes ``docs/performance.md``, ``docs/performance.png`` and ``benchmarks/results/compare.json``
(``--quick``: a short smoke run into a temporary directory unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import itertools
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import limits
import limits.aio.storage
import limits.aio.strategies
import limits.storage
import limits.strategies
import pyrate_limiter
import redis
import redis.asyncio
from _measure import machine_cpu, machine_info, max_load, percentile
from _server import Server, ServerBinary, find_binary
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from single_caller import HARNESS_COMMANDS, Runner, Sample, run_case

import ratekeeper
from ratekeeper import AsyncLimiter, Limiter, Policy
from ratekeeper._core import Core
from ratekeeper._scripts import Script

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DOCS = REPO / "docs"
RESULTS = HERE / "results" / "compare.json"
MARKDOWN_NAME = "performance.md"
CHART_NAME = "performance.png"
JSON_NAME = "compare.json"

LOG_RATE = "1000/minute"  # sliding logs keep one entry per hit: ratekeeper caps them at 10,000
COUNTER_RATE = "1000000/minute"
DENY_RATE = "10/minute"
POLICY_NAME = "bench"
ALGORITHMS = ("sliding_log", "sliding_window", "fixed_window", "gcra")
#: limits' strategy per case suffix, with the rate it runs under.
LIMITS_STRATEGIES: dict[str, tuple[str, str]] = {
    "moving_window": ("MovingWindowRateLimiter", LOG_RATE),
    "fixed_window": ("FixedWindowRateLimiter", COUNTER_RATE),
    "sliding_window_counter": ("SlidingWindowCounterRateLimiter", COUNTER_RATE),
}
#: ratekeeper algorithm -> limits' nearest strategy (gcra has none: FixedWindow, the cheapest).
PEERS = {
    "sliding_log": "moving_window",
    "sliding_window": "sliding_window_counter",
    "fixed_window": "fixed_window",
    "gcra": "fixed_window",
}
REDIS_BENCH = "redis-benchmark/evalsha"
PIPELINE = 64
BENCH_CLIENTS = 50
BENCH_PIPELINE = 16

Closer = Callable[[], None]


@dataclass
class Case:
    """One benchmarked configuration: how to run it for a duration and how to clean up."""

    name: str
    family: str  # ratekeeper, limits, pyrate, ceiling, deny_cache
    runner: Runner
    close: Closer
    #: Called after each run, before the next FLUSHALL (e.g. to count what a run admitted).
    after: Callable[[Sample], None] | None = None
    #: (p50, p99) us per round, for a case whose latencies come from elsewhere (redis-benchmark).
    reported_latency_us: list[tuple[float, float]] = field(default_factory=list)
    #: Commands its clients sent (scripts' inner commands excluded), seen during the warm-up.
    top_level: frozenset[str] = frozenset()


# --- driving loops -----------------------------------------------------------------------------


def sync_loop(hit: Callable[[Any], Any], subjects: Sequence[Any]) -> Runner:
    """One blocking caller: ``hit(subject)`` (truthy when admitted) over ``subjects`` in turn."""

    def run(duration_ns: int) -> tuple[int, int, list[int], int]:
        clock = time.perf_counter_ns
        lat: list[int] = []
        append = lat.append
        k = len(subjects)
        i = admitted = 0
        start = clock()
        deadline = start + duration_ns
        while True:
            subject = subjects[i % k]
            t0 = clock()
            ok = hit(subject)
            t1 = clock()
            append(t1 - t0)
            admitted += bool(ok)
            i += 1
            if t1 >= deadline:
                return i, t1 - start, lat, admitted

    return run


def async_loop(
    loop: asyncio.AbstractEventLoop,
    hit: Callable[[Any], Awaitable[Any]],
    subjects: Sequence[Any],
    tasks: int,
) -> Runner:
    """``tasks`` closed-loop asyncio tasks on ``loop``; task w hits subjects w, w+tasks, ..."""

    async def worker(w: int, deadline: int) -> tuple[list[int], int, int]:
        clock = time.perf_counter_ns
        lat: list[int] = []
        append = lat.append
        k = len(subjects)
        i = w
        admitted = 0
        while True:
            subject = subjects[i % k]
            t0 = clock()
            ok = await hit(subject)
            t1 = clock()
            append(t1 - t0)
            admitted += bool(ok)
            i += tasks
            if t1 >= deadline:
                return lat, admitted, t1

    async def drive(duration_ns: int) -> tuple[int, int, list[int], int]:
        start = time.perf_counter_ns()
        done = await asyncio.gather(*(worker(w, start + duration_ns) for w in range(tasks)))
        lat = list(itertools.chain.from_iterable(d[0] for d in done))
        return len(lat), max(d[2] for d in done) - start, lat, sum(d[1] for d in done)

    return lambda duration_ns: loop.run_until_complete(drive(duration_ns))


# --- the raw script calls ratekeeper makes -----------------------------------------------------


@dataclass(frozen=True)
class ScriptCalls:
    """The script ``Limiter.hit`` runs and, per identity, its KEYS and ARGV split around the
    per-call token (which must stay unique: a reused token overwrites a log member)."""

    script: Script
    calls: list[tuple[tuple[str, ...], tuple[Any, ...], tuple[Any, ...]]]


def script_calls(policy: Policy, identities: Sequence[str]) -> ScriptCalls:
    core = Core()
    calls = []
    script = None
    for identity in identities:
        call = core.hit(policy, identity, 1)
        script = call.script
        at = call.args.index(call.token)
        calls.append((call.keys, call.args[:at], call.args[at + 1 :]))
    assert script is not None
    return ScriptCalls(script, calls)


def tokens() -> Callable[[], str]:
    """Unique tokens, as ratekeeper makes them: a random nonce and a counter."""
    nonce = os.urandom(6).hex()
    serial = itertools.count()
    return lambda: f"{nonce}{next(serial):x}"


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
        # Every decision comes from the store: no failing open on a slow call of a loaded machine
        # (the default timeout is 20 ms), no local answers from the deny cache.
        options: dict[str, Any] = {
            "failure_mode": "raise",
            "timeout": 2,
            "connect_timeout": 2,
            "deny_cache": 0,
        }
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

    def limits(self, strategy: str, concurrent: bool) -> Case:
        class_name, rate = LIMITS_STRATEGIES[strategy]
        item = limits.parse(rate)
        if not concurrent:
            pool = redis.ConnectionPool.from_url(self.url)
            storage = limits.storage.RedisStorage(self.url, connection_pool=pool)
            limiter = getattr(limits.strategies, class_name)(storage)
            return Case(
                f"limits/sync/{strategy}",
                "limits",
                sync_loop(partial(limiter.hit, item), self.identities),
                pool.disconnect,
            )

        async def make() -> tuple[Any, redis.asyncio.ConnectionPool]:
            apool = redis.asyncio.ConnectionPool.from_url(self.url)
            astorage = limits.aio.storage.RedisStorage(
                "async+" + self.url, implementation="redispy", connection_pool=apool
            )
            return getattr(limits.aio.strategies, class_name)(astorage), apool

        alimiter, apool = self._await(make())
        return Case(
            f"limits/async{self.args.tasks}/{strategy}",
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

        def hit(call: tuple[tuple[str, ...], tuple[Any, ...], tuple[Any, ...]]) -> int:
            keys, head, tail = call
            return evalsha(sha, len(keys), *keys, *head, token(), *tail)[0]

        return Case("raw/sync/evalsha", "ceiling", sync_loop(hit, calls.calls), client.close)

    def raw_pipelined(self) -> Case:
        """64 EVALSHA per round trip of a ``redis.asyncio`` pipeline (no MULTI); each call's
        latency is its pipeline's, from queueing the first call to the last reply."""
        calls = self._loaded_calls()
        client: redis.asyncio.Redis = self._await(_make_async_client(self.url))
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
                    pipe.evalsha(sha, len(keys), *keys, *head, token(), *tail)
                    i += 1
                replies = await pipe.execute()
                t1 = clock()
                lat.extend([t1 - t0] * PIPELINE)
                admitted += sum(int(reply[0]) for reply in replies)
                if t1 >= deadline:
                    return i, t1 - start, lat, admitted

        return Case(
            f"raw/async/pipeline{PIPELINE}",
            "ceiling",
            lambda duration_ns: self._await(drive(duration_ns)),
            lambda: self._await(client.aclose()),
        )

    def redis_benchmark(self, path: str) -> Case:
        """The same script from ``redis-benchmark``: ``__rand_int__`` (``-r``: one of
        ``--identities`` values) stands in the key's hash tag, two of them in the token."""
        core = Core()
        sample = "sample-identity"
        call = core.hit(Policy(POLICY_NAME, LOG_RATE, algorithm="sliding_log"), sample, 1)
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
            "-c", str(BENCH_CLIENTS),
            "-P", str(BENCH_PIPELINE),
            "-r", str(len(self.identities)),
            "--csv",
        ]  # fmt: skip
        script = ["EVALSHA", call.script.sha, str(len(keys)), *keys, *argv]
        rate = [0.0]  # requests/s of the last run: sizes the next one (-n) to --seconds
        case: Case

        def run(duration_ns: int) -> tuple[int, int, list[int], int]:
            n = max(2_000, int(rate[0] * duration_ns / 1e9)) if rate[0] else 10_000
            out = subprocess.run(
                [*command, "-n", str(n), *script],
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
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
            # Admitted = members written: one per admitted hit of cost 1.
            pipe = admin.pipeline(transaction=False)
            for key in admin.scan_iter(match=log_pattern, count=1000):
                pipe.zcard(key)
            members = sum(pipe.execute())
            sample.admitted = min(members, sample.calls)

        case = Case(REDIS_BENCH, "ceiling", run, admin.close, after)
        return case

    def deny_cache(self, on: bool) -> Case:
        """``--deny-hits`` hits of one identity whose limit is spent (a fresh identity per run,
        spent before timing); ``deny_cache`` at its default or 0."""
        options: dict[str, Any] = {"failure_mode": "raise", "timeout": 2, "connect_timeout": 2}
        if not on:
            options["deny_cache"] = 0
        limiter = Limiter.from_url(self.url, **options)
        policy = Policy(POLICY_NAME + "-deny", DENY_RATE)
        limit = policy.rates[0].limit
        serial = itertools.count()
        hits = self.args.deny_hits

        def run(duration_ns: int) -> tuple[int, int, list[int], int]:
            identity = f"denied:{next(serial)}"
            for _ in range(limit):
                limiter.hit(policy, identity)
            hit = limiter.hit
            clock = time.perf_counter_ns
            lat: list[int] = []
            append = lat.append
            admitted = 0
            start = clock()
            for _ in range(hits):
                t0 = clock()
                decision = hit(policy, identity)
                t1 = clock()
                append(t1 - t0)
                admitted += decision.allowed
            return hits, clock() - start, lat, admitted

        return Case(f"deny_cache/{'on' if on else 'off'}", "deny_cache", run, limiter.close)

    def cases(self, console: Console) -> tuple[list[Case], dict[str, str]]:
        """Every case in run order, and the reason for each one skipped.

        The order puts the two sides of every goal ratio next to each other, so that they run
        back to back in every round (the rotation keeps neighbours together, but for one pair
        per round): load that comes and goes on a shared machine then hits both alike."""
        sync, concurrent = partial(self.ratekeeper, concurrent=False), True
        cases = [
            sync("sliding_log"),
            self.limits("moving_window", concurrent=False),
            self.raw_sync(),
            self.pyrate(),
            sync("sliding_window"),
            self.limits("sliding_window_counter", concurrent=False),
            sync("fixed_window"),
            self.limits("fixed_window", concurrent=False),
            sync("gcra"),
            self.ratekeeper("sliding_log", concurrent),
            self.limits("moving_window", concurrent),
            self.raw_pipelined(),
            self.ratekeeper("sliding_window", concurrent),
            self.limits("sliding_window_counter", concurrent),
            self.ratekeeper("fixed_window", concurrent),
            self.limits("fixed_window", concurrent),
            self.ratekeeper("gcra", concurrent),
        ]
        skipped: dict[str, str] = {}
        bench = find_benchmark()
        if bench is None:
            skipped[REDIS_BENCH] = "no redis-benchmark or valkey-benchmark on PATH"
            console.print(f"[yellow]skipping redis-benchmark/evalsha:[/] {skipped[REDIS_BENCH]}")
        else:
            cases.append(self.redis_benchmark(bench))
        cases += [self.deny_cache(on=True), self.deny_cache(on=False)]
        return cases, skipped


def display_order(cases: list[Case]) -> list[Case]:
    """ratekeeper sync, ratekeeper async, limits sync, limits async, PyrateLimiter, ceilings,
    deny cache; run order within each."""
    families = ["ratekeeper", "limits", "pyrate", "ceiling", "deny_cache"]
    return sorted(cases, key=lambda c: (families.index(c.family), "/sync/" not in c.name))


def find_benchmark() -> str | None:
    """redis-benchmark on PATH, else valkey-benchmark, else None."""
    return shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")


async def _make_async_client(url: str) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(url)


# --- what clients send: MONITOR ----------------------------------------------------------------

_MONITOR_LINE = re.compile(rb'^\+\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]+)"')


class CommandProbe:
    """The names of the commands clients send to the server (not those a script runs, which
    MONITOR shows from client ``lua``), read from a MONITOR connection in a thread."""

    def __init__(self, port: int) -> None:
        self.names: set[str] = set()
        self._marker = f"probe-{os.urandom(4).hex()}".encode()
        self._seen_marker = threading.Event()
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.sendall(b"MONITOR\r\n")
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            lines = (buffer + data).split(b"\r\n")
            buffer = lines.pop()
            for line in lines:
                match = _MONITOR_LINE.match(line)
                if match is None or match[1] == b"lua":
                    continue
                name = match[2].decode().lower()
                if name == "echo" and self._marker in line:
                    self._seen_marker.set()
                else:
                    self.names.add(name)

    def stop(self, admin: redis.Redis) -> frozenset[str]:
        """Wait until MONITOR has shown everything sent so far, then close it."""
        admin.echo(self._marker)
        seen = self._seen_marker.wait(30)
        self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; close() alone would not
        self._thread.join(5)
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError("the MONITOR reader did not stop")
        if not seen:
            raise RuntimeError("MONITOR never showed the probe's marker")
        return frozenset(self.names - HARNESS_COMMANDS)


# --- measuring ---------------------------------------------------------------------------------


def warm_up(admin: redis.Redis, server: Server, cases: list[Case], seconds: float) -> None:
    """Run each case once (connections, script caches, code paths) under MONITOR, which shows
    the commands it sends; the numbers are discarded."""
    for case in cases:
        probe = CommandProbe(server.port)
        try:
            sample = run_case(admin, case.runner, int(seconds * 1e9))
        finally:
            case.top_level = probe.stop(admin)
        if case.after is not None:
            case.after(sample)
    for case in cases:
        case.reported_latency_us.clear()


def measure(
    console: Console, admin: redis.Redis, cases: list[Case], args: argparse.Namespace
) -> dict[str, list[Sample]]:
    samples: dict[str, list[Sample]] = {case.name: [] for case in cases}
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("rounds", total=args.rounds * len(cases))
        for r in range(args.rounds):
            order = cases[r % len(cases) :] + cases[: r % len(cases)]
            for case in order:
                progress.update(task, description=f"round {r + 1}/{args.rounds} {case.name}")
                sample = run_case(admin, case.runner, int(args.seconds * 1e9))
                if case.after is not None:
                    case.after(sample)
                samples[case.name].append(sample)
                foreign = sample.foreign_cpu_s
                elapsed = sample.elapsed_ns / 1e9
                load = "" if foreign is None else f"  other load {foreign / elapsed:.2f} CPU"
                progress.console.print(
                    f"round {r + 1}/{args.rounds}  {case.name:32s} {sample.rate:11,.0f}/s{load}"
                )
                progress.advance(task)
    return samples


def server_us(sample: Sample, top_level: frozenset[str]) -> tuple[float, float]:
    """(server us, top-level commands) per decision of one run."""
    usec = calls = 0.0
    for name, fields in sample.commandstats.items():
        if name.split("|")[0] in top_level:
            usec += fields.get("usec", 0.0)
            calls += fields.get("calls", 0.0)
    return usec / sample.calls, calls / sample.calls


def summarize(case: Case, samples: list[Sample]) -> dict[str, Any]:
    rates = [s.rate for s in samples]
    pooled = sorted(itertools.chain.from_iterable(s.latencies_ns for s in samples))
    if pooled:
        p50, p99 = percentile(pooled, 0.50) / 1000, percentile(pooled, 0.99) / 1000
        latency_source = "per call, all rounds pooled"
    else:
        p50 = statistics.median(v[0] for v in case.reported_latency_us)
        p99 = statistics.median(v[1] for v in case.reported_latency_us)
        latency_source = "redis-benchmark's own, per pipelined request, median over rounds"
    calls = sum(s.calls for s in samples)
    per_round = [server_us(s, case.top_level) for s in samples]
    merged: dict[str, dict[str, float]] = {}
    for s in samples:
        for name, fields in s.commandstats.items():
            into = merged.setdefault(name, {"calls": 0.0, "usec": 0.0})
            into["calls"] += fields.get("calls", 0.0)
            into["usec"] += fields.get("usec", 0.0)
    return {
        "family": case.family,
        "decisions_per_s": {
            "median": statistics.median(rates),
            "min": min(rates),
            "max": max(rates),
            "per_round": rates,
        },
        "latency_us": {"p50": p50, "p99": p99, "source": latency_source},
        "calls": calls,
        "admitted_fraction": sum(s.admitted for s in samples) / calls,
        "server_us_per_decision": sum(
            u * s.calls for (u, _), s in zip(per_round, samples, strict=True)
        )
        / calls,
        "server_us_per_decision_per_round": [u for u, _ in per_round],
        "top_level_commands": sorted(case.top_level),
        "top_level_commands_per_decision": sum(
            c * s.calls for (_, c), s in zip(per_round, samples, strict=True)
        )
        / calls,
        "server_commandstats": merged,
        "client_cpu_us_per_call": sum(s.client_cpu_ns for s in samples) / calls / 1000,
        "server_cpu_us_per_call": sum(s.server_cpu_s for s in samples) / calls * 1e6,
        # Other load on the machine while the case ran, in CPUs (1.0 = one core kept busy).
        "foreign_load_cpus_per_round": [
            None if s.foreign_cpu_s is None else s.foreign_cpu_s / (s.elapsed_ns / 1e9)
            for s in samples
        ],
        "steal_cpus_per_round": [
            None if s.steal_s is None else s.steal_s / (s.elapsed_ns / 1e9) for s in samples
        ],
    }


def paired(ours: list[float], theirs: list[float]) -> dict[str, Any]:
    per_round = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {
        "median": statistics.median(per_round),
        "min": min(per_round),
        "max": max(per_round),
        "per_round": per_round,
    }


@dataclass(frozen=True)
class Goal:
    label: str
    ours: str
    theirs: str
    metric: str  # "rate" (decisions/s) or "server_us" (server us per decision)
    target: float | None  # None: reported, no goal
    at_least: bool = True


def goals(tasks: int) -> list[Goal]:
    sync_log, async_log = "ratekeeper/sync/sliding_log", f"ratekeeper/async{tasks}/sliding_log"
    out = [
        Goal("sync sliding_log / limits MovingWindow sync", sync_log, "limits/sync/moving_window",
             "rate", 1.25),
        Goal("sync sliding_log / raw EVALSHA (client ceiling)", sync_log, "raw/sync/evalsha",
             "rate", 1.0),
        Goal(f"async{tasks} sliding_log / limits.aio MovingWindow async{tasks}", async_log,
             f"limits/async{tasks}/moving_window", "rate", 3.0),
        Goal(f"async{tasks} sliding_log / redis-py asyncio pipeline of {PIPELINE}", async_log,
             f"raw/async/pipeline{PIPELINE}", "rate", None),
        Goal("sync sliding_log / PyrateLimiter RedisBucket sync", sync_log,
             "pyrate/sync/sliding_log", "rate", None),
    ]  # fmt: skip
    for algorithm, peer in PEERS.items():
        out.append(
            Goal(
                f"server us/decision: {algorithm} / limits {peer}",
                f"ratekeeper/sync/{algorithm}",
                f"limits/sync/{peer}",
                "server_us",
                1.0,
                at_least=False,
            )
        )
    out.append(Goal("deny cache on / off (hits/s)", "deny_cache/on", "deny_cache/off", "rate", 20))
    return out


def evaluate(
    cases: list[Case], samples: dict[str, list[Sample]], tasks: int
) -> list[dict[str, Any]]:
    by_name = {case.name: case for case in cases}

    def series(name: str, metric: str) -> list[float]:
        if metric == "rate":
            return [s.rate for s in samples[name]]
        return [server_us(s, by_name[name].top_level)[0] for s in samples[name]]

    out = []
    for goal in goals(tasks):
        row: dict[str, Any] = {
            "goal": goal.label,
            "ours": goal.ours,
            "theirs": goal.theirs,
            "metric": goal.metric,
            "target": goal.target,
            "at_least": goal.at_least,
        }
        if goal.ours not in samples or goal.theirs not in samples:
            row["skipped"] = "a case was skipped"
            out.append(row)
            continue
        row["ratio"] = paired(series(goal.ours, goal.metric), series(goal.theirs, goal.metric))
        if goal.target is not None:
            value = row["ratio"]["median"]
            margin = (value - goal.target) / goal.target
            row["margin"] = margin if goal.at_least else -margin
            row["passed"] = row["margin"] >= 0
        out.append(row)
    return out


# --- reporting ---------------------------------------------------------------------------------


def print_tables(console: Console, summary: dict[str, Any], results: list[dict[str, Any]]) -> None:
    table = Table(title="decisions/s (median over rounds), latency per call, server cost")
    table.add_column("case", no_wrap=True)
    for header in ("decisions/s", "min-max", "p50 us", "p99 us", "server us\n/decision",
                   "cmds\n/decision", "admitted", "other load\nCPU (max)"):  # fmt: skip
        table.add_column(header, justify="right")
    for name, s in summary.items():
        d = s["decisions_per_s"]
        table.add_row(
            name,
            f"{d['median']:,.0f}",
            f"{d['min']:,.0f}-{d['max']:,.0f}",
            f"{s['latency_us']['p50']:.1f}",
            f"{s['latency_us']['p99']:.1f}",
            f"{s['server_us_per_decision']:.2f}",
            f"{s['top_level_commands_per_decision']:.2f}",
            f"{s['admitted_fraction']:.1%}",
            max_load(s["foreign_load_cpus_per_round"]),
        )
    console.print(table)
    goal_table = Table(title="goals: median of per-round ratios")
    goal_table.add_column("ratio", no_wrap=True)
    for header in ("median", "min-max", "target", "result"):
        goal_table.add_column(header, justify="right")
    for row in results:
        ratio, target = row.get("ratio"), row["target"]
        goal_table.add_row(
            row["goal"],
            "-" if ratio is None else f"{ratio['median']:.3f}",
            "-" if ratio is None else f"{ratio['min']:.3f}-{ratio['max']:.3f}",
            "-" if target is None else f"{'>=' if row['at_least'] else '<='} {target:g}",
            verdict(row),
        )
    console.print(goal_table)


def verdict(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return "skipped"
    if row["target"] is None:
        return "(no goal)"
    word = "PASS" if row["passed"] else "MISS"
    return f"{word} by {abs(row['margin']):.0%}"


FAMILY_COLORS = {
    "ratekeeper": "#1f77b4",
    "limits": "#ff7f0e",
    "pyrate": "#2ca02c",
    "ceiling": "#7f7f7f",
    "deny_cache": "#9467bd",
}


def draw_chart(path: Path, summary: dict[str, Any], title: str) -> None:
    """Horizontal bars of median decisions/s per case (min-max whiskers); the deny-cache pair,
    local answers orders of magnitude faster, on its own log-scale panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import StrMethodFormatter

    main = [n for n, s in summary.items() if s["family"] != "deny_cache"]
    deny = [n for n, s in summary.items() if s["family"] == "deny_cache"]
    fig, axes = plt.subplots(
        2 if deny else 1,
        1,
        figsize=(10, 0.34 * (len(main) + len(deny)) + 2.2),
        gridspec_kw={"height_ratios": [len(main), max(len(deny), 1) + 0.6]} if deny else None,
        squeeze=False,
    )
    for ax, names, log in ((axes[0][0], main, False), (axes[-1][0], deny, True)):
        if not names or (log and not deny):
            continue
        medians = [summary[n]["decisions_per_s"]["median"] for n in names]
        lows = [
            m - summary[n]["decisions_per_s"]["min"] for m, n in zip(medians, names, strict=True)
        ]
        highs = [
            summary[n]["decisions_per_s"]["max"] - m for m, n in zip(medians, names, strict=True)
        ]
        colors = [FAMILY_COLORS[summary[n]["family"]] for n in names]
        y = range(len(names))
        ax.barh(y, medians, xerr=[lows, highs], color=colors, capsize=2, ecolor="#555555")
        ax.set_yticks(list(y), names, fontsize=8)
        ax.invert_yaxis()
        for i, (m, high) in enumerate(zip(medians, highs, strict=True)):
            ax.text(m + high, i, f"  {m:,.0f}", va="center", fontsize=7)
        if log:
            ax.set_xscale("log")
            ax.set_xlabel("hits/s of one spent identity (log scale)")
        else:
            ax.set_xlabel("decisions/s (median over rounds; whiskers: min-max)")
            ax.xaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
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
| `ratekeeper/sync/<algorithm>` | `Limiter.from_url(url, failure_mode="raise", timeout=2, connect_timeout=2, deny_cache=0).hit(policy, identity)`, one caller |
| `ratekeeper/asyncN/<algorithm>` | the same with `AsyncLimiter`, N asyncio tasks sharing it |
| `limits/sync/<strategy>` | `limits` `MovingWindowRateLimiter` / `FixedWindowRateLimiter` / `SlidingWindowCounterRateLimiter` over `RedisStorage`, `.hit(item, identity)` |
| `limits/asyncN/<strategy>` | `limits.aio` strategies over `RedisStorage("async+redis://...", implementation="redispy")`, N tasks |
| `pyrate/sync/sliding_log` | PyrateLimiter `Limiter` over a `BucketFactory` that makes one `RedisBucket.init(...)` per identity, `try_acquire(identity, blocking=False)` |
| `raw/sync/evalsha` | redis-py `evalsha` of ratekeeper's sliding_log script with the KEYS/ARGV `Limiter.hit` sends (built before timing): the client ceiling |
| `raw/async/pipeline{PIPELINE}` | the same calls, {PIPELINE} per `redis.asyncio` pipeline round trip: redis-py's asyncio ceiling |
| `redis-benchmark/evalsha` | `redis-benchmark -c {BENCH_CLIENTS} -P {BENCH_PIPELINE} -r <identities>` of the same script, `__rand_int__` in the key: the server ceiling |
| `deny_cache/on`, `deny_cache/off` | one identity whose `{DENY_RATE}` is spent, hit again and again by one caller, with the default deny cache and with `deny_cache=0` |
"""  # noqa: E501


def render_markdown(results: dict[str, Any], chart_name: str) -> str:
    m = results["machine"]
    cfg = results["config"]
    server = m.get("server", {})
    lines = [
        "# Performance",
        "",
        "<!-- Generated by benchmarks/compare.py: edit that script, not this file. -->",
        f"Generated by `benchmarks/compare.py` on {results['created']}. To regenerate "
        f"(about {duration(cfg['expected_seconds'])}):",
        "",
        "```sh",
        "pip install -e '.[bench]'",
        cfg["command"],
        "```",
        "",
        "## Machine",
        "",
        "| | |",
        "| --- | --- |",
        f"| CPU | {m.get('cpu_model') or m.get('processor') or m['machine']}, "
        f"{m['cpu_count']} cores |",
        f"| OS | {m['platform']} |",
        f"| Python | {m['python_implementation']} {m['python']} |",
        f"| server | {server.get('flavor', '?')}-server {server.get('version', '?')} |",
        f"| redis-benchmark | {m.get('redis_benchmark') or 'not found'} |",
        f"| ratekeeper | {m['ratekeeper']} (commit {str(m.get('ratekeeper_commit'))[:12]}, "
        f"source sha256 {m['ratekeeper_source_sha256'][:12]}) |",
        f"| redis-py / hiredis | {m['redis_py']} / {m['hiredis'] or 'not installed'} |",
        f"| limits | {m['limits']} |",
        f"| pyrate-limiter | {m['pyrate-limiter']} |",
        "",
        "## Set-up",
        "",
        f"One private server on loopback, client and server on the same {m['cpu_count']}-core "
        f"machine. Each of {cfg['rounds']} round(s) runs every case for "
        f"{cfg['seconds_per_case']:g} s "
        "(the deny-cache cases: "
        f"{cfg['deny_hits']:,} hits) on an empty store (`FLUSHALL`, `CONFIG RESETSTAT` first), "
        "the case order rotating between rounds; every ratio below is the median of per-round "
        f"ratios. {cfg['identities']:,} identities are hit in turn under `{LOG_RATE}` "
        f"(sliding logs: sliding_log, MovingWindow, PyrateLimiter, raw) or `{COUNTER_RATE}` "
        "(counters), so nearly every hit is admitted.",
        "",
        CASE_NOTES,
        "Server us per decision: `INFO commandstats` time of the commands the clients sent "
        "(learned with `MONITOR` during the warm-up; the commands a script runs are inside its "
        "`EVALSHA`), over the decisions. Latency: per call, from just before it is issued to "
        "its result (async: including waiting for the event loop; pipelined: the pipeline's "
        "round trip).",
        "",
        "## Results",
        "",
        f"![decisions/s per case]({chart_name})",
        "",
        "| case | decisions/s (median) | min-max | p50 us | p99 us | server us/decision "
        "| commands/decision | admitted |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in results["cases"].items():
        d = s["decisions_per_s"]
        star = "*" if not s["latency_us"]["source"].startswith("per call") else ""
        lines.append(
            f"| `{name}` | {d['median']:,.0f} | {d['min']:,.0f}-{d['max']:,.0f} "
            f"| {s['latency_us']['p50']:.1f}{star} | {s['latency_us']['p99']:.1f}{star} "
            f"| {s['server_us_per_decision']:.2f} | {s['top_level_commands_per_decision']:.2f} "
            f"| {s['admitted_fraction']:.1%} |"
        )
    for name, reason in results["skipped"].items():
        lines.append(f"| `{name}` | skipped: {reason} | | | | | | |")
    if any(not s["latency_us"]["source"].startswith("per call") for s in results["cases"].values()):
        lines += ["", "\\* redis-benchmark's own latency per pipelined request."]
    lines += [
        "",
        "## Goals",
        "",
        "| ratio (median of per-round ratios) | measured | min-max | target | result |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for row in results["goals"]:
        ratio, target = row.get("ratio"), row["target"]
        measured = spread = "-"
        if ratio is not None:
            measured, spread = f"{ratio['median']:.2f}", f"{ratio['min']:.2f}-{ratio['max']:.2f}"
        bound = "-" if target is None else f"{'>=' if row['at_least'] else '<='} {target:g}"
        lines.append(f"| {row['goal']} | {measured} | {spread} | {bound} | {verdict(row)} |")
    worst, steal = (
        max((v or 0.0 for s in results["cases"].values() for v in s[key]), default=0.0)
        for key in ("foreign_load_cpus_per_round", "steal_cpus_per_round")
    )
    lines += [
        "",
        "## Caveats",
        "",
        "- Client, server and redis-benchmark share the machine's cores, so each one's CPU time "
        "slows the others; the paired ratios are steadier than the absolute numbers. "
        f"Other processes used up to {worst:.2f} CPU during a case in this run, and the "
        f"hypervisor stole up to {steal:.2f} CPU.",
        "- The cases do different work on the server: limits' moving window is a list stamped "
        "with client time and returns a bool; ratekeeper's scripts read the server's `TIME` and "
        "return remaining/reset/retry for a `Decision`; PyrateLimiter's bucket is a sorted set "
        "stamped with client time and its keys never expire (its background leak trims them; "
        "it is set to run hourly here, so its cost is not in these numbers).",
        "- redis-benchmark's decisions/s and latency are its own report; its admitted fraction "
        "counts the log members written.",
        f"- `raw/async/pipeline{PIPELINE}` is redis-py's own asyncio pipeline of the same calls, "
        "one pipeline in flight: a ceiling for clients built on redis-py's pipelines, not for "
        "asyncio. ratekeeper's batcher packs with hiredis and keeps two batches in flight, so "
        "it can pass it; the server's ceiling is redis-benchmark's.",
        "- One blocking caller waits for a whole round trip per decision; on a virtual machine "
        "most of it is waking the server and then the client (compare the p50 of "
        "`raw/sync/evalsha` with the server us per decision), which no client can shorten.",
        "",
    ]
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, help="seconds per case per round (default 2)")
    parser.add_argument("--rounds", type=int, help="rounds (default 5)")
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
    for name, full, short in (("seconds", 2.0, 0.3), ("rounds", 5, 1), ("warmup", 0.5, 0.1)):
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
) -> tuple[list[Case], dict[str, list[Sample]], dict[str, str], dict[str, Any]]:
    loop = asyncio.new_event_loop()
    try:
        with Server(binary) as server:
            admin = server.client()
            info = admin.info("server")
            server_info = {
                "flavor": binary.flavor,
                "path": binary.path,
                "version": binary.version,
                "redis_version": str(info.get("redis_version")),
            }
            console.print(f"setting up ({args.identities:,} identities) ...")
            cases, skipped = Builder(server, loop, args).cases(console)
            try:
                console.print(f"warm-up: {len(cases)} cases x {args.warmup:g} s, under MONITOR")
                warm_up(admin, server, cases, args.warmup)
                samples = measure(console, admin, cases, args)
            finally:
                for case in cases:
                    case.close()
                admin.close()
    finally:
        loop.close()
    return cases, samples, skipped, server_info


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    markdown, chart, raw = outputs(args)
    console = Console(width=max(Console().width, 120))
    binary = find_binary()
    bench_path = find_benchmark()
    n_cases = 2 * len(ALGORITHMS) + 2 * len(LIMITS_STRATEGIES) + 6
    expected = n_cases * (args.rounds * args.seconds + args.warmup) + 15
    console.print(
        f"server: {binary.flavor} {binary.version} ({binary.path}); ratekeeper "
        f"{ratekeeper.__version__}, redis-py {version('redis')}, limits {version('limits')}, "
        f"pyrate-limiter {version('pyrate-limiter')}; {os.cpu_count()} CPUs; "
        f"{args.rounds} rounds x {args.seconds:g} s per case, about {expected:.0f} s"
    )
    started = time.monotonic()
    cpu0 = machine_cpu()
    cases, samples, skipped, server_info = run_all(console, args, binary)
    summary = {case.name: summarize(case, samples[case.name]) for case in display_order(cases)}
    goal_rows = evaluate(cases, samples, args.tasks)
    print_tables(console, summary, goal_rows)
    cpu1 = machine_cpu()
    results: dict[str, Any] = {
        "benchmark": "compare",
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine_info(
            server_info, "limits", "pyrate-limiter", redis_benchmark=benchmark_version(bench_path)
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
            "redis_benchmark": {"clients": BENCH_CLIENTS, "pipeline": BENCH_PIPELINE},
            "cases": [case.name for case in cases] + list(skipped),
            "expected_seconds": expected,
            "wall_seconds": time.monotonic() - started,
            "machine_busy_cpu_seconds": None if cpu0 is None or cpu1 is None else cpu1[0] - cpu0[0],
        },
        "cases": summary,
        "skipped": skipped,
        "goals": goal_rows,
    }
    for path in (markdown, chart, raw):
        path.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(results, indent=2) + "\n")
    title = (
        f"ratekeeper {ratekeeper.__version__} vs peers, {server_info['flavor']} "
        f"{server_info['version']}, {os.cpu_count()} cores, {results['created']}"
    )
    draw_chart(chart, summary, title)
    markdown.write_text(render_markdown(results, chart.name))
    console.print(f"wrote {markdown}, {chart} and {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
