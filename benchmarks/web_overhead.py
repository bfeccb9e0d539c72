"""The web middleware's own cost per request, in process, against the limiter call it wraps.

One ASGI middleware (``RateLimitMiddleware``, one default policy, the default ``client_ip()``
key) in front of a raw ASGI app that answers 200, driven by awaiting it with a prebuilt scope
(three headers, one client address): no sockets, no server. The store is ``memory://``, so the
floor, ``AsyncLimiter.hit`` on the same policy and identity called directly, is pure Python and
the difference between the two is what the middleware adds: matching, the key, the headers,
the response wrapping.

Modes: ``allowed`` (a ``fixed_window`` of 10^9/hour: every request admitted) and ``denied`` (1/hour:
after the first, every request is a 429 answered from the deny cache).

Run: ``python benchmarks/web_overhead.py [--requests 20000]`` prints µs per request for the
middleware and the floor and their difference. For small changes compare instruction counts,
not times: ``valgrind --tool=callgrind python benchmarks/web_overhead.py --requests N --mode
allowed --only middleware`` at two N (the difference over the difference in N is the per-request
count; the same for ``--only floor``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from ratekeeper import AsyncLimiter, Policy
from ratekeeper.asgi import RateLimitMiddleware

WARMUP = 200
SCOPE: dict[str, Any] = {
    "type": "http",
    "method": "GET",
    "path": "/items",
    "headers": [(b"host", b"example"), (b"user-agent", b"bench"), (b"accept", b"*/*")],
    "client": ("203.0.113.7", 40000),
}


async def app(scope: Any, receive: Any, send: Any) -> None:
    headers = [(b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


async def receive() -> dict[str, Any]:
    return {"type": "http.request"}


async def send(message: Any) -> None:
    return None


async def run(mode: str, what: str, requests: int) -> float:
    """Seconds per request of ``what`` (``middleware`` or ``floor``)."""
    limit = "1000000000/hour" if mode == "allowed" else "1/hour"
    policy = Policy("bench", limit, algorithm="fixed_window")
    async with AsyncLimiter.from_url("memory://") as limiter:
        middleware = RateLimitMiddleware(app, limiter=limiter, policy=policy)
        identity = "ip:203.0.113.7"  # what client_ip() gives the scope's client

        async def once() -> None:
            if what == "floor":
                await limiter.hit(policy, identity)
            else:
                await middleware(dict(SCOPE), receive, send)

        for _ in range(WARMUP):
            await once()
        started = time.perf_counter()
        for _ in range(requests):
            await once()
        return (time.perf_counter() - started) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--mode", choices=["allowed", "denied", "both"], default="both")
    parser.add_argument("--only", choices=["middleware", "floor"], default=None)
    args = parser.parse_args()
    modes = ["allowed", "denied"] if args.mode == "both" else [args.mode]
    for mode in modes:
        if args.only is not None:
            per = asyncio.run(run(mode, args.only, args.requests))
            print(f"{mode:8} {args.only:10} {per * 1e6:8.2f} µs/request")
            continue
        middleware = asyncio.run(run(mode, "middleware", args.requests))
        floor = asyncio.run(run(mode, "floor", args.requests))
        print(
            f"{mode:8} middleware {middleware * 1e6:7.2f} µs/request, limiter.hit floor "
            f"{floor * 1e6:6.2f} µs: the middleware adds {(middleware - floor) * 1e6:6.2f} µs "
            f"({middleware / floor:.2f}x the floor)"
        )


if __name__ == "__main__":
    main()
