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

    python benchmarks/busy_loop.py [--seconds 5] [--rounds 1] [--quick] [--json FILE]

Exits non-zero when a bound is missed (degraded > 0.1% on a healthy store; a stall not seen, or
not recovered from within 1 s; a cold start degraded), so CI's chaos step fails on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from typing import Any

from _harness import Server, console, find_binary, machine_info, pin_clients, print_table

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
            figures = await _busy(
                lambda who: rk.hit(POLICY, who), tasks, work_ms / 1000, seconds
            )
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="1 s cases, fewer of them")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    seconds = 1.0 if args.quick else args.seconds
    out = console()
    missed: list[str] = []
    with Server(find_binary(), "--enable-debug-command", "local") as server:
        pinning = pin_clients()
        url = server.url
        rows, results = [], {"busy": [], "info": machine_info(None, "redis", "limits")}
        loads = [(64, 1.0), (64, 2.0), (16, 5.0)]
        for tasks, work in loads[:1] if args.quick else loads:
            floor = limits_case(url, tasks, work, seconds)
            for deny, batching in ((True, True), (False, True), (True, False)):
                deny_cache = 10_000 if deny else 0
                got = busy_case(url, tasks, work, seconds, deny_cache=deny_cache, batching=batching)
                share = got["degraded"] / max(got["decisions"], 1)
                ratio = got["per_second"] / floor["per_second"]
                name = f"{tasks} x {work:g} ms, deny cache {'on' if deny else 'off'}, "
                name += f"batching {'on' if batching else 'off'}"
                rows.append(
                    [name, f"{got['decisions']:,}", f"{got['degraded']:,}", f"{share:.3%}",
                     str(got["transitions"]), f"{ratio:.2f}"]
                )  # fmt: skip
                results["busy"].append({"case": name, **got, "vs_limits": ratio})
                del got["degraded_at"]
                if share > DEGRADED_BOUND or got["transitions"]:
                    missed.append(f"{name}: {got['degraded']} degraded, {got['transitions']} moves")
        print_table(
            out,
            f"Busy event loop, healthy store ({pinning})",
            ["case", "decisions", "degraded", "share", "breaker moves", "decisions/s vs limits"],
            rows,
        )
        stall = stall_case(url, server.port, max(seconds, 3.0))
        del stall["degraded_at"]
        results["stall"] = stall
        out.print(
            f"300 ms stall, 64 x 1 ms: {stall['degraded']:,} of {stall['decisions']:,} degraded "
            f"({stall['reasons']}), last one {stall['recovered_after']} s after the stall ended"
        )
        if not stall["degraded"] or stall["recovered_after"] is None:
            missed.append("the stall was not seen")
        elif stall["recovered_after"] > 1.0:
            missed.append(f"decided by the store again only {stall['recovered_after']:.2f} s late")
        colds = [cold_case(url) for _ in range(1 if args.quick else 5)]
        results["cold"] = [{**c, "reasons": dict(c["reasons"])} for c in colds]
        out.print(
            "cold limiter, 360 hits at once after 2 ms of CPU each: degraded "
            + ", ".join(str(c["degraded"]) for c in colds)
        )
        if any(c["degraded"] for c in colds):
            missed.append("a cold start was degraded")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)
    for line in missed:
        out.print(f"MISSED: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
