"""Apps and helpers for the web tests.

``create_app`` is the app factory that ``test_web_servers`` runs under ``uvicorn --workers 2
--factory``: a Starlette app behind the ASGI middleware on the Redis/Valkey server named by
``RATEKEEPER_WEB_REDIS_URL``, with keys under ``RATEKEEPER_WEB_KEY_PREFIX`` (a prefix no other
run uses). Identities are API keys (``X-API-Key``): every test request comes from 127.0.0.1.

The helpers drive ASGI apps directly (raw scopes and messages, or httpx's ASGI transport) on
one event loop, so an ``AsyncLimiter`` on Redis is used and closed on the loop it connected on.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import redis.asyncio

from ratekeeper import AsyncLimiter, CircuitBreaker, Policy
from ratekeeper.asgi import RateLimitMiddleware, Rule
from ratekeeper.identity import client_ip, header

ENV_URL = "RATEKEEPER_WEB_REDIS_URL"
ENV_PREFIX = "RATEKEEPER_WEB_KEY_PREFIX"

#: The served app's policies: 12 per minute on the API, one websocket handshake per minute,
#: 5 failed logins per minute (only 401s count).
SERVED_API = Policy("served-api", "12/minute")
SERVED_WS = Policy("served-ws", "1/minute")
SERVED_LOGIN = Policy("served-login", "5/minute")
#: ``create_top_app``'s policy: 20 per minute per ``X-Client``.
TOP_API = Policy("top-api", "20/minute")

#: Seconds a store call may take before it counts as failed: never, on a loaded machine.
PATIENT = 5.0

Message = dict[str, Any]
ASGIApp = Callable[..., Awaitable[None]]


def exact_options(url: str, key_prefix: str) -> dict[str, Any]:
    """Limiter options for exact counts on ``url``: a store that cannot decide raises (a guess
    by a failure mode would make the count meaningless), with timeouts and a breaker that never
    fire on a slow but healthy store."""
    options: dict[str, Any] = {
        "key_prefix": key_prefix,
        "failure_mode": "raise",
        "breaker": CircuitBreaker(slow_call=PATIENT),
    }
    if not url.startswith("memory:"):
        options.update(timeout=PATIENT, connect_timeout=PATIENT)
    return options


def create_app() -> Any:
    """The uvicorn factory: a Starlette API limited per API key, on a shared Redis."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket

    url = os.environ[ENV_URL]
    limiter = AsyncLimiter.from_url(url, **exact_options(url, os.environ[ENV_PREFIX]))
    counter = redis.asyncio.Redis.from_url(url) if url.startswith("redis") else None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await limiter.close()
        if counter is not None:
            await counter.aclose()

    async def items(request: Request) -> JSONResponse:
        return JSONResponse({"items": [1, 2, 3]}, headers={"X-Worker-Pid": str(os.getpid())})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"}, headers={"X-Worker-Pid": str(os.getpid())})

    async def login(request: Request) -> JSONResponse:
        # Count every run of the handler in the shared store, so a test sees across workers
        # whether it ran.
        assert counter is not None, "the login route needs a Redis or Valkey URL"
        await counter.incr(f"{os.environ[ENV_PREFIX]}:login-runs")
        ok = request.headers.get("x-password") == "right"
        return JSONResponse(
            {"ok": ok}, status_code=200 if ok else 401, headers={"X-Worker-Pid": str(os.getpid())}
        )

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    app = Starlette(
        routes=[
            Route("/api/items", items),
            Route("/health", health),
            Route("/login", login, methods=["POST"]),
            WebSocketRoute("/ws", echo),
        ],
        lifespan=lifespan,
    )
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        policy=SERVED_API,
        key=header("x-api-key", fallback=client_ip()),
        rules=[
            Rule("/ws", SERVED_WS),
            Rule("/login", SERVED_LOGIN, deduct_when=lambda status: status == 401),
        ],
        exempt=["/health"],
    )
    return app


def create_top_app() -> Any:
    """The uvicorn factory of the top-offenders test: every path limited by ``TOP_API`` per
    ``X-Client`` header (the identity as the client names it, to read in ``ratekeeper top``)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    url = os.environ[ENV_URL]
    limiter = AsyncLimiter.from_url(url, **exact_options(url, os.environ[ENV_PREFIX]))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await limiter.close()

    async def items(request: Request) -> JSONResponse:
        return JSONResponse({"items": []}, headers={"X-Worker-Pid": str(os.getpid())})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    routes = [Route("/api/items", items), Route("/health", health)]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        policy=TOP_API,
        key=lambda request: request.headers.get("x-client"),
        exempt=["/health"],
    )
    return app


def create_litestar_app() -> Any:
    """The uvicorn factory for Litestar: the same API limit, the ASGI middleware declared with
    Litestar's ``DefineMiddleware``; the handler returns what the middleware put in
    ``request.state.ratekeeper``."""
    from litestar import Litestar, Request, get
    from litestar.middleware import DefineMiddleware

    url = os.environ[ENV_URL]
    limiter = AsyncLimiter.from_url(url, **exact_options(url, os.environ[ENV_PREFIX]))

    @get("/api/items")
    async def items(request: Request[Any, Any, Any]) -> dict[str, Any]:
        decisions = request.state.ratekeeper
        return {"items": [1, 2, 3], "policies": [d.policy for d in decisions]}

    @get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    async def close() -> None:
        await limiter.close()

    return Litestar(
        route_handlers=[items, health],
        middleware=[
            DefineMiddleware(
                RateLimitMiddleware,
                limiter=limiter,
                policy=SERVED_API,
                key=header("x-api-key", fallback=client_ip()),
                exempt=["/health"],
            )
        ],
        on_shutdown=[close],
    )


def create_wsgi_app() -> Any:
    """The gunicorn factory (``tests.support.web_apps:create_wsgi_app()``): a plain WSGI app
    behind the WSGI middleware on ``RATEKEEPER_WEB_REDIS_URL``."""
    from ratekeeper import Limiter
    from ratekeeper.wsgi import RateLimitMiddleware as WSGIMiddleware

    url = os.environ[ENV_URL]
    limiter = Limiter.from_url(url, **exact_options(url, os.environ[ENV_PREFIX]))

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    return WSGIMiddleware(app, limiter=limiter, policy=SERVED_API, exempt=["/health"])


# --- in-process drivers ------------------------------------------------------------------------


async def plain_app(scope: Message, receive: Any, send: Any) -> None:
    """A raw ASGI app: 200 ``ok`` with a JSON echo of the path on HTTP, accepts websockets."""
    if scope["type"] == "websocket":
        message = await receive()
        assert message["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": "hello"})
        await send({"type": "websocket.close", "code": 1000})
        return
    assert scope["type"] == "http"
    body = json.dumps({"path": scope["path"]}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def asgi_client(
    app: Any, client: tuple[str, int] = ("203.0.113.7", 40000)
) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client that calls ``app`` in process, as the peer ``client``."""
    transport = httpx.ASGITransport(app=app, client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


def websocket_scope(path: str = "/ws", *, client: str = "203.0.113.7", **headers: str) -> Message:
    return {
        "type": "websocket",
        "asgi": {"version": "3.0"},
        "scheme": "ws",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
        "client": (client, 40000),
        "server": ("testserver", 80),
        "subprotocols": [],
    }


async def websocket_handshake(app: Any, scope: Message) -> list[Message]:
    """Run one websocket connection through ``app``; the messages the app sent."""
    incoming = [{"type": "websocket.connect"}]
    sent: list[Message] = []

    async def receive() -> Message:
        if incoming:
            return incoming.pop(0)
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(message: Message) -> None:
        sent.append(dict(message))

    await app(scope, receive, send)
    return sent
