"""The sample API that ``ratekeeper demo --serve`` runs behind the ASGI middleware."""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from typing import Any

from .._algorithms.policy import Policy
from .._limiters.limiter import AsyncLimiter
from ..asgi import RateLimitMiddleware, Rule, answer_lifespan

__all__ = ["build_app"]

#: Five requests per ten seconds on the API, two searches per ten seconds; /health is exempt.
API = Policy("demo-api", "5 per 10 seconds")
SEARCH = Policy("demo-search", "2 per 10 seconds", algorithm="gcra")


async def _sample_api(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    path = scope["path"]
    payload: dict[str, Any]
    if path == "/health":
        status, payload = 200, {"status": "ok"}
    elif path in ("/", "/api/items"):
        status, payload = 200, {"items": ["apple", "pear", "plum"]}
    elif path == "/api/search":
        status, payload = 200, {"results": ["apple"]}
    else:
        status, payload = 404, {"error": "not found"}
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def build_app(storage: str) -> RateLimitMiddleware:
    """The sample API limited per client IP: search has its own policy, /health none."""
    return RateLimitMiddleware(
        _sample_api,
        limiter=AsyncLimiter.from_url(storage, key_prefix="ratekeeper-demo"),
        policy=API,
        rules=[Rule("/api/search", SEARCH)],
        exempt=["/health"],
    )
