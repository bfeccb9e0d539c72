"""The ASGI app ``busy_loop.py`` serves with uvicorn: the middleware, one policy on the client's
address, and a handler that spends ``BUSY_WORK_MS`` of CPU before it answers (what parsing and
rendering cost). Configured by environment variables: ``BUSY_URL`` (the store),
``BUSY_PREFIX`` (a key prefix of its own), ``BUSY_LIMIT``."""

from __future__ import annotations

import os
import time
from typing import Any

from ratekeeper import AsyncLimiter, Policy
from ratekeeper.asgi import RateLimitMiddleware

WORK = float(os.environ.get("BUSY_WORK_MS", "2")) / 1000


async def handler(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    end = time.perf_counter() + WORK
    while time.perf_counter() < end:
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


limiter = AsyncLimiter.from_url(
    os.environ["BUSY_URL"], key_prefix=os.environ.get("BUSY_PREFIX", "busy"), top_offenders=0
)
app = RateLimitMiddleware(
    handler,
    limiter=limiter,
    policy=Policy("web", os.environ.get("BUSY_LIMIT", "2000/hour"), "fixed_window"),
)
