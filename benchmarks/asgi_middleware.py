"""What ratekeeper's ASGI middleware costs a real server: uvicorn and wrk, beside the bare app and
slowapi.

One trivial Starlette app (one route, ``GET /`` returning ``{"ok": true}``) is served by uvicorn
(1 worker, uvloop, httptools, no access log), one server process per variant, each started once:

* ``bare``: the app alone;
* ``ratekeeper/admitted``: ``RateLimitMiddleware`` in the app's middleware list on an
  ``AsyncLimiter.from_url(<redis>, failure_mode="raise", timeout=10)`` (and a breaker that never
  opens), ``sliding_window`` at
  ``100000000/minute`` per client IP: every request admitted, one ``EVALSHA`` each;
* ``ratekeeper/denied``: the same middleware at ``1/hour``: after the first request every one is
  denied (429) from the limiter's deny cache (its default), with no store call;
* ``slowapi``: slowapi's documented set-up, ``@limiter.limit("100000000/minute")`` on the route,
  ``Limiter(key_func=get_remote_address, storage_uri=<redis>)`` (its default fixed window) on
  ``app.state`` and its 429 handler: every request admitted.

``wrk -t1 -c32 -d<seconds>s --latency`` loads one variant at a time. With two or more CPUs,
uvicorn runs on its own CPU and Redis and wrk on another (``sched_setaffinity``), so the server
measured has a core to itself. Every round runs each variant once on an empty store
(``FLUSHALL``, ``CONFIG RESETSTAT`` first), in an order that rotates between rounds; the ratios
to the bare app are medians of per-round ratios. Checks (exit 1 if one fails): bare, admitted
and slowapi answer only 2xx; denied answers only 429 and makes at most a few script calls;
admitted makes exactly one script call per request, bare none.

Run: ``python benchmarks/asgi_middleware.py [--seconds 3] [--rounds 8] [--connections 32]``
Results: a table on stdout and ``benchmarks/results/asgi_middleware.json``, which
``benchmarks/compare.py`` renders into ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import redis
from _harness import (
    RATIO_HEADERS,
    Server,
    commandstats,
    console,
    find_binary,
    machine_cpu,
    machine_info,
    pinned,
    print_table,
    ratio_cells,
    ratio_row,
    reset,
    rotations,
    server_facts,
    server_time,
    split_cpus,
    spread,
    store_only,
)
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ratekeeper._engine.guard import DEFAULT_DENY_CACHE_MAX_AGE

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "asgi_middleware.json"

ADMIT_RATE = "100000000/minute"
DENY_RATE = "1/hour"
#: variant -> (the least ratio to the bare app it should reach, or None: shown beside).
VARIANTS: dict[str, float | None] = {
    "bare": None,
    "ratekeeper/admitted": 0.7,
    "ratekeeper/denied": 0.85,
    "slowapi": None,
}


# --- the apps (built in the uvicorn process) ---------------------------------------------------


async def hello(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


def build_app(variant: str, url: str) -> Starlette:
    """The one app every variant serves; only its middleware or route decorator differs."""
    routes = [Route("/", hello, methods=["GET"])]
    if variant == "bare":
        return Starlette(routes=routes)
    if variant.startswith("ratekeeper/"):
        from ratekeeper import AsyncLimiter, Policy
        from ratekeeper.asgi import RateLimitMiddleware
        from ratekeeper.identity import client_ip

        # Every admitted request is decided by the store, whatever the machine's load; the deny
        # cache is left at its default.
        limiter = AsyncLimiter.from_url(url, **store_only(deny_cache=True))
        rate = ADMIT_RATE if variant == "ratekeeper/admitted" else DENY_RATE
        policy = Policy("bench", rate, algorithm="sliding_window")
        middleware = [
            Middleware(RateLimitMiddleware, limiter=limiter, policy=policy, key=client_ip())
        ]
        return Starlette(routes=routes, middleware=middleware)
    if variant == "slowapi":
        from slowapi import Limiter, _rate_limit_exceeded_handler
        from slowapi.errors import RateLimitExceeded
        from slowapi.util import get_remote_address

        slow = Limiter(key_func=get_remote_address, storage_uri=url)
        app = Starlette(
            routes=[Route("/", slow.limit(ADMIT_RATE)(hello), methods=["GET"])],
            exception_handlers={RateLimitExceeded: _rate_limit_exceeded_handler},
        )
        app.state.limiter = slow
        return app
    raise ValueError(f"unknown variant {variant!r}")


def serve(variant: str, url: str, port: int) -> None:
    """Run in the child process: uvicorn, 1 worker, uvloop, httptools."""
    import uvicorn

    uvicorn.run(
        build_app(variant, url),
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        workers=1,
        access_log=False,
        log_level="warning",
    )


# --- the load ----------------------------------------------------------------------------------


@dataclass
class Run:
    """One wrk run against one variant."""

    requests: int
    seconds: float
    rate: float
    non_2xx: int
    socket_errors: int
    latency_ms: dict[str, float]
    script_calls: int
    server_us_per_request: float
    machine_busy_cpus: float | None
    #: uvicorn's CPU time per request (all threads, from /proc): steadier than requests/s on a
    #: shared machine, since time the process waits for a core is not in it.
    app_cpu_us_per_request: float


TICK = os.sysconf("SC_CLK_TCK")
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(number) * _UNITS[unit]


def parse_wrk(out: str) -> tuple[int, float, float, int, int, dict[str, float]]:
    """(requests, seconds, requests/s, non-2xx/3xx, socket errors, latency percentiles ms)."""
    total = re.search(r"(\d+) requests in ([\d.]+)(ms|s|m),", out)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if total is None or rate is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    seconds = float(total[2]) * {"ms": 1e-3, "s": 1.0, "m": 60.0}[total[3]]
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    latency = {
        f"p{m[1]}": _ms(m[2])
        for m in re.finditer(r"^\s*(50|75|90|99)(?:\.0+)?%\s+([\d.]+(?:us|ms|s))\s*$", out, re.M)
    }
    for key in ("p50", "p75", "p90", "p99"):
        latency.setdefault(key, math.nan)  # shown as nan: the output is in the results
    return (
        int(total[1]),
        seconds,
        float(rate[1]),
        int(non_2xx[1]) if non_2xx else 0,
        sum(int(v) for v in errors.groups()) if errors else 0,
        latency,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    return port if port != 6379 else free_port()


def wait_until_serving(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"uvicorn on {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                if sock.recv(64).startswith(b"HTTP/1.1"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"uvicorn on {port} did not answer within 30 s")


def load(
    wrk: str, port: int, args: argparse.Namespace, seconds: float, cpus: set[int] | None
) -> str:
    # A 10 s timeout (wrk's default is 2 s): a stalled shared machine is not a failed request.
    command = [
        wrk,
        "-t1",
        f"-c{args.connections}",
        f"-d{seconds}s",
        "--timeout",
        "10s",
        "--latency",
    ]
    return subprocess.run(
        pinned([*command, f"http://127.0.0.1:{port}/"], cpus),
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def drained(pid: int) -> None:
    """Wait until the app server has finished what wrk left in flight (it keeps working on a
    loaded machine after wrk stops): until its CPU time has not grown for 0.3 s, at most 10 s.
    Its calls then count to this run, not the next."""
    deadline = time.monotonic() + 10
    before, still = process_cpu(pid), 0
    while time.monotonic() < deadline and still < 3:
        time.sleep(0.1)
        now = process_cpu(pid)
        still = still + 1 if now == before else 0
        before = now


def run_once(
    admin: redis.Redis,
    wrk: str,
    port: int,
    pid: int,
    args: argparse.Namespace,
    cpus: set[int] | None,
) -> Run:
    reset(admin)
    busy0 = machine_cpu()
    cpu0 = process_cpu(pid)
    requests, seconds, rate, non_2xx, errors, latency = parse_wrk(
        load(wrk, port, args, args.seconds, cpus)
    )
    busy1 = machine_cpu()
    drained(pid)
    cpu1 = process_cpu(pid)
    usec, calls = server_time(commandstats(admin))
    return Run(
        requests,
        seconds,
        rate,
        non_2xx,
        errors,
        latency,
        int(calls),
        usec / requests,
        None if busy0 is None or busy1 is None else (busy1[0] - busy0[0]) / seconds,
        (cpu1 - cpu0) / requests * 1e6,
    )


def check(variant: str, run: Run, connections: int) -> list[str]:
    """What is wrong with one run, if anything."""
    problems = []
    if run.socket_errors:
        problems.append(f"{run.socket_errors} socket errors")
    if variant == "ratekeeper/denied":
        # On an empty store the first request is admitted (1/hour); a cached denial answers
        # for DEFAULT_DENY_CACHE_MAX_AGE, then the store is asked again, by at most every
        # connection in flight at that moment.
        if run.requests - run.non_2xx > 1:
            problems.append(f"{run.requests - run.non_2xx} of {run.requests} not denied")
        asks = 1 + math.ceil(run.seconds / DEFAULT_DENY_CACHE_MAX_AGE)
        if run.script_calls > asks * connections:
            problems.append(f"{run.script_calls} script calls (the deny cache should answer)")
    elif run.non_2xx:
        problems.append(f"{run.non_2xx} of {run.requests} responses not 2xx")
    if variant == "bare" and run.script_calls:
        problems.append(f"{run.script_calls} script calls without a limiter")
    # wrk counts the responses it completed; a request cut off at the deadline may still have
    # been decided, so allow one per connection in flight.
    if variant == "ratekeeper/admitted" and not 0 <= run.script_calls - run.requests <= connections:
        problems.append(f"{run.script_calls} script calls for {run.requests} requests")
    return [f"{variant}: {p}" for p in problems]


# --- main --------------------------------------------------------------------------------------


def summarize_runs(runs: dict[str, list[Run]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Per variant: requests/s, ratios to the bare app, CPU and latency; then the ratio rows."""
    bare = [run.rate for run in runs["bare"]]
    bare_cpu = [run.app_cpu_us_per_request for run in runs["bare"]]
    cases: dict[str, Any] = {}
    for variant, values in runs.items():
        cases[variant] = {
            "requests_per_s": spread([run.rate for run in values]),
            "vs_bare": spread([run.rate / b for run, b in zip(values, bare, strict=True)]),
            "app_cpu_us_per_request": spread([run.app_cpu_us_per_request for run in values]),
            "cpu_vs_bare": spread(
                [b / run.app_cpu_us_per_request for run, b in zip(values, bare_cpu, strict=True)]
            ),
            "latency_ms": {k: statistics.median(v.latency_ms[k] for v in values)
                           for k in ("p50", "p75", "p90", "p99")},
            "statuses": {
                "2xx": sum(run.requests - run.non_2xx for run in values),
                "other": sum(run.non_2xx for run in values),
            },
            "script_calls_per_request": sum(v.script_calls for v in values)
            / sum(v.requests for v in values),
            "server_us_per_request": sum(v.server_us_per_request * v.requests for v in values)
            / sum(v.requests for v in values),
            "machine_busy_cpus_per_round": [run.machine_busy_cpus for run in values],
        }  # fmt: skip
    goals = []
    for variant, target in VARIANTS.items():
        if variant == "bare":
            continue
        goals.append(
            ratio_row(
                f"{variant} / bare (requests/s)", [r.rate for r in runs[variant]], bare, target
            )
        )
        goals.append(
            ratio_row(
                f"{variant} / bare (by uvicorn CPU per request: bare's over this one's)",
                bare_cpu,
                [r.app_cpu_us_per_request for r in runs[variant]],
                None,
            )
        )
    return cases, goals


def case_table(cases: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The cases as a table (headers, rows): printed here, and rendered into
    docs/performance.md by compare.py from the results file."""
    headers = ["case", "requests/s", "min-max", "/ bare", "uvicorn CPU us/request",
               "bare's CPU / this", "p50 ms", "p99 ms", "scripts/request", "non-2xx"]  # fmt: skip
    rows = [
        [
            f"`{name}`",
            f"{c['requests_per_s']['median']:,.0f}",
            f"{c['requests_per_s']['min']:,.0f}-{c['requests_per_s']['max']:,.0f}",
            f"{c['vs_bare']['median']:.2f}",
            f"{c['app_cpu_us_per_request']['median']:.0f}",
            f"{c['cpu_vs_bare']['median']:.2f}",
            f"{c['latency_ms']['p50']:.2f}",
            f"{c['latency_ms']['p99']:.2f}",
            f"{c['script_calls_per_request']:.3f}",
            f"{c['statuses']['other']:,}",
        ]
        for name, c in cases.items()
    ]
    return headers, rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=int, default=3, help="seconds per case per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1, help="seconds per case, discarded")
    parser.add_argument("--connections", type=int, default=32, help="wrk -c")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--serve", nargs=3, metavar=("VARIANT", "URL", "PORT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1 or args.connections < 1 or args.warmup <= 0:
        parser.error("--seconds, --rounds, --warmup and --connections must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        variant, url, port = args.serve
        serve(variant, url, int(port))
        return 0
    out = console()
    wrk = shutil.which("wrk")
    if wrk is None:
        out.print("wrk is not on PATH (Debian: apt-get install -y wrk)")
        return 1
    split = split_cpus()
    # Redis and wrk on the first CPU, uvicorn alone on the others.
    load_cpus, app_cpus = (None, None) if split is None else split
    pinning = (
        "not pinned (one usable CPU)"
        if split is None
        else f"uvicorn on CPU {','.join(map(str, sorted(split[1])))}, Redis and wrk on CPU "
        f"{','.join(map(str, sorted(split[0])))} (sched_setaffinity)"
    )
    started = time.monotonic()
    binary = find_binary()
    problems: list[str] = []
    runs: dict[str, list[Run]] = {variant: [] for variant in VARIANTS}
    with Server(binary) as server:
        admin = server.client()
        facts = server_facts(server)
        ports = {variant: free_port() for variant in VARIANTS}
        procs = {
            variant: subprocess.Popen(
                pinned(
                    [sys.executable, __file__, "--serve", variant, server.url, str(port)], app_cpus
                ),
            )
            for variant, port in ports.items()
        }
        try:
            for variant, port in ports.items():
                wait_until_serving(port, procs[variant])
            out.print(f"{pinning}; warming up {len(VARIANTS)} servers for {args.warmup:g} s each")
            for variant, port in ports.items():
                reset(admin)
                load(wrk, port, args, args.warmup, load_cpus)
                drained(procs[variant].pid)
            for r, order in rotations(list(VARIANTS), args.rounds):
                for variant in order:
                    run = run_once(admin, wrk, ports[variant], procs[variant].pid, args, load_cpus)
                    runs[variant].append(run)
                    problems += check(variant, run, args.connections)
                    out.print(
                        f"round {r + 1}/{args.rounds}  {variant:22s} {run.rate:9,.0f} req/s  "
                        f"machine busy {run.machine_busy_cpus or 0:.2f} CPU"
                    )
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(10)
            admin.close()

    cases, goals = summarize_runs(runs)
    headers, rows = case_table(cases)
    print_table(
        out, f"uvicorn + wrk -c{args.connections}: medians of {args.rounds} rounds", headers, rows
    )
    print_table(out, "ratios to the bare app", RATIO_HEADERS, ratio_cells(goals))
    for problem in problems:
        out.print(f"[red]check failed:[/] {problem}")
    wrk_version = subprocess.run([wrk, "-v"], capture_output=True, text=True, check=False)
    results = {
        "benchmark": "asgi_middleware",
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine_info(
            facts,
            "starlette",
            "slowapi",
            "limits",
            "uvicorn",
            "uvloop",
            "httptools",
            pinning=pinning,
            wrk=(wrk_version.stdout + wrk_version.stderr).split("\n")[0].strip(),
        ),
        "config": {
            "app": 'a Starlette app with one route (`GET /` returning `{"ok": true}`)',
            "server": f"uvicorn {version('uvicorn')} (1 worker, uvloop, httptools, no access log)",
            "load": f"`wrk -t1 -c{args.connections} -d{args.seconds:g}s --timeout 10s`",
            "seconds_per_case": float(args.seconds),
            "rounds": args.rounds,
            "warmup_seconds": args.warmup,
            "connections": args.connections,
            "admit_rate": ADMIT_RATE,
            "deny_rate": DENY_RATE,
            "wall_seconds": time.monotonic() - started,
        },
        "cases": cases,
        "table": dict(zip(("headers", "rows"), case_table(cases), strict=True)),
        "goals": goals,
        "notes": [
            "`ratekeeper/admitted`: `RateLimitMiddleware` with `sliding_window` at "
            f'`{ADMIT_RATE}` per client IP on `AsyncLimiter.from_url(url, failure_mode="raise", '
            "timeout=10)` and a circuit breaker that never opens: one `EVALSHA` per request "
            "(wrk connects from one address, so one key).",
            f"`ratekeeper/denied`: the same at `{DENY_RATE}`: every request after the first "
            "is a 429 from the deny cache, with no store call.",
            f'`slowapi`: `@limiter.limit("{ADMIT_RATE}")`, `Limiter(key_func='
            "get_remote_address, storage_uri=url)` (limits' fixed window on the blocking "
            "redis-py client, called from the event loop), its 429 handler; headers off, its "
            "default.",
            "The machine is shared with other jobs; wrk and Redis share a core, uvicorn has the "
            "other to itself, with what other jobs leave of it. Requests/s count the time "
            "uvicorn waited for its core; its CPU time per request (from /proc, after it has "
            "finished what wrk left in flight) does not, so the CPU ratio is the steadier "
            "estimate of what the middleware costs a server that has the core to itself.",
        ],
        "checks": {"passed": not problems, "problems": problems},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    out.print(f"wrote {args.output} ({time.monotonic() - started:.0f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
