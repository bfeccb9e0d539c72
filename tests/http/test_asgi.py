"""The pure ASGI middleware: Starlette, FastAPI and raw ASGI apps; lifespan; websockets; rules,
exemptions, shadow mode, degraded decisions; the FastAPI dependency.

Apps run in process on one event loop (httpx's ASGI transport, or raw scopes and messages), so
an ``AsyncLimiter`` on Redis or Valkey connects and closes on the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import typing
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from ratekeeper import (
    AsyncLimiter,
    CircuitBreaker,
    ConfigError,
    Decision,
    Limiter,
    ManualClock,
    Policy,
)
from ratekeeper._http import missing_identity_response
from ratekeeper.asgi import RateLimitMiddleware, Rule, fastapi_dependency, request_from_scope
from ratekeeper.identity import client_ip, header

from ..support.servers import free_port
from ..support.web_apps import (
    asgi_client,
    exact_options,
    plain_app,
    websocket_handshake,
    websocket_scope,
)

PEER = "203.0.113.7"


def ratelimit_name(response: Any) -> str | None:
    """The policy named by a response's RateLimit header, or None when there is none."""
    value = response.headers.get("ratelimit")
    return None if value is None else value.split(";")[0].strip('"')


# --- construction -------------------------------------------------------------------------------


def test_a_blocking_limiter_is_refused():
    with Limiter.from_url("memory://") as limiter:
        with pytest.raises(ConfigError, match="AsyncLimiter"):
            RateLimitMiddleware(plain_app, limiter=limiter, policy=Policy("p", "1/minute"))  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            fastapi_dependency(limiter, Policy("p", "1/minute"))  # type: ignore[arg-type]


def test_a_middleware_needs_a_policy():
    async def main() -> None:
        async with AsyncLimiter.from_url("memory://") as limiter:
            with pytest.raises(ConfigError):
                RateLimitMiddleware(plain_app, limiter=limiter)
            with pytest.raises(ConfigError):
                RateLimitMiddleware(plain_app, limiter=limiter, exempt=["/health"])
            with pytest.raises(ConfigError):
                RateLimitMiddleware(plain_app, limiter=limiter, policy="10/minute")  # type: ignore[arg-type]

    asyncio.run(main())


# --- Starlette, FastAPI, raw ASGI ----------------------------------------------------------------


def starlette_app(limiter: AsyncLimiter, **middleware: Any) -> Starlette:
    async def items(request: StarletteRequest) -> JSONResponse:
        return JSONResponse({"items": [1, 2, 3]})

    app = Starlette(routes=[Route("/items", items), Route("/health", items)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, **middleware)
    return app


def fastapi_app(limiter: AsyncLimiter, **middleware: Any) -> FastAPI:
    app = FastAPI()

    @app.get("/items")
    async def items() -> dict[str, list[int]]:
        return {"items": [1, 2, 3]}

    app.add_middleware(RateLimitMiddleware, limiter=limiter, **middleware)
    return app


def raw_app(limiter: AsyncLimiter, **middleware: Any) -> RateLimitMiddleware:
    return RateLimitMiddleware(plain_app, limiter=limiter, **middleware)


@pytest.mark.parametrize("build", [starlette_app, fastapi_app, raw_app])
def test_the_limit_is_enforced_on_every_kind_of_app(build: Any, backend: str, key_prefix: str):
    policy = Policy("kinds", "3/minute")

    async def main() -> list[Any]:
        async with AsyncLimiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
            app = build(limiter, policy=policy)
            async with asgi_client(app) as http:
                return [await http.get("/items") for _ in range(5)]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200, 200, 200, 429, 429]
    for n, r in enumerate(responses[:3], start=1):
        assert r.headers["ratelimit-policy"] == '"kinds";q=3;w=60'
        assert r.headers["ratelimit"] == f'"kinds";r={3 - n};t=60'
        assert "retry-after" not in r.headers
        assert r.json() in ({"items": [1, 2, 3]}, {"path": "/items"})
    for r in responses[3:]:
        assert r.headers["content-type"] == "application/problem+json"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert r.json()["status"] == 429
        assert r.headers["ratelimit"] == '"kinds";r=0;t=60'


def test_identities_are_independent():
    async def main() -> dict[str, list[int]]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = raw_app(limiter, policy=Policy("indep", "2/minute"))
            out = {}
            for peer in ("203.0.113.7", "203.0.113.8", "2001:db8::1", "2001:db8::2"):
                async with asgi_client(app, client=(peer, 1)) as http:
                    out[peer] = [(await http.get("/")).status_code for _ in range(3)]
            return out

    out = asyncio.run(main())
    assert out["203.0.113.7"] == out["203.0.113.8"] == [200, 200, 429]
    # Both IPv6 peers are in one /64: one client.
    assert out["2001:db8::1"] == [200, 200, 429]
    assert out["2001:db8::2"] == [429, 429, 429]


def test_a_request_without_identity_is_limited_by_its_address_by_default(
    backend: str, key_prefix: str
):
    """``header()`` without a fallback finds no identity when the header is left out; the
    request is limited by the peer's address, in a budget of its own."""
    policy = Policy("anon", "2/minute")

    async def main() -> tuple[list[Any], list[Any], list[Decision]]:
        async with AsyncLimiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
            app = raw_app(limiter, policy=policy, key=header("x-api-key"))
            async with asgi_client(app) as http:
                anonymous = [await http.get("/") for _ in range(4)]
                keyed = [await http.get("/", headers={"X-API-Key": "k"}) for _ in range(3)]
            async with asgi_client(app, client=("203.0.113.8", 1)) as http:
                elsewhere = [await http.get("/") for _ in range(3)]
            probes = [
                await limiter.peek(policy, f"anonymous:ip:{PEER}"),
                await limiter.peek(policy, f"ip:{PEER}"),
            ]
            return anonymous + keyed, elsewhere, probes

    responses, elsewhere, (fallback, by_ip) = asyncio.run(main())
    assert [r.status_code for r in responses] == [200, 200, 429, 429, 200, 200, 429]
    assert responses[0].headers["ratelimit"] == '"anon";r=1;t=60'
    assert responses[2].json()["status"] == 429
    assert [r.status_code for r in elsewhere] == [200, 200, 429]
    assert not fallback.allowed  # the anonymous budget is spent...
    assert by_ip.remaining == 2  # ...and is not the one client_ip() would give the peer


def test_a_key_function_returning_none_follows_missing_identity():
    async def main() -> dict[str, list[int]]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            out = {}
            for choice in ("client_ip", "reject", "allow"):
                app = raw_app(
                    limiter,
                    policy=Policy(f"none-{choice}", "1/minute"),
                    key=lambda request: None,
                    missing_identity=choice,
                )
                async with asgi_client(app) as http:
                    out[choice] = [(await http.get("/")).status_code for _ in range(3)]
            return out

    assert asyncio.run(main()) == {
        "client_ip": [200, 429, 429],
        "reject": [400, 400, 400],
        "allow": [200, 200, 200],
    }


def starlette_counting_app(limiter: AsyncLimiter, runs: list[str], **middleware: Any) -> Starlette:
    async def items(request: StarletteRequest) -> JSONResponse:
        runs.append(request.url.path)
        return JSONResponse({"items": [1, 2, 3]})

    app = Starlette(routes=[Route("/items", items)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, **middleware)
    return app


def test_missing_identity_reject_answers_400_with_problem_json():
    runs: list[str] = []

    async def main() -> tuple[list[Any], list[Any]]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = starlette_counting_app(
                limiter,
                runs,
                policy=Policy("strict", "2/minute"),
                key=header("x-api-key"),
                missing_identity="reject",
            )
            async with asgi_client(app) as http:
                anonymous = [await http.get("/items") for _ in range(3)]
                keyed = [await http.get("/items", headers={"X-API-Key": "k"}) for _ in range(3)]
            return anonymous, keyed

    anonymous, keyed = asyncio.run(main())
    assert [r.status_code for r in anonymous] == [400, 400, 400]
    for r in anonymous:
        assert r.headers["content-type"] == "application/problem+json"
        assert r.headers["content-length"] == str(len(r.content))
        assert r.json() == {
            "type": "about:blank",
            "title": "Bad Request",
            "status": 400,
            "detail": "The request carries no client identity, which this endpoint requires.",
        }
        assert "ratelimit" not in r.headers
        assert "retry-after" not in r.headers
    assert [r.status_code for r in keyed] == [200, 200, 429]
    assert runs == ["/items", "/items"]  # a rejected request never reaches the app


def test_missing_identity_allow_passes_unlimited():
    runs: list[str] = []

    async def main() -> list[Any]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = starlette_counting_app(
                limiter,
                runs,
                policy=Policy("open-anon", "1/minute"),
                key=header("x-api-key"),
                missing_identity="allow",
            )
            async with asgi_client(app) as http:
                anonymous = [await http.get("/items") for _ in range(5)]
                keyed = [await http.get("/items", headers={"X-API-Key": "k"}) for _ in range(2)]
            return anonymous + keyed

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 5 + [200, 429]
    assert all("ratelimit" not in r.headers for r in responses[:5])
    assert len(runs) == 6


def test_shadow_mode_never_rejects_a_missing_identity():
    async def main() -> list[Any]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = raw_app(
                limiter,
                rules=[Rule("/trial", Policy("trial", "1/minute"), shadow=True)],
                policy=Policy("enforced", "5/minute"),
                key=header("x-api-key"),
                missing_identity="reject",
            )
            async with asgi_client(app) as http:
                return [await http.get("/trial") for _ in range(3)] + [await http.get("/")]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200, 200, 200, 400]
    assert all(r.json() == {"path": "/trial"} for r in responses[:3])


def test_a_peer_without_an_address_is_limited_in_one_shared_budget():
    """Starlette's TestClient calls itself ``testclient``; a Unix socket has no peer at all."""

    async def main() -> list[int]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = raw_app(limiter, policy=Policy("no-address", "2/minute"))
            statuses = []
            for peer in ("testclient", "unix:/run/app.sock", "testclient"):
                async with asgi_client(app, client=(peer, 0)) as http:
                    statuses.append((await http.get("/")).status_code)
            scope = {
                "type": "http",
                "method": "GET",
                "path": "/",
                "headers": [],
                "client": None,
            }
            sent: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message: Any) -> None:
                sent.append(dict(message))

            await app(scope, receive, send)
            statuses.append(sent[0]["status"])
            return statuses

    assert asyncio.run(main()) == [200, 200, 429, 429]


def test_a_rejected_websocket_handshake_is_closed():
    async def main() -> list[list[dict[str, Any]]]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = raw_app(
                limiter,
                policy=Policy("ws-anon", "5/minute"),
                key=header("x-api-key"),
                missing_identity="reject",
            )
            return [
                await websocket_handshake(app, websocket_scope()),
                await websocket_handshake(app, websocket_scope(x_api_key="k")),
            ]

    anonymous, keyed = asyncio.run(main())
    assert anonymous == [{"type": "websocket.close", "code": 1008}]
    assert keyed[0]["type"] == "websocket.accept"


@pytest.mark.parametrize("choice", ["deny", "ip", "", None, "CLIENT_IP"])
def test_a_bad_missing_identity_is_a_config_error(choice: Any):
    async def main() -> None:
        async with AsyncLimiter.from_url("memory://") as limiter:
            policy = Policy("p", "1/minute")
            message = r"missing_identity must be one of 'client_ip', 'reject', 'allow'"
            with pytest.raises(ConfigError, match=message):
                RateLimitMiddleware(
                    plain_app, limiter=limiter, policy=policy, missing_identity=choice
                )
            with pytest.raises(ConfigError, match=message):
                fastapi_dependency(limiter, policy, missing_identity=choice)

    asyncio.run(main())


def test_request_from_scope():
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/x",
        "headers": [(b"X-A", b"1"), (b"x-a", b"2"), (b"Host", b"h\xe9")],
        "client": ("203.0.113.7", 1234),
    }
    view = request_from_scope(scope)
    assert view.method == "POST"
    assert view.path == "/x"
    assert view.headers == {"x-a": "1, 2", "host": "h\xe9"}
    assert view.peer == "203.0.113.7"
    assert view.raw is scope
    assert request_from_scope({"type": "http", "path": "/"}).peer is None


# --- lifespan ------------------------------------------------------------------------------------


def test_lifespan_passes_through_and_the_limiter_connects_at_startup():
    seen: dict[str, Any] = {}

    async def lifespan_app(scope: Any, receive: Any, send: Any) -> None:
        seen["scope"], seen["receive"], seen["send"] = scope, receive, send
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                seen["started"] = list(connected)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    connected: list[bool] = []

    async def main() -> list[dict[str, Any]]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            connect = limiter.connect

            async def recording() -> bool:
                connected.append(await connect())
                return connected[-1]

            limiter.connect = recording  # type: ignore[method-assign]
            app = RateLimitMiddleware(lifespan_app, limiter=limiter, policy=Policy("l", "1/hour"))
            incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
            sent: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                return incoming.pop(0)

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
            await app(scope, receive, send)
            assert seen["scope"] is scope
            assert seen["send"] is send
            # Nothing was spent: the one request an hour is still there.
            probe = await limiter.peek(Policy("l", "1/hour"), "ip:203.0.113.7")
            assert probe.remaining == 1
            return sent

    sent = asyncio.run(main())
    assert sent == [{"type": "lifespan.startup.complete"}, {"type": "lifespan.shutdown.complete"}]
    # The limiter connected to the store at startup, before the app heard of it, and only then.
    assert seen["started"] == [True]
    assert connected == [True]


def test_a_starlette_lifespan_runs_behind_the_middleware():
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        events.append("startup")
        yield
        events.append("shutdown")

    async def main() -> list[str]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = Starlette(routes=[], lifespan=lifespan)
            app.add_middleware(RateLimitMiddleware, limiter=limiter, policy=Policy("l", "1/hour"))
            incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
            sent: list[str] = []

            async def receive() -> dict[str, Any]:
                return incoming.pop(0)

            async def send(message: dict[str, Any]) -> None:
                sent.append(message["type"])

            await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
            return sent

    assert asyncio.run(main()) == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert events == ["startup", "shutdown"]


# --- websockets ----------------------------------------------------------------------------------


def starlette_ws_app(limiter: AsyncLimiter, **middleware: Any) -> Starlette:
    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    app = Starlette(routes=[WebSocketRoute("/ws", echo)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, **middleware)
    return app


@pytest.mark.parametrize("build", [starlette_ws_app, raw_app])
def test_a_denied_websocket_handshake_is_closed_with_1008(build: Any):
    async def main() -> list[list[dict[str, Any]]]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = build(limiter, policy=Policy("ws", "2/minute"))
            return [await websocket_handshake(app, websocket_scope()) for _ in range(3)]

    first, second, third = asyncio.run(main())
    for allowed in (first, second):
        assert allowed[0]["type"] == "websocket.accept"
        assert any(m.get("text") == "hello" for m in allowed)
    assert third == [{"type": "websocket.close", "code": 1008}]


def test_websocket_rules_match_as_get_and_other_identities_are_unaffected():
    async def main() -> dict[str, list[str]]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = raw_app(
                limiter,
                rules=[
                    Rule("/ws", Policy("ws-get", "1/minute"), methods=frozenset({"GET"})),
                    Rule("/ws/*", None),
                ],
                key=header("x-api-key", fallback=client_ip()),
            )
            out: dict[str, list[str]] = {}
            for name, scope in {
                "alice": websocket_scope(x_api_key="alice"),
                "bob": websocket_scope(x_api_key="bob"),
                "exempt": websocket_scope("/ws/free"),
            }.items():
                out[name] = [(await websocket_handshake(app, scope))[0]["type"] for _ in range(3)]
            return out

    out = asyncio.run(main())
    assert (
        out["alice"]
        == out["bob"]
        == [
            "websocket.accept",
            "websocket.close",
            "websocket.close",
        ]
    )
    assert out["exempt"] == ["websocket.accept"] * 3


def test_a_shadowed_websocket_handshake_is_accepted():
    async def main() -> list[str]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = raw_app(limiter, policy=Policy("ws-shadow", "1/minute"), shadow=True)
            return [
                (await websocket_handshake(app, websocket_scope()))[0]["type"] for _ in range(3)
            ]

    assert asyncio.run(main()) == ["websocket.accept"] * 3


# --- per-route rules -----------------------------------------------------------------------------


def test_rules_pick_the_policy_by_method_and_path():
    login = Policy("login", "2/minute")
    users = Policy("users", "3/minute")
    api = Policy("api", "4/minute")
    default = Policy("default", "5/minute")

    async def main() -> dict[str, list[Any]]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = raw_app(
                limiter,
                policy=default,
                rules=[
                    Rule("/api/login", login, methods=frozenset({"POST"})),
                    Rule(re.compile(r"/api/users/\d+"), users),
                    Rule("/api/*", api),
                ],
                exempt=["/health", re.compile(r"/metrics(/.*)?")],
            )
            async with asgi_client(app) as http:
                return {
                    "post login": [await http.post("/api/login") for _ in range(3)],
                    "get login": [await http.get("/api/login") for _ in range(1)],
                    "user": [await http.get(f"/api/users/{i}") for i in range(4)],
                    "user sub": [await http.get("/api/users/1/x") for _ in range(1)],
                    "other": [await http.get("/elsewhere") for _ in range(6)],
                    "health": [await http.get("/health") for _ in range(20)],
                    "metrics": [await http.get("/metrics/x") for _ in range(20)],
                }

    out = asyncio.run(main())

    def statuses(name: str) -> list[int]:
        return [r.status_code for r in out[name]]

    assert statuses("post login") == [200, 200, 429]
    assert {ratelimit_name(r) for r in out["post login"]} == {"login"}
    # GET /api/login falls through to /api/*, as do the user's sub-resources.
    assert ratelimit_name(out["get login"][0]) == "api"
    assert ratelimit_name(out["user sub"][0]) == "api"
    assert statuses("user") == [200, 200, 200, 429]
    assert {ratelimit_name(r) for r in out["user"]} == {"users"}
    assert out["user sub"][0].headers["ratelimit"] == '"api";r=2;t=60'
    assert statuses("other") == [200] * 5 + [429]
    assert {ratelimit_name(r) for r in out["other"]} == {"default"}
    for name in ("health", "metrics"):
        assert statuses(name) == [200] * 20
        assert not any(
            h.startswith(("ratelimit", "retry-after", "x-ratelimit"))
            for r in out[name]
            for h in r.headers
        )


def test_a_rule_can_set_its_own_key_and_cost():
    async def main() -> list[Any]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = raw_app(
                limiter,
                rules=[
                    Rule("/export", Policy("export", "5/minute"), cost=2),
                    Rule("/keyed", Policy("keyed", "1/minute"), key=header("x-api-key")),
                ],
            )
            async with asgi_client(app) as http:
                exports = [await http.get("/export") for _ in range(3)]
                keyed = [
                    await http.get("/keyed", headers={"X-API-Key": key}) for key in ("a", "b", "a")
                ]
                unmatched = [await http.get("/other") for _ in range(3)]
            return [exports, keyed, unmatched]

    exports, keyed, unmatched = asyncio.run(main())
    assert [r.status_code for r in exports] == [200, 200, 429]
    assert [r.headers["ratelimit"] for r in exports] == [
        '"export";r=3;t=60',
        '"export";r=1;t=60',
        '"export";r=1;t=60',
    ]
    assert [r.status_code for r in keyed] == [200, 200, 429]
    # No default policy: a path no rule matches is not limited.
    assert [r.status_code for r in unmatched] == [200, 200, 200]
    assert all("ratelimit" not in r.headers for r in unmatched)


# --- shadow mode ---------------------------------------------------------------------------------


def test_shadow_mode_records_and_sets_headers_but_never_blocks(backend: str, key_prefix: str):
    policy = Policy("shadow", "2/minute")

    async def main() -> tuple[list[Any], Decision]:
        async with AsyncLimiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
            app = raw_app(limiter, policy=policy, shadow=True)
            async with asgi_client(app) as http:
                responses = [await http.get("/") for _ in range(5)]
            return responses, await limiter.peek(policy, f"ip:{PEER}")

    responses, after = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 5
    assert [r.headers["ratelimit"] for r in responses] == [
        '"shadow";r=1;t=60',
        '"shadow";r=0;t=60',
        '"shadow";r=0;t=60',
        '"shadow";r=0;t=60',
        '"shadow";r=0;t=60',
    ]
    assert all(r.headers["ratelimit-policy"] == '"shadow";q=2;w=60' for r in responses)
    assert all(r.json() == {"path": "/"} for r in responses)
    # The decisions were real: the store is at the limit.
    assert not after.allowed
    assert after.remaining == 0


def test_shadow_per_rule_only_spares_that_rule():
    async def main() -> tuple[list[int], list[int], list[str]]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = raw_app(
                limiter,
                policy=Policy("enforced", "2/minute"),
                rules=[Rule("/new/*", Policy("trial", "2/minute"), shadow=True)],
            )
            async with asgi_client(app) as http:
                trial = [await http.get("/new/feature") for _ in range(4)]
                enforced = [await http.get("/old") for _ in range(4)]
            return (
                [r.status_code for r in trial],
                [r.status_code for r in enforced],
                [r.headers["ratelimit"] for r in trial],
            )

    trial, enforced, trial_headers = asyncio.run(main())
    assert trial == [200] * 4
    assert trial_headers[-1] == '"trial";r=0;t=60'
    assert enforced == [200, 200, 429, 429]


# --- degraded decisions --------------------------------------------------------------------------


def dead_limiter(mode: str) -> AsyncLimiter:
    """A limiter on a loopback port where nothing listens."""
    return AsyncLimiter.from_url(
        f"redis://127.0.0.1:{free_port()}/0",
        failure_mode=mode,
        timeout=0.5,
        connect_timeout=0.5,
        breaker=CircuitBreaker(consecutive_failures=2),
    )


def test_a_dead_store_failing_open_passes_without_headers():
    async def main() -> list[Any]:
        async with dead_limiter("open") as limiter:
            app = raw_app(limiter, policy=Policy("dead-open", "1/minute"), legacy_headers=True)
            async with asgi_client(app) as http:
                return [await http.get("/") for _ in range(4)]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 4  # over a limit of 1
    for r in responses:
        assert not [h for h in r.headers if "ratelimit" in h or h == "retry-after"]
        assert r.json() == {"path": "/"}


def test_a_dead_store_failing_closed_answers_429_with_retry_after():
    async def main() -> list[Any]:
        async with dead_limiter("closed") as limiter:
            app = raw_app(limiter, policy=Policy("dead-closed", "100/minute"))
            async with asgi_client(app) as http:
                return [await http.get("/") for _ in range(3)]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [429] * 3
    for r in responses:
        assert int(r.headers["retry-after"]) >= 1
        assert "ratelimit" not in r.headers
        assert "ratelimit-policy" not in r.headers
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["status"] == 429


# --- the FastAPI dependency ----------------------------------------------------------------------


def test_fastapi_dependency_annotations_resolve():
    """FastAPI reads the dependency's parameters from its type hints. asgi.py has
    ``from __future__ import annotations`` and imports ``Response`` and ``StarletteRequest``
    inside ``fastapi_dependency``, so the hints are strings FastAPI cannot resolve in the
    module's globals: it takes ``request`` and ``response`` for required query parameters and
    answers every request with 422."""

    async def main() -> dict[str, Any]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            return typing.get_type_hints(fastapi_dependency(limiter, Policy("p", "1/minute")))

    hints = asyncio.run(main())
    assert hints["request"] is StarletteRequest
    assert issubclass(hints["response"], Response)


def test_fastapi_dependency(backend: str, key_prefix: str):
    search = Policy("search", "2/minute")

    async def main() -> tuple[list[Any], list[Any]]:
        async with AsyncLimiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
            limited = fastapi_dependency(limiter, search, key=header("x-api-key"))
            app = FastAPI()

            @app.get("/search")
            async def run_search(decision: Decision = Depends(limited)) -> dict[str, Any]:  # noqa: B008
                return {"remaining": decision.remaining}

            @app.get("/free")
            async def free() -> dict[str, bool]:
                return {"free": True}

            async with asgi_client(app) as http:
                hits = [await http.get("/search", headers={"X-API-Key": "a"}) for _ in range(3)]
                other = [await http.get("/search", headers={"X-API-Key": "b"})]
                anonymous = [await http.get("/search") for _ in range(3)]
                free_ones = [await http.get("/free") for _ in range(3)]
            return hits + other + anonymous, free_ones

    responses, free_ones = asyncio.run(main())
    # Without the header: limited by the peer's address, like the middleware does.
    assert [r.status_code for r in responses] == [200, 200, 429, 200, 200, 200, 429]
    first, second, denied, other, *anonymous = responses
    assert anonymous[0].json() == {"remaining": 1}
    assert anonymous[0].headers["ratelimit"] == '"search";r=1;t=60'
    assert first.json() == {"remaining": 1}
    assert second.json() == {"remaining": 0}
    assert first.headers["ratelimit-policy"] == '"search";q=2;w=60'
    assert first.headers["ratelimit"] == '"search";r=1;t=60'
    assert second.headers["ratelimit"] == '"search";r=0;t=60'
    assert 1 <= int(denied.headers["retry-after"]) <= 60
    assert denied.headers["ratelimit"] == '"search";r=0;t=60'
    assert "search" in denied.json()["detail"]
    assert other.json() == {"remaining": 1}
    assert all(r.status_code == 200 and "ratelimit" not in r.headers for r in free_ones)


def test_fastapi_dependency_with_legacy_headers_and_cost():
    async def main() -> list[Any]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            limited = fastapi_dependency(
                limiter, Policy("bulk", "5/minute"), cost=2, legacy_headers=True
            )
            app = FastAPI()

            @app.post("/bulk", dependencies=[Depends(limited)])
            async def bulk() -> dict[str, str]:
                return {"status": "done"}

            async with asgi_client(app) as http:
                return [await http.post("/bulk") for _ in range(3)]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert [r.headers["x-ratelimit-remaining"] for r in responses] == ["3", "1", "1"]
    assert responses[0].json() == {"status": "done"}
    assert json.loads(responses[2].text)["detail"]
    assert responses[2].headers["x-ratelimit-limit"] == "5"


@pytest.mark.parametrize(
    ("choice", "expected"),
    [("client_ip", [200, 200, 429]), ("reject", [400, 400, 400]), ("allow", [200, 200, 200])],
)
def test_fastapi_dependency_missing_identity(choice: str, expected: list[int]):
    decisions: list[Decision | None] = []

    async def main() -> list[Any]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            limited = fastapi_dependency(
                limiter,
                Policy("dep-anon", "2/minute"),
                key=header("x-api-key"),
                missing_identity=choice,  # type: ignore[arg-type]
            )
            app = FastAPI()

            @app.get("/search")
            async def run_search(decision: Decision | None = Depends(limited)) -> dict[str, Any]:  # noqa: B008
                decisions.append(decision)
                return {"limited": decision is not None}

            async with asgi_client(app) as http:
                return [await http.get("/search") for _ in range(3)]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == expected
    if choice == "reject":
        assert decisions == []
        # The middleware's answer, from the same rendering.
        assert responses[0].headers["content-type"] == "application/problem+json"
        assert responses[0].content == missing_identity_response()[2]
    elif choice == "allow":
        assert decisions == [None, None, None]
        assert all("ratelimit" not in r.headers for r in responses)
    else:
        assert [d.remaining for d in decisions if d is not None] == [1, 0]
        assert responses[2].headers["ratelimit"] == '"dep-anon";r=0;t=60'


@pytest.mark.parametrize("counted", ["before", "on_the_outcome"])
def test_fastapi_dependency_behind_the_middleware_shows_the_policy_that_constrains(counted: str):
    """The middleware's policy (20/minute; or counted on the outcome, with ``deduct_when``) and
    the dependency's (2/minute) on one request: the admitted responses show the dependency's
    policy, which has fewer left; its 429 is its own, headers and all: the middleware adds
    nothing to it."""
    clock = ManualClock()
    narrow = Policy("narrow", "2/minute")
    deduct = (lambda status: status < 500) if counted == "on_the_outcome" else None
    seen: list[tuple[str, ...]] = []

    async def main() -> list[Any]:
        async with AsyncLimiter.from_url("memory://", clock=clock) as limiter:
            limited = fastapi_dependency(limiter, narrow, legacy_headers=True)
            app = FastAPI()

            @app.get("/narrow")
            async def endpoint(request: StarletteRequest, _: Any = Depends(limited)) -> Any:  # noqa: B008
                seen.append(tuple(d.policy for d in request.state.ratekeeper))
                return {"ok": True}

            app.add_middleware(
                RateLimitMiddleware,
                limiter=limiter,
                rules=[Rule("/*", Policy("api", "20/minute"), deduct_when=deduct)],
                legacy_headers=True,
            )
            replies = []
            async with asgi_client(app) as http:
                for wait in (0.0, 0.0, 12.5):
                    clock.advance(wait)
                    replies.append(await http.get("/narrow"))
            return replies

    replies = asyncio.run(main())
    assert [r.status_code for r in replies] == [200, 200, 429]
    # The decisions of both limiters (one counted on the outcome is charged after the view).
    assert seen == [("narrow",) if deduct else ("api", "narrow")] * 2
    for remaining, admitted in zip((1, 0), replies[:2], strict=True):
        assert admitted.headers["ratelimit-policy"] == '"api";q=20;w=60, "narrow";q=2;w=60'
        assert admitted.headers["ratelimit"] == f'"narrow";r={remaining};t=60'
        assert admitted.headers["x-ratelimit-limit"] == "2"
        assert admitted.headers["x-ratelimit-remaining"] == str(remaining)
        assert "retry-after" not in admitted.headers
    denied = replies[2]
    assert denied.json()["policy"] == "narrow"
    assert denied.json()["retry_after"] == 47.5
    assert denied.headers["ratelimit-policy"] == '"narrow";q=2;w=60'
    assert denied.headers["ratelimit"] == '"narrow";r=0;t=48'
    assert denied.headers["retry-after"] == "48"
    assert denied.headers["x-ratelimit-limit"] == "2"
    assert denied.headers["x-ratelimit-remaining"] == "0"
