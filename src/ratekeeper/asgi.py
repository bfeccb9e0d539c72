"""Pure ASGI rate limiting middleware: no framework, no BaseHTTPMiddleware, no blocking calls.

    from ratekeeper import AsyncLimiter, Policy
    from ratekeeper.asgi import RateLimitMiddleware
    from ratekeeper.identity import client_ip

    app = RateLimitMiddleware(
        app,
        limiter=AsyncLimiter.from_url("redis://localhost:6379/0"),
        policy=Policy("api", "100/minute"),
        key=client_ip(trusted_proxies=["10.0.0.0/8"]),
    )

Works with Starlette's ``app.add_middleware(RateLimitMiddleware, limiter=..., policy=...)`` and
FastAPI alike. Lifespan scopes pass through untouched; websocket handshakes are limited (a denied
handshake is closed before it is accepted).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from ._decision import Decision
from ._errors import ConfigError
from ._http import (
    MISSING_IDENTITY_DETAIL,
    DeniedResponse,
    KeyFunc,
    Limiting,
    MissingIdentity,
    Outcome,
    Preflight,
    Request,
    Rule,
    with_length,
)
from ._limiter import AsyncLimiter
from ._policy import Policy

__all__ = ["RateLimitMiddleware", "Rule", "fastapi_dependency", "request_from_scope"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def request_from_scope(scope: Scope) -> Request:
    """The framework-free view of an ASGI HTTP or websocket scope."""
    headers: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers") or ():
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    client = scope.get("client")
    return Request(
        method=scope.get("method", "GET"),
        path=scope.get("path", "/"),
        headers=headers,
        peer=client[0] if client else None,
        raw=scope,
    )


class RateLimitMiddleware:
    """Limits every HTTP request and websocket handshake by the first matching rule.

    Arguments, keyword-only:

    * ``limiter``: an :class:`AsyncLimiter` (a blocking Limiter is refused).
    * ``policy``: the default policy for paths no rule matches (None: such paths are not limited).
    * ``key``: the default key function (default: ``client_ip()``, the socket peer).
    * ``rules``: :class:`Rule` values, tried in order; the first match wins.
    * ``exempt``: path globs or regexes never limited (health checks).
    * ``shadow``: decide, record and send headers, but never block (dark launches). A rule's
      own ``shadow=True`` does the same for its routes.
    * ``legacy_headers``: also send ``X-RateLimit-Limit/Remaining/Reset``.
    * ``denied``: builds the 429 response (status, headers, body) instead of the default
      problem+json.
    * ``missing_identity``: what a request gets when the key function finds no identity (a
      ``header()`` without ``fallback``, a key function returning None): ``"client_ip"`` (the
      default) limits it by its socket peer's address, as ``anonymous:ip:<address>`` (one
      shared ``anonymous:no-address`` when the peer is no address), a budget no real key
      shares; ``"reject"`` answers 400 with problem+json (closes a websocket handshake);
      ``"allow"`` passes it on unlimited.
    * ``preflight``: ``"exempt"`` (the default) passes CORS preflights (OPTIONS with
      ``Origin`` and ``Access-Control-Request-Method``) on uncharged, unless the matching rule
      names "OPTIONS"; ``"charge"`` charges them like any other request.

    Rule methods match as frameworks route them: a rule naming GET also charges HEAD. Decisions
    the store could not make (``decision.degraded``) get no RateLimit headers: their numbers
    would be made up; a degraded denial (failure mode ``closed``) is still a 429.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        limiter: AsyncLimiter,
        policy: Policy | None = None,
        key: KeyFunc | None = None,
        rules: Iterable[Rule] = (),
        exempt: Iterable[str | re.Pattern[str]] = (),
        shadow: bool = False,
        legacy_headers: bool = False,
        denied: DeniedResponse | None = None,
        missing_identity: MissingIdentity = "client_ip",
        preflight: Preflight = "exempt",
    ) -> None:
        if not isinstance(limiter, AsyncLimiter):
            raise ConfigError(
                "the ASGI middleware needs an AsyncLimiter: a blocking Limiter would stall the "
                "event loop"
            )
        self.app = app
        self.limiter = limiter
        self.limiting = Limiting(
            policy=policy,
            key=key,
            rules=rules,
            exempt=exempt,
            shadow=shadow,
            legacy_headers=legacy_headers,
            denied=denied,
            missing_identity=missing_identity,
            preflight=preflight,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        request = request_from_scope(scope)
        route = self.limiting.route(request)
        if route is None:
            await self.app(scope, receive, send)
            return
        if isinstance(route, Outcome):
            outcome = route
        else:
            decision = await self.limiter.hit(route.policy, route.identity, route.rule.cost)
            outcome = self.limiting.outcome(route.rule, decision, request)
        if outcome.blocked:
            if kind == "websocket":
                # Refuse the handshake: close before accepting (the server answers 403).
                await send({"type": "websocket.close", "code": 1008})
                return
            assert outcome.response is not None
            await _respond(send, *outcome.response)
            return
        if not outcome.headers or kind == "websocket":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _with_headers(send, outcome.headers))


def _with_headers(send: Send, headers: list[tuple[str, str]]) -> Send:
    encoded = [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in headers]
    names = {name for name, _ in encoded}

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            kept = [(n, v) for n, v in message.get("headers", ()) if n.lower() not in names]
            message = {**message, "headers": kept + encoded}
        await send(message)

    return wrapped


async def _respond(send: Send, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
    raw = [
        (n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in with_length(headers, body)
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def fastapi_dependency(
    limiter: AsyncLimiter,
    policy: Policy,
    *,
    key: KeyFunc | None = None,
    cost: int = 1,
    legacy_headers: bool = False,
    missing_identity: MissingIdentity = "client_ip",
    preflight: Preflight = "exempt",
) -> Callable[..., Awaitable[Decision | None]]:
    """A FastAPI dependency that limits one endpoint (``pip install fastapi``).

        limited = fastapi_dependency(limiter, Policy("search", "10/minute"))

        @app.get("/search")
        async def search(decision: Decision = Depends(limited)): ...

    Charges every request its endpoint serves (HEAD too, under ``api_route(methods=["GET",
    "HEAD"])``). Sets the RateLimit headers on the response, and raises ``HTTPException(429)``
    with ``Retry-After`` when the request is denied. ``missing_identity`` and ``preflight`` are
    those of :class:`RateLimitMiddleware`; ``"reject"`` raises ``HTTPException(400)``. Returns
    the decision, or None for a request that was not charged (``missing_identity="allow"``, an
    exempt CORS preflight).
    """
    from fastapi import HTTPException, Response
    from starlette.requests import Request as StarletteRequest

    if not isinstance(limiter, AsyncLimiter):
        raise ConfigError("fastapi_dependency needs an AsyncLimiter")
    limiting = Limiting(
        rules=[Rule("*", policy, key=key, cost=cost)],
        legacy_headers=legacy_headers,
        missing_identity=missing_identity,
        preflight=preflight,
    )

    async def dependency(request: Any, response: Any) -> Decision | None:
        view = request_from_scope(request.scope)
        route = limiting.route(view)
        if route is None:
            return None
        if isinstance(route, Outcome):
            raise HTTPException(status_code=400, detail=MISSING_IDENTITY_DETAIL)
        decision = await limiter.hit(policy, route.identity, route.rule.cost)
        outcome = limiting.outcome(route.rule, decision, view)
        if outcome.blocked:
            raise HTTPException(
                status_code=429,
                detail=f"Rate limit exceeded for policy {policy.name!r} ({decision.rate}).",
                headers=dict(outcome.headers),
            )
        for name, value in outcome.headers:
            response.headers[name] = value
        return decision

    # FastAPI reads these to inject the request and the response (string annotations from
    # ``from __future__ import annotations`` would not resolve to the local imports).
    dependency.__annotations__ = {
        "request": StarletteRequest,
        "response": Response,
        "return": Decision,
    }
    return dependency
