"""ASGI throughput: one Starlette app bare, behind ratekeeper's middleware, and under slowapi.

The same small Starlette app (one route, ``GET /`` returning ``{"ok": true}``) is driven
in-process (the ASGI callable is awaited with a minimal scope, receive and send: no sockets for
HTTP) by C concurrent asyncio tasks, one private Redis/Valkey server on loopback behind the
limiters. Requests come from 1,000 client addresses (``--clients``) in turn (the ASGI scope's
``client``), and the limits are generous, so every request is admitted and every limited request
is decided by Redis.

Each task is a closed-loop client: it sends its next request as soon as its previous response
is complete. A request's latency runs from then to its response, including its wait for the event
loop (the driver yields once before every request, as a server's per-connection task would), so
a handler that blocks the loop shows up as queueing in the other tasks' latencies.

Variants:

* ``no_limit``                        the app alone;
* ``ratekeeper/sliding_window``       ``RateLimitMiddleware`` in the app's middleware list, an
  ``AsyncLimiter`` (``failure_mode="raise"``, ``deny_cache=0``), ``1000000/minute`` per client IP;
* ``ratekeeper/sliding_log``          the same with the exact ``sliding_log`` at ``10000/minute``
  (its largest limit: ``max_log_entries``);
* ``slowapi/sliding-window-counter``  slowapi's ``@limiter.limit("1000000/minute")`` on the route,
  ``Limiter(key_func=get_remote_address, storage_uri=<redis>, strategy=...)``: the counterpart of
  ``sliding_window``;
* ``slowapi/moving-window``           the same at ``10000/minute`` with limits' exact moving
  window: the counterpart of ``sliding_log``.

slowapi decides with the blocking redis-py client inside the async endpoint, so each of its
Redis round trips stalls the event loop; that is what is measured, nothing works around it.

Every round runs each (variant, concurrency) case for the same duration on an empty store
(``FLUSHALL``, ``CONFIG RESETSTAT`` first), in an order that rotates between rounds; ratios pair
cases of the same round and concurrency. Every response's status is counted (all must be 200),
ratekeeper's responses must all carry RateLimit headers (a decision the store did not make gets
none), and ``INFO commandstats`` must show exactly one ``EVALSHA`` per ratekeeper request and no
command at all for ``no_limit``; the script exits 1 if a check fails.

Run: ``.venv/bin/python benchmarks/asgi_middleware.py [--seconds N] [--rounds R]
[--concurrency 1,32] [--clients 1000]``
Results: a table on stdout and ``benchmarks/results/asgi_middleware.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import redis
import redis.utils
from _measure import machine_cpu, machine_info, max_load, percentile, server_cpu
from _server import Server, ServerBinary, find_binary
from rich.console import Console
from rich.table import Table
from slowapi import Limiter as SlowLimiter
from slowapi import _rate_limit_exceeded_handler
from slowapi.errors import RateLimitExceeded
from slowapi.util import get_remote_address
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message

import ratekeeper
from ratekeeper import AsyncLimiter, Policy
from ratekeeper.asgi import RateLimitMiddleware
from ratekeeper.identity import client_ip

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "asgi_middleware.json"

POLICY_NAME = "bench"
WINDOW_RATE = "1000000/minute"  # sliding_window and slowapi's sliding-window-counter
LOG_RATE = "10000/minute"  # sliding_log's largest limit (max_log_entries), and moving-window
BODY = b'{"ok":true}'

# Commands the harness itself sends between cases; left out of the server-side stats.
HARNESS_COMMANDS = frozenset({"info", "config", "flushall", "ping", "client", "hello", "dbsize"})


@dataclass(frozen=True)
class Variant:
    name: str
    library: str  # "none", "ratekeeper" or "slowapi"
    algorithm: str = ""  # ratekeeper algorithm or limits/slowapi strategy
    rate: str = ""


VARIANTS = (
    Variant("no_limit", "none"),
    Variant("ratekeeper/sliding_window", "ratekeeper", "sliding_window", WINDOW_RATE),
    Variant("ratekeeper/sliding_log", "ratekeeper", "sliding_log", LOG_RATE),
    Variant("slowapi/sliding-window-counter", "slowapi", "sliding-window-counter", WINDOW_RATE),
    Variant("slowapi/moving-window", "slowapi", "moving-window", LOG_RATE),
)

# (numerator, denominator): ratekeeper over the bare app (the middleware's cost) and over slowapi
# with the matching algorithm.
RATIOS = (
    ("ratekeeper/sliding_window", "no_limit"),
    ("ratekeeper/sliding_log", "no_limit"),
    ("ratekeeper/sliding_window", "slowapi/sliding-window-counter"),
    ("ratekeeper/sliding_log", "slowapi/moving-window"),
)


# --- the app ----------------------------------------------------------------------------------


async def hello(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


def build_app(
    endpoint: Callable[[Request], Awaitable[JSONResponse]] = hello,
    middleware: list[Middleware] | None = None,
    exception_handlers: dict[Any, Any] | None = None,
) -> Starlette:
    """The one app every variant serves; only its middleware list or route decorator differs."""
    return Starlette(
        routes=[Route("/", endpoint, methods=["GET"])],
        middleware=middleware,
        exception_handlers=exception_handlers,
    )


def no_limit_app(url: str, variant: Variant) -> tuple[Starlette, Callable[[], Awaitable[None]]]:
    async def close() -> None:
        return None

    return build_app(), close


def ratekeeper_app(url: str, variant: Variant) -> tuple[Starlette, Callable[[], Awaitable[None]]]:
    # Every decision must come from the store: no failing open on a slow call of a loaded
    # machine (the default 20 ms timeout), no local answers from the deny cache.
    limiter = AsyncLimiter.from_url(
        url, failure_mode="raise", timeout=2, connect_timeout=2, deny_cache=0
    )
    policy = Policy(POLICY_NAME, variant.rate, algorithm=variant.algorithm)
    middleware = [Middleware(RateLimitMiddleware, limiter=limiter, policy=policy, key=client_ip())]
    return build_app(middleware=middleware), limiter.close


def slowapi_app(url: str, variant: Variant) -> tuple[Starlette, Callable[[], Awaitable[None]]]:
    # slowapi's documented set-up: a Limiter on app.state, its 429 handler, a decorated route.
    limiter = SlowLimiter(key_func=get_remote_address, storage_uri=url, strategy=variant.algorithm)
    app = build_app(
        endpoint=limiter.limit(variant.rate)(hello),
        exception_handlers={RateLimitExceeded: _rate_limit_exceeded_handler},
    )
    app.state.limiter = limiter

    async def close() -> None:
        limiter._storage.storage.close()

    return app, close


BUILDERS = {"none": no_limit_app, "ratekeeper": ratekeeper_app, "slowapi": slowapi_app}


# --- the driver -------------------------------------------------------------------------------


@dataclass
class Sample:
    """One case run once: its request count, wall time, per-request latencies and counters."""

    requests: int
    elapsed_ns: int
    latencies_ns: list[int]
    statuses: Counter[str]
    with_ratelimit_headers: int
    bad_bodies: int
    client_cpu_ns: int
    server_cpu_s: float = 0.0
    commandstats: dict[str, dict[str, float]] = field(default_factory=dict)
    keys_after: int = 0
    machine_busy_s: float | None = None  # all CPUs, from /proc/stat (Linux only)
    steal_s: float | None = None

    @property
    def foreign_cpu_s(self) -> float | None:
        """CPU time that neither this process nor the server used: other load on the machine."""
        if self.machine_busy_s is None:
            return None
        return max(0.0, self.machine_busy_s - self.client_cpu_ns / 1e9 - self.server_cpu_s)

    @property
    def rate(self) -> float:
        return self.requests / (self.elapsed_ns / 1e9)

    def evalsha_calls(self) -> int:
        return int(self.commandstats.get("evalsha", {}).get("calls", 0.0))


def scope_template() -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/",
        "raw_path": b"/",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"bench.local"), (b"user-agent", b"asgi-bench")],
        "server": ("127.0.0.1", 8000),
    }


async def drive(
    app: ASGIApp, concurrency: int, duration_ns: int, clients: list[tuple[str, int]]
) -> tuple[int, int, list[int], Counter[str], int, int]:
    """``concurrency`` tasks send requests back to back until the deadline; each request takes
    the next client address. Returns (requests, elapsed_ns, latencies_ns, statuses,
    responses with RateLimit headers, responses with another body)."""
    template = scope_template()
    clock = time.perf_counter_ns
    serial = itertools.count()
    k = len(clients)
    latencies: list[int] = []
    statuses: Counter[str] = Counter()
    counts = [0, 0]  # with RateLimit headers, bad bodies
    request_message = {"type": "http.request", "body": b"", "more_body": False}

    async def receive() -> Message:
        return request_message

    async def worker(deadline: int) -> None:
        append = latencies.append
        while True:
            # A fresh scope per request: Starlette and slowapi write into it (state, app, ...).
            scope = {**template, "client": clients[next(serial) % k]}
            seen: dict[str, Any] = {}

            async def send(message: Message, seen: dict[str, Any] = seen) -> None:
                kind = message["type"]
                if kind == "http.response.start":
                    seen["status"] = message["status"]
                    seen["headers"] = message.get("headers", ())
                elif kind == "http.response.body":
                    seen["body"] = seen.get("body", b"") + message.get("body", b"")

            # The request is ready now; like a server's per-connection task it then waits for
            # the event loop, so a handler that blocks the loop shows up as queueing latency.
            t0 = clock()
            await asyncio.sleep(0)
            try:
                await app(scope, receive, send)
            except Exception as exc:  # failure_mode="raise": a store error surfaces here
                seen["status"] = type(exc).__name__
            t1 = clock()
            append(t1 - t0)
            status = seen.get("status", "no response")
            statuses[str(status)] += 1
            if status == 200:
                if seen.get("body") != BODY:
                    counts[1] += 1
                if any(name == b"ratelimit" for name, _ in seen["headers"]):
                    counts[0] += 1
            if t1 >= deadline:
                return

    start = clock()
    deadline = start + duration_ns
    await asyncio.gather(*(worker(deadline) for _ in range(concurrency)))
    elapsed = clock() - start
    return len(latencies), elapsed, latencies, statuses, counts[0], counts[1]


async def run_case(
    admin: redis.Redis,
    app: ASGIApp,
    concurrency: int,
    duration_ns: int,
    clients: list[tuple[str, int]],
) -> Sample:
    """Run one case from an empty store with fresh server stats. The admin calls block the
    loop, but only between cases."""
    admin.flushall()
    gc.collect()
    admin.config_resetstat()
    cpu0 = server_cpu(admin)
    machine0 = machine_cpu()
    proc0 = time.process_time_ns()
    requests, elapsed, lat, statuses, headed, bad = await drive(
        app, concurrency, duration_ns, clients
    )
    proc1 = time.process_time_ns()
    machine1 = machine_cpu()
    cpu1 = server_cpu(admin)
    stats = {
        name.removeprefix("cmdstat_"): {
            key: float(value)
            for key, value in fields.items()
            if key in ("calls", "usec", "usec_per_call", "failed_calls", "rejected_calls")
        }
        for name, fields in admin.info("commandstats").items()
        if name.removeprefix("cmdstat_").split("|")[0] not in HARNESS_COMMANDS
    }
    sample = Sample(
        requests, elapsed, lat, statuses, headed, bad, proc1 - proc0, cpu1 - cpu0, stats
    )
    sample.keys_after = int(admin.dbsize())
    if machine0 is not None and machine1 is not None:
        sample.machine_busy_s = machine1[0] - machine0[0]
        sample.steal_s = machine1[1] - machine0[1]
    return sample


# --- checks and summaries ---------------------------------------------------------------------


def check(variant: Variant, sample: Sample, warmup: bool = False) -> list[str]:
    """What is wrong with one run, if anything. A warm-up run may load scripts (NOSCRIPT, then
    SCRIPT LOAD): only its statuses and bodies are checked."""
    problems = []
    if set(sample.statuses) != {"200"}:
        problems.append(f"statuses {dict(sample.statuses)} (all 200 expected)")
    if sample.bad_bodies:
        problems.append(f"{sample.bad_bodies} responses with a body other than {BODY!r}")
    if warmup:
        return problems
    if variant.library == "none" and sample.commandstats:
        problems.append(f"Redis got commands without a limiter: {sorted(sample.commandstats)}")
    if variant.library == "ratekeeper":
        # Redis 7 also counts the commands a script runs (TIME, ZADD, HSET...): EVALSHA itself
        # is the one the client sent.
        if sample.evalsha_calls() != sample.requests:
            problems.append(
                f"{sample.evalsha_calls()} EVALSHA for {sample.requests} requests (1 each expected)"
            )
        if sample.with_ratelimit_headers != sample.requests:
            problems.append(
                f"{sample.requests - sample.with_ratelimit_headers} responses without RateLimit "
                "headers (decisions the store did not make)"
            )
    for name, fields in sample.commandstats.items():
        if fields.get("failed_calls") or fields.get("rejected_calls"):
            problems.append(f"{name}: failed/rejected calls {fields}")
    return problems


def summarize(samples: list[Sample]) -> dict[str, Any]:
    rates = [s.rate for s in samples]
    pooled = sorted(itertools.chain.from_iterable(s.latencies_ns for s in samples))
    requests = sum(s.requests for s in samples)
    statuses: Counter[str] = Counter()
    for s in samples:
        statuses.update(s.statuses)
    merged: dict[str, dict[str, float]] = {}
    for s in samples:
        for name, fields in s.commandstats.items():
            into = merged.setdefault(name, {"calls": 0.0, "usec": 0.0})
            into["calls"] += fields.get("calls", 0.0)
            into["usec"] += fields.get("usec", 0.0)
    for fields in merged.values():
        fields["usec_per_call"] = fields["usec"] / fields["calls"] if fields["calls"] else 0.0
    evalsha = merged.get("evalsha", {"calls": 0.0, "usec": 0.0})
    return {
        "requests_per_s": {
            "median": statistics.median(rates),
            "min": min(rates),
            "max": max(rates),
            "per_round": rates,
        },
        "latency_us": {
            "p50": percentile(pooled, 0.50) / 1000,
            "p90": percentile(pooled, 0.90) / 1000,
            "p99": percentile(pooled, 0.99) / 1000,
            "p999": percentile(pooled, 0.999) / 1000,
            "mean": statistics.fmean(pooled) / 1000,
            "max": pooled[-1] / 1000,
            "samples": len(pooled),
        },
        "requests": requests,
        "statuses": dict(statuses),
        "with_ratelimit_headers": sum(s.with_ratelimit_headers for s in samples),
        "client_cpu_us_per_request": sum(s.client_cpu_ns for s in samples) / requests / 1000,
        "server_cpu_us_per_request": sum(s.server_cpu_s for s in samples) / requests * 1e6,
        "server_evalsha_calls": int(evalsha["calls"]),
        "server_evalsha_calls_per_request": evalsha["calls"] / requests,
        "server_evalsha_us_per_call": evalsha["usec"] / evalsha["calls"]
        if evalsha["calls"]
        else None,
        "server_commandstats": merged,
        "keys_after_case_per_round": [s.keys_after for s in samples],
        # Other load on the machine while the case ran, in CPUs (1.0 = one core kept busy).
        "foreign_load_cpus_per_round": [
            None if s.foreign_cpu_s is None else s.foreign_cpu_s / (s.elapsed_ns / 1e9)
            for s in samples
        ],
        "steal_cpus_per_round": [
            None if s.steal_s is None else s.steal_s / (s.elapsed_ns / 1e9) for s in samples
        ],
    }


def case_name(variant: str, concurrency: int) -> str:
    return f"{variant} C={concurrency}"


def paired_ratios(
    samples: dict[str, list[Sample]], concurrencies: list[int]
) -> dict[str, dict[str, Any]]:
    """Requests/s of one case over another's at the same concurrency, round by round; also the
    time each request gains or loses (1/rate difference, in µs of wall time per request)."""
    ratios: dict[str, dict[str, Any]] = {}
    for concurrency in concurrencies:
        for top, bottom in RATIOS:
            ours = samples[case_name(top, concurrency)]
            theirs = samples[case_name(bottom, concurrency)]
            per_round = [a.rate / b.rate for a, b in zip(ours, theirs, strict=True)]
            added = [1e6 / a.rate - 1e6 / b.rate for a, b in zip(ours, theirs, strict=True)]
            ratios[f"{top} / {bottom} C={concurrency}"] = {
                "numerator": top,
                "denominator": bottom,
                "concurrency": concurrency,
                "median": statistics.median(per_round),
                "min": min(per_round),
                "max": max(per_round),
                "per_round": per_round,
                "added_us_per_request_median": statistics.median(added),
                "added_us_per_request_per_round": added,
            }
    return ratios


# --- running ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per case per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--concurrency", default="1,32", help="comma-separated numbers of concurrent tasks"
    )
    parser.add_argument("--clients", type=int, default=1000, help="distinct client addresses")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds per case, discarded")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error("--concurrency must be comma-separated integers")
    if args.seconds <= 0 or args.rounds < 1 or args.warmup < 0:
        parser.error("--seconds and --rounds must be positive")
    if not 1 <= args.clients <= 65536 or min(args.concurrency) < 1:
        parser.error("--clients must be 1..65536 and every concurrency positive")
    return args


async def run_all(
    console: Console, args: argparse.Namespace, server: Server
) -> tuple[dict[str, list[Sample]], list[str], str]:
    """Build every app, warm each case up, then run every case in rotating order each round."""
    admin = server.client()
    clients = [(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", 40000) for i in range(args.clients)]
    apps: dict[str, tuple[Variant, ASGIApp]] = {}
    closers = []
    for variant in VARIANTS:
        app, close = BUILDERS[variant.library](server.url, variant)
        apps[variant.name] = (variant, app)
        closers.append(close)
    cases = [(v, c) for c in args.concurrency for v in apps]
    names = [case_name(v, c) for v, c in cases]
    expected = len(cases) * (args.rounds * args.seconds + args.warmup)
    console.print(
        f"{len(apps)} variants x {len(args.concurrency)} concurrencies x {args.rounds} rounds x "
        f"{args.seconds:g} s, {args.clients} client addresses, about {expected:.0f} s"
    )
    problems: list[str] = []
    for (variant, concurrency), name in zip(cases, names, strict=True):
        spec, app = apps[variant]
        sample = await run_case(admin, app, concurrency, int(args.warmup * 1e9), clients)
        problems += [f"warm-up {name}: {p}" for p in check(spec, sample, warmup=True)]

    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for r in range(args.rounds):
        shift = r % len(cases)
        for (variant, concurrency), name in zip(
            cases[shift:] + cases[:shift], names[shift:] + names[:shift], strict=True
        ):
            spec, app = apps[variant]
            sample = await run_case(admin, app, concurrency, int(args.seconds * 1e9), clients)
            samples[name].append(sample)
            problems += [f"round {r + 1} {name}: {p}" for p in check(spec, sample)]
            foreign = sample.foreign_cpu_s
            load = "" if foreign is None else f"  other load {foreign / args.seconds:.2f} CPU"
            console.print(
                f"round {r + 1}/{args.rounds}  {name:38s} {sample.rate:9,.0f} req/s"
                f"  EVALSHA {sample.evalsha_calls():7,d}{load}"
            )
    for close in closers:
        await close()
    admin.close()
    loop = type(asyncio.get_running_loop())
    return samples, problems, f"{loop.__module__}.{loop.__qualname__}"


def _statuses(s: dict[str, Any]) -> str:
    return ", ".join(f"{code} x {n:,}" for code, n in sorted(s["statuses"].items()))


def print_tables(
    console: Console,
    args: argparse.Namespace,
    summary: dict[str, dict[str, Any]],
    ratios: dict[str, dict[str, Any]],
) -> None:
    table = Table(
        title=f"in-process ASGI, {args.rounds} rounds x {args.seconds:g} s per case, "
        f"{args.clients} client addresses"
    )
    table.add_column("variant", no_wrap=True)
    table.add_column("C", justify="right")
    for header in (
        "req/s\nmedian",
        "min-max",
        "p50\nus",
        "p99\nus",
        "client\nCPU us",
        "server\nCPU us",
        "EVALSHA\nper req",
        "EVALSHA\nserver us",
        "statuses (all rounds)",
        "other load\nCPU (max)",
    ):
        table.add_column(header, justify="right")
    for concurrency in args.concurrency:
        for variant in VARIANTS:
            s = summary[case_name(variant.name, concurrency)]
            d = s["requests_per_s"]
            ev = s["server_evalsha_us_per_call"]
            table.add_row(
                variant.name,
                str(concurrency),
                f"{d['median']:,.0f}",
                f"{d['min']:,.0f}-{d['max']:,.0f}",
                f"{s['latency_us']['p50']:.0f}",
                f"{s['latency_us']['p99']:.0f}",
                f"{s['client_cpu_us_per_request']:.0f}",
                f"{s['server_cpu_us_per_request']:.1f}",
                f"{s['server_evalsha_calls_per_request']:.3f}",
                "-" if ev is None else f"{ev:.1f}",
                _statuses(s),
                max_load(s["foreign_load_cpus_per_round"]),
                end_section=variant is VARIANTS[-1],
            )
    console.print(table)
    worst = max(v or 0.0 for s in summary.values() for v in s["foreign_load_cpus_per_round"])
    if worst > 0.2:
        console.print(
            f"[bold yellow]warning:[/] other processes used up to {worst:.2f} CPU during a case: "
            "absolute numbers are unreliable; prefer the paired ratios, or rerun on a quiet machine"
        )

    ratio_table = Table(title="requests/s ratios, paired within each round")
    ratio_table.add_column("ratio", no_wrap=True)
    ratio_table.add_column("C", justify="right")
    ratio_table.add_column("median", justify="right")
    ratio_table.add_column("min-max", justify="right")
    ratio_table.add_column("per round", justify="right")
    ratio_table.add_column("wall us/req\nadded (median)", justify="right")
    for ratio in ratios.values():
        ratio_table.add_row(
            f"{ratio['numerator']} / {ratio['denominator']}",
            str(ratio["concurrency"]),
            f"{ratio['median']:.3f}",
            f"{ratio['min']:.3f}-{ratio['max']:.3f}",
            " ".join(f"{v:.3f}" for v in ratio["per_round"]),
            f"{ratio['added_us_per_request_median']:+.0f}",
            end_section=ratio["denominator"] == RATIOS[-1][1],
        )
    console.print(ratio_table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=max(Console().width, 160))
    binary: ServerBinary = find_binary()
    console.print(f"server: {binary.flavor} {binary.version} ({binary.path})")
    console.print(
        f"starlette {version('starlette')}, slowapi {version('slowapi')} (limits "
        f"{version('limits')}), redis-py {version('redis')} (hiredis: "
        f"{redis.utils.HIREDIS_AVAILABLE}), ratekeeper {ratekeeper.__version__}, "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    started = time.monotonic()
    with Server(binary) as server:
        info = server.client().info("server")
        server_info = {
            "flavor": binary.flavor,
            "path": binary.path,
            "version": binary.version,
            "redis_version": str(info.get("redis_version")),
            "valkey_version": str(info["valkey_version"]) if "valkey_version" in info else None,
        }
        samples, problems, event_loop = asyncio.run(run_all(console, args, server))
    wall = time.monotonic() - started
    summary = {name: summarize(values) for name, values in samples.items()}
    ratios = paired_ratios(samples, args.concurrency)
    print_tables(console, args, summary, ratios)
    if problems:
        console.print(f"[bold red]{len(problems)} check(s) failed:[/]")
        for problem in problems:
            console.print(f"  {problem}")
    else:
        console.print(
            "checks passed: every response 200 with the app's body; ratekeeper: one EVALSHA "
            "per request and RateLimit headers on every response; no_limit: no Redis commands"
        )

    results = {
        "benchmark": "asgi_middleware",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(
            server_info, "starlette", "slowapi", "limits", event_loop=event_loop
        ),
        "config": {
            "seconds_per_case": args.seconds,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "client_addresses": args.clients,
            "warmup_seconds": args.warmup,
            "driver": "ASGI callable awaited in-process with a minimal scope (no HTTP sockets)",
            "app": "Starlette, one route GET / -> JSONResponse({'ok': True})",
            "ratekeeper": "RateLimitMiddleware via Starlette middleware=[...], key=client_ip(), "
            "AsyncLimiter.from_url(url, failure_mode='raise', timeout=2, connect_timeout=2, "
            "deny_cache=0)",
            "slowapi": "@limiter.limit(rate) on the route; Limiter(key_func=get_remote_address, "
            "storage_uri=url, strategy=...), headers_enabled left False (its default)",
            "variants": [vars(v) for v in VARIANTS],
            "policy_name": POLICY_NAME,
            "wall_seconds": wall,
        },
        "cases": summary,
        "ratios": ratios,
        "checks": {"passed": not problems, "problems": problems},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {args.output} ({wall:.0f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
