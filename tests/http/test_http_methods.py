"""Methods as frameworks route them, through real apps: a rule naming GET charges HEAD on
Starlette, FastAPI and Flask (the middleware, the FastAPI dependency and the Flask decorator);
CORS preflights are not charged unless asked for, or unless the rule names OPTIONS.

Each app counts how often its handler runs: a request the limiter lets through and the
framework routes to the GET handler must be one the limiter charged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import flask
import pytest
import werkzeug.test
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from ratekeeper import AsyncLimiter, ConfigError, Decision, Limiter, Policy, asgi, wsgi
from ratekeeper.asgi import fastapi_dependency
from ratekeeper.wsgi import flask_limit

from ..support.web_apps import asgi_client, exact_options, plain_app

PEER = "203.0.113.7"
#: Mixed GETs and HEADs: the GET rule's two requests are a HEAD and a GET.
MIXED = ["HEAD", "GET", "HEAD", "GET", "HEAD", "GET", "HEAD"]
ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}


def search_rule() -> asgi.Rule:
    return asgi.Rule("/search*", Policy("search", "2/minute"), methods={"GET"})


# --- GET and HEAD --------------------------------------------------------------------------------


def starlette_search(limiter: AsyncLimiter, runs: list[str], **middleware: Any) -> Starlette:
    async def search(request: StarletteRequest) -> JSONResponse:
        runs.append(request.method)
        return JSONResponse({"results": ["apple"]})

    # Starlette's Route serves HEAD with a GET endpoint.
    app = Starlette(routes=[Route("/search", search, methods=["GET"])])
    app.add_middleware(asgi.RateLimitMiddleware, limiter=limiter, **middleware)
    return app


def fastapi_search(limiter: AsyncLimiter, runs: list[str], **middleware: Any) -> FastAPI:
    app = FastAPI()

    # FastAPI's @app.get answers HEAD with 405; api_route serves both with one handler.
    @app.api_route("/search", methods=["GET", "HEAD"])
    async def search(request: StarletteRequest) -> dict[str, list[str]]:
        runs.append(request.method)
        return {"results": ["apple"]}

    app.add_middleware(asgi.RateLimitMiddleware, limiter=limiter, **middleware)
    return app


async def send_all(app: Any, methods: list[str], path: str = "/search") -> list[Any]:
    async with asgi_client(app, client=(PEER, 40000)) as http:
        return [await http.request(method, path) for method in methods]


@pytest.mark.parametrize("build", [starlette_search, fastapi_search])
def test_a_get_rule_charges_head_behind_the_asgi_middleware(
    build: Any, backend: str, key_prefix: str
):
    runs: list[str] = []

    async def main() -> list[Any]:
        async with AsyncLimiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
            return await send_all(build(limiter, runs, rules=[search_rule()]), MIXED)

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200, 200] + [429] * 5
    assert runs == ["HEAD", "GET"]  # the handler ran exactly twice
    assert [r.headers["ratelimit"] for r in responses[:2]] == [
        '"search";r=1;t=60',
        '"search";r=0;t=60',
    ]
    assert responses[0].content == b""  # a HEAD answer has no body, a HEAD 429 neither
    assert responses[2].content == b""
    assert 1 <= int(responses[2].headers["retry-after"]) <= 60
    assert responses[3].json()["status"] == 429


def test_a_get_rule_does_not_charge_other_methods():
    async def main() -> list[int]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = asgi.RateLimitMiddleware(plain_app, limiter=limiter, rules=[search_rule()])
            responses = await send_all(app, ["POST", "PUT", "DELETE", "PATCH"] * 3)
            responses += await send_all(app, ["GET", "HEAD", "GET"])
            return [r.status_code for r in responses]

    assert asyncio.run(main()) == [200] * 12 + [200, 200, 429]


def test_a_head_only_rule_does_not_charge_get():
    async def main() -> list[int]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            rule = asgi.Rule("/*", Policy("head", "1/minute"), methods={"HEAD"})
            app = asgi.RateLimitMiddleware(plain_app, limiter=limiter, rules=[rule])
            return [r.status_code for r in await send_all(app, ["GET", "GET", "HEAD", "HEAD"])]

    assert asyncio.run(main()) == [200, 200, 200, 429]


def test_the_fastapi_dependency_charges_head_like_get():
    runs: list[str] = []

    async def main() -> list[Any]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            limited = fastapi_dependency(limiter, Policy("dep-search", "2/minute"))
            app = FastAPI()

            @app.api_route("/search", methods=["GET", "HEAD"])
            async def search(
                request: StarletteRequest,
                decision: Decision = Depends(limited),  # noqa: B008
            ) -> dict[str, int]:
                runs.append(request.method)
                return {"remaining": decision.remaining}

            return await send_all(app, MIXED)

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200, 200] + [429] * 5
    assert runs == ["HEAD", "GET"]
    assert responses[1].json() == {"remaining": 0}


def flask_search(limiter: Limiter, runs: list[str], **middleware: Any) -> flask.Flask:
    app = flask.Flask("ratekeeper-methods")

    @app.get("/search")  # Flask serves HEAD with it
    def search() -> Any:
        runs.append(flask.request.method)
        return {"results": ["apple"]}

    app.wsgi_app = wsgi.RateLimitMiddleware(app.wsgi_app, limiter=limiter, **middleware)  # type: ignore[method-assign]
    return app


def test_a_get_rule_charges_head_behind_the_wsgi_middleware_on_flask(backend: str, key_prefix: str):
    runs: list[str] = []
    with Limiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
        app = flask_search(limiter, runs, rules=[search_rule()])
        with app.test_client() as client:
            responses = [
                client.open("/search", method=m, environ_base={"REMOTE_ADDR": PEER}) for m in MIXED
            ]
    assert [r.status_code for r in responses] == [200, 200] + [429] * 5
    assert runs == ["HEAD", "GET"]
    assert responses[1].headers["RateLimit"] == '"search";r=0;t=60'
    assert responses[3].json["status"] == 429


def test_the_flask_decorator_charges_head_like_get():
    runs: list[str] = []
    with Limiter.from_url("memory://") as limiter:
        app = flask.Flask("ratekeeper-methods-decorator")

        @app.get("/search")
        @flask_limit(limiter, Policy("deco-search", "2/minute"))
        def search() -> Any:
            runs.append(flask.request.method)
            return {"results": ["apple"]}

        with app.test_client() as client:
            responses = [client.open("/search", method=m) for m in MIXED]
    assert [r.status_code for r in responses] == [200, 200] + [429] * 5
    assert runs == ["HEAD", "GET"]


# --- OPTIONS and CORS preflights -----------------------------------------------------------------


def cors_app(limiter: AsyncLimiter, runs: list[str], **middleware: Any) -> Starlette:
    """Starlette with CORSMiddleware inside the rate limiter (it answers the preflights)."""

    async def create(request: StarletteRequest) -> JSONResponse:
        runs.append(request.method)
        return JSONResponse({"created": True})

    return Starlette(
        routes=[Route("/items", create, methods=["GET", "POST"])],
        middleware=[
            Middleware(asgi.RateLimitMiddleware, limiter=limiter, **middleware),
            Middleware(CORSMiddleware, allow_origins=[ORIGIN], allow_methods=["GET", "POST"]),
        ],
    )


def run_cors(
    runs: list[str], preflights: int, posts: int, **middleware: Any
) -> tuple[list[Any], list[Any]]:
    async def main() -> tuple[list[Any], list[Any]]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = cors_app(limiter, runs, **middleware)
            async with asgi_client(app, client=(PEER, 40000)) as http:
                pre = [await http.options("/items", headers=PREFLIGHT) for _ in range(preflights)]
                real = [await http.post("/items", headers={"Origin": ORIGIN}) for _ in range(posts)]
            return pre, real

    return asyncio.run(main())


def test_cors_preflights_are_not_charged_by_default():
    runs: list[str] = []
    preflights, posts = run_cors(runs, 5, 3, policy=Policy("cors", "2/minute"))
    assert [r.status_code for r in preflights] == [200] * 5
    for r in preflights:
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "ratelimit" not in r.headers
    # The requests the preflights announced are charged, with their whole budget.
    assert [r.status_code for r in posts] == [200, 200, 429]
    assert posts[0].headers["ratelimit"] == '"cors";r=1;t=60'
    assert runs == ["POST", "POST"]


def test_cors_preflights_are_charged_when_asked():
    runs: list[str] = []
    preflights, posts = run_cors(runs, 3, 1, policy=Policy("cors", "2/minute"), preflight="charge")
    assert [r.status_code for r in preflights] == [200, 200, 429]
    assert preflights[0].headers["ratelimit"] == '"cors";r=1;t=60'
    assert [r.status_code for r in posts] == [429]
    assert runs == []


def test_a_rule_naming_options_charges_preflights():
    runs: list[str] = []
    rule = asgi.Rule("/items", Policy("opts", "2/minute"), methods={"OPTIONS", "POST"})
    preflights, posts = run_cors(runs, 3, 1, rules=[rule])
    assert [r.status_code for r in preflights] == [200, 200, 429]
    assert preflights[1].headers["ratelimit"] == '"opts";r=0;t=60'
    assert [r.status_code for r in posts] == [429]


def test_options_that_is_no_preflight_is_charged():
    """Only OPTIONS with both Origin and Access-Control-Request-Method is a preflight."""

    async def main() -> list[int]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = asgi.RateLimitMiddleware(
                plain_app, limiter=limiter, policy=Policy("o", "3/minute")
            )
            async with asgi_client(app, client=(PEER, 40000)) as http:
                plain = await http.options("/")
                origin_only = await http.options("/", headers={"Origin": ORIGIN})
                method_only = await http.options(
                    "/", headers={"Access-Control-Request-Method": "POST"}
                )
                after = await http.get("/")
            return [r.status_code for r in (plain, origin_only, method_only, after)]

    assert asyncio.run(main()) == [200, 200, 200, 429]


def test_a_preflight_is_not_charged_by_a_get_rule_nor_the_default():
    async def main() -> list[Any]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = asgi.RateLimitMiddleware(
                plain_app,
                limiter=limiter,
                policy=Policy("default", "1/minute"),
                rules=[search_rule()],
            )
            async with asgi_client(app, client=(PEER, 40000)) as http:
                pre = [await http.options("/search", headers=PREFLIGHT) for _ in range(3)]
                return pre + [await http.get("/other") for _ in range(2)]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200, 200, 200, 200, 429]
    assert all("ratelimit" not in r.headers for r in responses[:3])


def flask_cors_app(limiter: Limiter, **middleware: Any) -> flask.Flask:
    app = flask.Flask("ratekeeper-preflight")

    @app.post("/items")  # Flask answers OPTIONS itself
    def create() -> Any:
        return {"created": True}

    app.wsgi_app = wsgi.RateLimitMiddleware(app.wsgi_app, limiter=limiter, **middleware)  # type: ignore[method-assign]
    return app


@pytest.mark.parametrize(("preflight", "expected"), [("exempt", [200] * 4), ("charge", [200, 429])])
def test_preflights_behind_the_wsgi_middleware_on_flask(preflight: str, expected: list[int]):
    with Limiter.from_url("memory://") as limiter:
        app = flask_cors_app(limiter, policy=Policy("fl-cors", "1/minute"), preflight=preflight)
        with app.test_client() as client:
            pre = [client.options("/items", headers=PREFLIGHT) for _ in range(len(expected))]
            post = client.post("/items", headers={"Origin": ORIGIN})
    assert [r.status_code for r in pre] == expected
    assert "POST" in pre[0].headers["Allow"]
    assert post.status_code == (200 if preflight == "exempt" else 429)


@pytest.mark.parametrize(("preflight", "expected"), [("exempt", [200] * 3), ("charge", [200, 429])])
def test_preflights_through_the_fastapi_dependency(preflight: str, expected: list[int]):
    decisions: list[Decision | None] = []

    async def main() -> list[int]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            limited = fastapi_dependency(
                limiter, Policy("dep-cors", "1/minute"), preflight=preflight
            )  # type: ignore[arg-type]
            app = FastAPI()

            @app.options("/items")
            async def options(decision: Decision | None = Depends(limited)) -> None:  # noqa: B008
                decisions.append(decision)

            async with asgi_client(app, client=(PEER, 40000)) as http:
                responses = [
                    await http.options("/items", headers=PREFLIGHT) for _ in range(len(expected))
                ]
            return [r.status_code for r in responses]

    assert asyncio.run(main()) == expected
    if preflight == "exempt":
        assert decisions == [None] * 3
    else:
        assert decisions[0] is not None
        assert decisions[0].remaining == 0


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("preflight", ["skip", "", None, True, "EXEMPT"])
def test_a_bad_preflight_option_is_a_config_error(preflight: Any):
    policy = Policy("p", "1/minute")
    with Limiter.from_url("memory://") as limiter:
        with pytest.raises(ConfigError, match=r"preflight must be one of 'exempt', 'charge'"):
            wsgi.RateLimitMiddleware(plain_app, limiter=limiter, policy=policy, preflight=preflight)
        with pytest.raises(ConfigError, match="preflight"):
            flask_limit(limiter, policy, preflight=preflight)

    async def main() -> None:
        async with AsyncLimiter.from_url("memory://") as limiter:
            with pytest.raises(ConfigError, match="preflight"):
                asgi.RateLimitMiddleware(
                    plain_app, limiter=limiter, policy=policy, preflight=preflight
                )
            with pytest.raises(ConfigError, match="preflight"):
                fastapi_dependency(limiter, policy, preflight=preflight)

    asyncio.run(main())


# --- method names in any case ---------------------------------------------------------------

LOGIN_POST = Policy("login-post", "3/minute")


def test_a_lower_case_post_is_charged_by_a_post_rule_behind_the_wsgi_middleware_on_flask():
    """Werkzeug routes a ``post`` to the POST view: the POST rule must charge it."""
    runs: list[str] = []
    with Limiter.from_url("memory://") as limiter:
        app = flask.Flask("ratekeeper-lower-case")

        @app.post("/login")
        def login() -> Any:
            runs.append(flask.request.method)
            return {"ok": True}

        rule = wsgi.Rule("/login", LOGIN_POST, methods={"POST"})
        app.wsgi_app = wsgi.RateLimitMiddleware(app.wsgi_app, limiter=limiter, rules=[rule])  # type: ignore[method-assign]
        statuses = []
        for _ in range(9):
            environ = werkzeug.test.EnvironBuilder("/login", method="POST").get_environ()
            environ["REQUEST_METHOD"] = "post"  # as a client may send it; test clients upper it
            response = werkzeug.test.run_wsgi_app(app, environ)
            statuses.append(int(response[1].split()[0]))
    assert statuses == [200] * 3 + [429] * 6
    assert runs == ["POST"] * 3  # the view ran exactly as often as the limit allows


def test_a_lower_case_post_is_charged_by_a_post_rule_behind_the_asgi_middleware():
    runs: list[str] = []

    async def handler(scope: dict[str, Any], receive: Any, send: Any) -> None:
        runs.append(scope["method"])
        await plain_app(scope, receive, send)

    async def main() -> list[int]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            rule = asgi.Rule("/login", LOGIN_POST, methods={"POST"})
            app = asgi.RateLimitMiddleware(handler, limiter=limiter, rules=[rule])
            statuses = []
            for _ in range(9):
                sent: list[dict[str, Any]] = []

                async def receive() -> dict[str, Any]:
                    return {"type": "http.request", "body": b"", "more_body": False}

                async def send(message: dict[str, Any]) -> None:
                    sent.append(message)  # noqa: B023 (awaited before the next round)

                scope = {
                    "type": "http",
                    "method": "post",  # raw, as a server passes what the client sent
                    "path": "/login",
                    "headers": [],
                    "client": (PEER, 40000),
                }
                await app(scope, receive, send)
                statuses.append(sent[0]["status"])
            return statuses

    assert asyncio.run(main()) == [200] * 3 + [429] * 6
    assert runs == ["post"] * 3


@pytest.mark.parametrize("methods", [{"PSOT"}, {"GET", "get", "Fetch"}])
def test_a_rule_naming_no_http_method_is_refused(methods: set[str]):
    bad = sorted(m.upper() for m in methods if m.upper() not in {"GET"})
    with pytest.raises(ConfigError, match=f"rule methods {bad[0]!r}.* are not HTTP methods"):
        asgi.Rule("/login", LOGIN_POST, methods=methods)
    assert asgi.Rule("/cache/*", LOGIN_POST, methods={"purge", "PROPFIND"}).methods == {
        "PURGE",
        "PROPFIND",
    }
