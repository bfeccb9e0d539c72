"""A busy app is not a slow store: how many of an ``AsyncLimiter``'s decisions its failure mode
makes while its own event loop is loaded, with the store healthy on another core.

Cases, each with the limiter's defaults (20 ms timeout and connect timeout, ``failure_mode=
"open"``, the default breaker) on a private server pinned to its own core:

* **busy**: N tasks, each spending W ms of CPU (a handler's parsing and rendering) before every
  ``hit``, for ``--seconds``; with the deny cache on and off, batching on and off. The floor is
  ``limits``' asyncio storage (no deadline: every decision is the store's) under the same
  load, in the same round: decisions/s as a ratio of it.
* **stall**: 64 tasks x 1 ms, and a 300 ms ``DEBUG SLEEP`` in the middle: the decisions it
  held up are degraded, and the last degraded decision comes within 1 s of the stall's end.
* **cold**: a new limiter, never connected, given 360 hits at once, each after 2 ms of CPU
  (a cold worker's first burst): degraded decisions.
* **web**: uvicorn (one worker, its own core) with the ASGI middleware on one client address
  and a handler of 2 ms and of 5 ms of CPU, loaded by ``wrk -c64``: admitted must be exactly
  the limit, no decision made by the failure mode, no breaker transition.
* **cold web**: a uvicorn worker just started, given 360 requests at once (2 ms handlers):
  every one answered with RateLimit headers (decided by the store).

    python benchmarks/busy_loop.py [--seconds 5] [--rounds 1] [--quick] [--json FILE]

Exits non-zero when a bound is missed (degraded > 0.1% on a healthy store; a stall not seen, or
not recovered from within 1 s; a cold start degraded), so CI's chaos step fails on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _harness import (
    Server,
    console,
    find_binary,
    machine_info,
    pin_clients,
    pinned,
    print_table,
    split_cpus,
)
from asgi_middleware import free_port, parse_wrk

from ratekeeper import AsyncLimiter, Policy
from ratekeeper.metrics import Metrics

POLICY = Policy("busy", "1000000000/hour", "gcra")
#: The share of decisions a healthy store's limiter may leave to the failure mode.
DEGRADED_BOUND = 0.001


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Transitions(Metrics):
    def __init__(self) -> None:
        self.transitions = 0

    def breaker_transition(self, old: Any, new: Any) -> None:
        self.transitions += 1


async def _busy(
    hit: Any, tasks: int, work: float, seconds: float, *, stall: Any = None
) -> dict[str, Any]:
    """``tasks`` workers, each ``work`` s of CPU then ``hit(i)``, for ``seconds``."""
    reasons: Counter[str] = Counter()
    degraded_at: list[float] = []
    decisions = 0
    start = time.perf_counter()
    stop = start + seconds

    async def worker(i: int) -> None:
        nonlocal decisions
        while time.perf_counter() < stop:
            _spin(work)
            decision = await hit(f"u{i}")
            decisions += 1
            if getattr(decision, "degraded", False):
                reasons[decision.reason] += 1
                degraded_at.append(time.perf_counter() - start)

    workers = [worker(i) for i in range(tasks)]
    if stall is not None:
        workers.append(stall(start))
    await asyncio.gather(*workers)
    elapsed = time.perf_counter() - start
    return {
        "decisions": decisions,
        "per_second": decisions / elapsed,
        "degraded": sum(reasons.values()),
        "reasons": dict(reasons),
        "degraded_at": degraded_at,
    }


def busy_case(url: str, tasks: int, work_ms: float, seconds: float, **options: Any) -> dict:
    metrics = _Transitions()

    async def main() -> dict[str, Any]:
        async with AsyncLimiter.from_url(url, metrics=metrics, top_offenders=0, **options) as rk:
            await rk.hit(POLICY, "warm-up")
            figures = await _busy(lambda who: rk.hit(POLICY, who), tasks, work_ms / 1000, seconds)
        figures["transitions"] = metrics.transitions
        return figures

    return asyncio.run(main())


def limits_case(url: str, tasks: int, work_ms: float, seconds: float) -> dict[str, Any]:
    import limits
    import limits.aio.storage
    import limits.aio.strategies

    async def main() -> dict[str, Any]:
        storage = limits.aio.storage.RedisStorage("async+" + url, implementation="redispy")
        strategy = limits.aio.strategies.FixedWindowRateLimiter(storage)
        item = limits.parse("1000000000/hour")
        return await _busy(lambda who: strategy.hit(item, who), tasks, work_ms / 1000, seconds)

    return asyncio.run(main())


def stall_case(url: str, port: int, seconds: float) -> dict[str, Any]:
    """64 x 1 ms, with a 300 ms DEBUG SLEEP from another client at a third of the run."""
    import redis

    metrics = _Transitions()
    at = seconds / 3
    window: dict[str, float] = {}

    async def stall(start: float) -> None:
        await asyncio.sleep(at)

        def sleep() -> None:
            admin = redis.Redis(port=port)
            window["began"] = time.perf_counter() - start
            admin.execute_command("DEBUG", "SLEEP", "0.3")
            window["ended"] = time.perf_counter() - start
            admin.close()

        await asyncio.get_running_loop().run_in_executor(None, sleep)

    async def main() -> dict[str, Any]:
        async with AsyncLimiter.from_url(url, metrics=metrics, top_offenders=0) as rk:
            await rk.hit(POLICY, "warm-up")
            return await _busy(lambda who: rk.hit(POLICY, who), 64, 0.001, seconds, stall=stall)

    figures = asyncio.run(main())
    last = max(figures["degraded_at"], default=None)
    figures["stall"] = window
    figures["recovered_after"] = None if last is None else last - window["ended"]
    figures["transitions"] = metrics.transitions
    return figures


def cold_case(url: str, requests: int = 360, work_ms: float = 2.0) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with AsyncLimiter.from_url(url, top_offenders=0) as rk:

            async def request(i: int) -> Any:
                _spin(work_ms / 1000)
                return await rk.hit(POLICY, f"cold-{i}")

            made = await asyncio.gather(*(request(i) for i in range(requests)))
        reasons = Counter(d.reason for d in made if d.degraded)
        return {"decisions": len(made), "degraded": sum(reasons.values()), "reasons": reasons}

    return asyncio.run(main())


HERE = Path(__file__).resolve().parent


class _Uvicorn:
    """``_busy_app`` under uvicorn (one worker) on the client CPUs, until ``stop()``; its log
    says what the failure mode decided and every breaker transition."""

    def __init__(self, url: str, work_ms: float, limit: str, prefix: str) -> None:
        self.port = free_port()
        env = {**os.environ, "BUSY_URL": url, "BUSY_WORK_MS": str(work_ms),
               "BUSY_LIMIT": limit, "BUSY_PREFIX": prefix}  # fmt: skip
        split = split_cpus()
        command = [sys.executable, "-m", "uvicorn", "_busy_app:app", "--port", str(self.port),
                   "--no-access-log"]  # fmt: skip
        self.proc = subprocess.Popen(
            pinned(command, None if split is None else split[1]),
            cwd=HERE, env=env, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stderr is not None
        self.log: list[str] = []
        for line in self.proc.stderr:
            self.log.append(line)
            if "Uvicorn running on" in line:  # after the lifespan startup, bound
                return
        raise RuntimeError("uvicorn exited before it was ready:\n" + "".join(self.log))

    def stop(self) -> tuple[int, int]:
        """(decisions the failure mode made, as logged; breaker transitions)."""
        self.proc.send_signal(signal.SIGINT)
        _, rest = self.proc.communicate(timeout=30)
        log = "".join(self.log) + rest
        return log.count("could not decide"), log.count("circuit breaker")


def web_case(url: str, work_ms: float, seconds: float, limit: int) -> dict[str, Any]:
    wrk = shutil.which("wrk")
    if wrk is None:
        return {"skipped": "no wrk (apt-get install wrk)"}
    server = _Uvicorn(url, work_ms, f"{limit}/hour", f"web-{work_ms}-{time.time_ns()}")
    split = split_cpus()
    try:
        out = subprocess.run(
            pinned([wrk, "-t1", "-c64", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
                    f"http://127.0.0.1:{server.port}/"], None if split is None else split[0]),
            capture_output=True, text=True, check=True, timeout=seconds + 60,
        ).stdout  # fmt: skip
    finally:
        degraded, transitions = server.stop()
    requests, _, rate, non_2xx, errors, _ = parse_wrk(out)
    return {"requests": requests, "admitted": requests - non_2xx, "limit": limit,
            "socket_errors": errors, "degraded_logged": degraded, "transitions": transitions,
            "requests_per_s": rate}  # fmt: skip


async def _burst(port: int, requests: int) -> Counter[str]:
    """``requests`` GETs at once, each on its own connection: how each was answered."""

    async def one() -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        head = (await reader.read()).split(b"\r\n\r\n", 1)[0].lower()
        writer.close()
        status = head.split(b" ", 2)[1].decode()
        decided = b"\r\nratelimit:" in head
        return status if decided or status != "200" else "200 without RateLimit (degraded)"

    return Counter(await asyncio.gather(*(one() for _ in range(requests))))


def cold_web_case(url: str, requests: int = 360) -> dict[str, Any]:
    server = _Uvicorn(url, 2.0, "100000/hour", f"cold-web-{time.time_ns()}")
    try:
        answers = asyncio.run(_burst(server.port, requests))
    finally:
        degraded, transitions = server.stop()
    return {"answers": dict(answers), "degraded_logged": degraded, "transitions": transitions}


def busy_table(url: str, seconds: float, quick: bool, pinning: str, out: Any) -> tuple[list, list]:
    """The busy cases beside the ``limits`` floor: (results, bounds missed)."""
    rows, results, missed = [], [], []
    loads = [(64, 1.0), (64, 2.0), (16, 5.0)]
    for tasks, work in loads[:1] if quick else loads:
        floor = limits_case(url, tasks, work, seconds)
        for deny, batching in ((True, True), (False, True), (True, False)):
            deny_cache = 10_000 if deny else 0
            got = busy_case(url, tasks, work, seconds, deny_cache=deny_cache, batching=batching)
            del got["degraded_at"]
            share = got["degraded"] / max(got["decisions"], 1)
            ratio = got["per_second"] / floor["per_second"]
            name = f"{tasks} x {work:g} ms, deny cache {'on' if deny else 'off'}, "
            name += f"batching {'on' if batching else 'off'}"
            rows.append(
                [name, f"{got['decisions']:,}", f"{got['degraded']:,}", f"{share:.3%}",
                 str(got["transitions"]), f"{ratio:.2f}"]
            )  # fmt: skip
            results.append({"case": name, **got, "vs_limits": ratio})
            if share > DEGRADED_BOUND or got["transitions"]:
                missed.append(f"{name}: {got['degraded']} degraded, {got['transitions']} moves")
    print_table(
        out,
        f"Busy event loop, healthy store ({pinning})",
        ["case", "decisions", "degraded", "share", "breaker moves", "decisions/s vs limits"],
        rows,
    )
    return results, missed


def stall_and_cold(url: str, port: int, seconds: float, quick: bool, out: Any) -> tuple[dict, list]:
    """The stall and the cold limiter: (results, bounds missed)."""
    missed = []
    stall = stall_case(url, port, max(seconds, 3.0))
    del stall["degraded_at"]
    out.print(
        f"300 ms stall, 64 x 1 ms: {stall['degraded']:,} of {stall['decisions']:,} degraded "
        f"({stall['reasons']}), last one {stall['recovered_after']} s after the stall ended"
    )
    if not stall["degraded"] or stall["recovered_after"] is None:
        missed.append("the stall was not seen")
    elif stall["recovered_after"] > 1.0:
        missed.append(f"decided by the store again only {stall['recovered_after']:.2f} s late")
    colds = [cold_case(url) for _ in range(1 if quick else 5)]
    out.print(
        "cold limiter, 360 hits at once after 2 ms of CPU each: degraded "
        + ", ".join(str(c["degraded"]) for c in colds)
    )
    if any(c["degraded"] for c in colds):
        missed.append("a cold start was degraded")
    cold = [{**c, "reasons": dict(c["reasons"])} for c in colds]
    return {"stall": stall, "cold": cold}, missed


def web(url: str, seconds: float, quick: bool, out: Any) -> tuple[dict, list]:
    """uvicorn under wrk, and cold uvicorn workers: (results, bounds missed)."""
    missed, loaded = [], []
    for work in (2.0, 5.0):
        got = web_case(url, work, max(seconds, 3.0), limit=500)
        loaded.append({"work_ms": work, **got})
        out.print(f"uvicorn + middleware, {work:g} ms handlers, wrk -c64: {got}")
        if "skipped" not in got and (
            got["admitted"] != got["limit"] or got["degraded_logged"] or got["transitions"]
        ):
            missed.append(f"web {work:g} ms: {got}")
    colds = [cold_web_case(url) for _ in range(1 if quick else 3)]
    out.print(f"cold uvicorn worker, 360 requests at once: {colds}")
    for cold in colds:
        if set(cold["answers"]) != {"200"} or cold["degraded_logged"]:
            missed.append(f"a cold uvicorn worker: {cold}")
    return {"web": loaded, "cold_web": colds}, missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="1 s cases, fewer of them")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    seconds = 1.0 if args.quick else args.seconds
    out = console()
    results: dict[str, Any] = {"info": machine_info(None, "redis", "limits")}
    with Server(find_binary(), "--enable-debug-command", "local") as server:
        pinning = pin_clients()
        results["busy"], missed = busy_table(server.url, seconds, args.quick, pinning, out)
        more, also = stall_and_cold(server.url, server.port, seconds, args.quick, out)
        results.update(more)
        missed += also
        more, also = web(server.url, seconds, args.quick, out)
        results.update(more)
        missed += also
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)
    for line in missed:
        out.print(f"MISSED: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
