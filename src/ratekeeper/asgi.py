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
FastAPI alike, and with Litestar's ``middleware=[DefineMiddleware(RateLimitMiddleware, limiter=...,
policy=...)]``. Lifespan scopes pass through untouched; websocket handshakes are limited (a denied
handshake is closed before it is accepted). The decisions charged for a request are in
``scope["state"]["ratekeeper"]`` (``request.state.ratekeeper``), a tuple of Decision.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

from ._http import (
    COST_KEY,
    SHOWN_KEY,
    STATE_KEY,
    Admission,
    PolicyChoice,
    ResponseView,
    Rule,
    add_charged,
    answered,
    drive_async,
    shown_headers,
)
from ._http._middleware import EndpointOptions, Middleware, endpoint_limiting
from ._http._request import LazyHeaders, Request
from ._limiters.limiter import AsyncLimiter
from ._model.decision import Decision

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "RateLimitExceeded",
    "RateLimitMiddleware",
    "ResponseView",
    "Rule",
    "fastapi_dependency",
    "rate_limit_exceeded_handler",
    "request_from_scope",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _scope_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for raw_name, raw_value in raw:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


def request_from_scope(scope: Scope) -> Request:
    """The framework-free view of an ASGI HTTP or websocket scope (its headers are decoded
    when first read)."""
    client = scope.get("client")
    return Request(
        method=scope.get("method", "GET").upper(),  # as frameworks route it
        path=scope.get("path", "/"),
        headers=LazyHeaders(scope.get("headers") or (), _scope_headers),
        peer=client[0] if client else None,
        raw=scope,
    )


class RateLimitMiddleware(Middleware[ASGIApp, AsyncLimiter]):
    """Limits every HTTP request and websocket handshake by the first matching rule, and by
    the application policy if there is one.

    Arguments, keyword-only:

    * ``limiter``: an :class:`AsyncLimiter` (a blocking Limiter is refused).
    * ``policy``: the default policy for paths no rule matches (None: such paths are not
      limited by a rule).
    * ``key``: the default key function (default: ``client_ip()``, the socket peer); sync or
      ``async def``.
    * ``rules``: :class:`Rule` values, tried in order; the first match wins. A rule's policy,
      key and cost may be callables of the request, sync or async (plans chosen per request);
      its ``deduct_when`` charges it after the response, by status.
    * ``exempt``: path globs or regexes never limited (health checks).
    * ``application_policy``: a Policy, or a callable of the request returning one or None,
      charged (cost 1) on every request that is not exempt, in addition to the matching rule;
      ``application_key`` its key function (default: ``key``). A request is admitted only when
      every policy admits it; see :class:`ratekeeper._http.Limiting` for what a denial by one
      consumes from the other (nothing, when the rule's policy denies).
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
    * ``enabled``: False passes every request on untouched, with no store call (a kill switch
      for incidents and tests).

    Rule methods match as frameworks route them: a rule naming GET also charges HEAD. Decisions
    the store could not make (``decision.degraded``) get no RateLimit headers: their numbers
    would be made up; a degraded denial (failure mode ``closed``) is still a 429. The headers
    list every policy that applied in ``RateLimit-Policy``, a :func:`fastapi_dependency`'s too
    (whose 429 is sent as it is); ``RateLimit`` is the one that constrains most. The decisions
    charged before the app runs are in ``scope["state"]["ratekeeper"]`` (an empty tuple when
    none was: exempt, no policy applied; a ``deduct_when`` policy is charged after the app).

    On ``memory://`` in a process that is evidently one of several workers (``uvicorn
    --workers``, gunicorn), a warning is logged once: each worker would admit the whole limit.
    """

    kind = "ASGI"
    drives = AsyncLimiter
    refusal = (
        "the ASGI middleware needs an AsyncLimiter: a blocking Limiter would stall the event loop"
    )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or not self.limiting.enabled:
            if kind == "lifespan" and self.limiting.enabled:
                receive = self._connecting(receive)
            await self.app(scope, receive, send)
            return
        request = request_from_scope(scope)
        admission: Admission | None = await drive_async(self.limiting.admit(request), self.limiter)
        if admission is None:
            scope.setdefault("state", {})[STATE_KEY] = ()
            await self.app(scope, receive, send)
            return
        if admission.response is not None:
            if kind == "websocket":
                # Refuse the handshake: close before accepting (the server answers 403).
                await send({"type": "websocket.close", "code": 1008})
                return
            await _respond(send, *admission.response)
            return
        state = scope.setdefault("state", {})
        state[STATE_KEY] = admission.decisions
        if admission.deferred:
            await self._deferred(admission, state, scope, receive, send)
        elif not admission.headers or kind == "websocket":
            await self.app(scope, receive, send)
        else:
            await self.app(scope, receive, self._with_headers(send, admission, state))

    def _connecting(self, receive: Receive) -> Receive:
        """``receive`` of a lifespan: the limiter connects to the store at startup, before the
        app hears of it, so that a worker's first burst of requests does not open it."""
        limiter = self.limiter

        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await limiter.connect()
            return message

        return wrapped

    def _with_headers(self, send: Send, admission: Admission, state: dict[str, Any]) -> Send:
        """``send``, adding the admission's headers to the response start."""
        encoded = _encode(admission.headers)

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                ours = encoded
                if SHOWN_KEY in state:  # a dependency's limiter ran too
                    ours = _encode(self.shown(state, admission.decisions, admission.headers))
                message = {**message, "headers": _merge(message.get("headers", ()), ours)}
            await send(message)

        return wrapped

    async def _deferred(
        self,
        admission: Admission,
        state: dict[str, Any],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """Run the app, charging the ``deduct_when`` policies once its status is known: at
        the response start (a websocket: 101 when accepted, 403 when closed before; an
        exception before the response: 500)."""
        settled = False

        async def settle(status: int) -> list[tuple[bytes, bytes]]:
            nonlocal settled
            settled = True
            headers = await drive_async(self.limiting.settle(admission, status), self.limiter)
            return _encode(self.shown(state, admission.shown, headers))

        reported = self.limiting.reports(admission)
        start: Message = {}
        finished = False

        async def finish(complete: bool) -> None:
            nonlocal finished
            finished = True
            response = ResponseView(
                int(start["status"]),
                {
                    name.decode("latin-1").lower(): value.decode("latin-1")
                    for name, value in start.get("headers", ())
                },
                state,
            )
            steps = self.limiting.finish(admission, response, state.get(COST_KEY), complete)
            await drive_async(steps, self.limiter)

        async def wrapped(message: Message) -> None:
            nonlocal start
            kind = message["type"]
            if not settled:
                if kind in ("http.response.start", "websocket.http.response.start"):
                    start = message
                    ours = await settle(int(message["status"]))
                    message = {**message, "headers": _merge(message.get("headers", ()), ours)}
                elif kind == "websocket.accept":
                    await settle(101)
                elif kind == "websocket.close":
                    await settle(403)
            elif reported and kind == "http.response.body" and not message.get("more_body"):
                # The last chunk: the cost the handler reported is settled before the client
                # can see the end (and send its next request).
                await finish(True)
            await send(message)

        try:
            await self.app(scope, receive, wrapped)
        except Exception:
            if not settled:
                await settle(500)
            raise
        finally:
            if reported and start and not finished:
                # Abandoned before its last chunk (the client went away, and the app stopped
                # or its send failed): what was reported so far, or the estimate if more.
                await finish(False)


#: Header names as ASGI sends them (lower-case bytes): the same few on every response.
_names: dict[str, bytes] = {}


def _name(name: str) -> bytes:
    encoded = _names.get(name)
    if encoded is None:
        encoded = name.lower().encode("latin-1")
        if len(_names) < 256:  # names come from our rendering and the denied= callable
            _names[name] = encoded
    return encoded


def _encode(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    known = _names.get  # the usual names without a call of ours each
    return [(known(n) or _name(n), v.encode("latin-1")) for n, v in headers]


def _merge(
    app_headers: Iterable[tuple[bytes, bytes]], ours: list[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    names = {name for name, _ in ours}
    return [(n, v) for n, v in app_headers if n.lower() not in names] + ours


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Answer an ASGI lifespan scope (startup, shutdown) for an app with nothing to set up:
    the demo's sample API and the decision service's HTTP app."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _respond(send: Send, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
    """Send a response of ours (a denial, a rejection): its headers carry Content-Length."""
    raw = _encode(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class RateLimitExceeded(Exception):
    """Raised by :func:`fastapi_dependency` to answer a request with ``response`` (status,
    headers, body): the middleware's 429 (or 400), rendered by the same code."""

    def __init__(self, response: tuple[int, list[tuple[str, str]], bytes]) -> None:
        super().__init__(response[0])
        self.response = response


async def rate_limit_exceeded_handler(request: Any, exc: RateLimitExceeded) -> Any:
    """The Starlette/FastAPI exception handler that answers :class:`RateLimitExceeded` with its
    response; :func:`fastapi_dependency` installs it on first use (an app's own handler for
    RateLimitExceeded wins)."""
    from starlette.responses import Response

    status, headers, body = exc.response
    return Response(body, status_code=status, headers=dict(headers))


def fastapi_dependency(
    limiter: AsyncLimiter, policy: PolicyChoice, **options: Unpack[EndpointOptions]
) -> Callable[..., Awaitable[Decision | None]]:
    """A FastAPI dependency that limits one endpoint (``pip install fastapi``).

        limited = fastapi_dependency(limiter, Policy("search", "10/minute"))

        @app.get("/search")
        async def search(decision: Decision = Depends(limited)): ...

    Charges every request its endpoint serves (HEAD too, under ``api_route(methods=["GET",
    "HEAD"])``). Sets the RateLimit headers on the response; a denied request is answered
    exactly as the middleware answers it (429, problem+json, the same headers), through
    :class:`RateLimitExceeded` and its handler. ``policy``, ``key`` and ``cost`` may be
    callables of the request (sync or async), and the other options (``legacy_headers``,
    ``denied``, ``missing_identity``, ``preflight``, ``enabled``) are those of
    :class:`RateLimitMiddleware`; ``missing_identity="reject"`` answers its 400. Returns the
    decision, or None for a request that was not charged (``missing_identity="allow"``, an
    exempt CORS preflight, ``enabled=False``, a policy callable returning None).
    """
    from fastapi import Response
    from starlette.requests import Request as StarletteRequest

    limiting = endpoint_limiting(
        "fastapi_dependency", limiter, AsyncLimiter, policy, options, asynchronous=True
    )

    async def dependency(request: Any, response: Any) -> Decision | None:
        admission: Admission | None = await drive_async(
            limiting.admit(request_from_scope(request.scope)), limiter
        )
        if admission is None:
            return None
        state = request.scope.setdefault("state", {})
        if admission.response is not None:
            handlers = request.scope.get("starlette.exception_handlers")
            if handlers is not None:  # the app's own table: as add_exception_handler would
                handlers[0].setdefault(RateLimitExceeded, rate_limit_exceeded_handler)
            answered(state)
            raise RateLimitExceeded(admission.response)
        headers = shown_headers(
            state, admission.decisions, admission.headers, legacy=limiting.legacy_headers
        )
        for name, value in headers or ():
            response.headers[name] = value
        add_charged(state, admission.decisions)
        return admission.decisions[0] if admission.decisions else None

    # FastAPI reads these to inject the request and the response (string annotations from
    # ``from __future__ import annotations`` would not resolve to the local imports).
    dependency.__annotations__ = {
        "request": StarletteRequest,
        "response": Response,
        "return": Decision,
    }
    return dependency
