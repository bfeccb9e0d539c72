"""One behaviour whatever the entry point:

* ``enabled=False`` passes every request on untouched and makes no store call, counted by a
  private server's ``INFO commandstats`` (ASGI and WSGI, with an application policy, a
  ``deduct_when`` rule and a policy callable configured);
* ``fastapi_dependency`` answers a denial with the very bytes and headers the middleware
  sends (429 problem+json, RateLimit headers, Retry-After);
* ``flask_limit`` limits ``async def`` Flask views (a real Flask app, ``flask[async]``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import flask
import pytest
from fastapi import Depends, FastAPI

from ratekeeper import AsyncLimiter, Decision, Limiter, ManualClock, Policy
from ratekeeper._http import Request
from ratekeeper.asgi import RateLimitMiddleware, Rule, fastapi_dependency
from ratekeeper.identity import header
from ratekeeper.wsgi import RateLimitMiddleware as WSGIMiddleware
from ratekeeper.wsgi import flask_limit

from ..support.private_servers import private_servers
from ..support.servers import RedisServer
from ..support.web_apps import asgi_client, exact_options, plain_app

pytestmark = pytest.mark.usefixtures("binaries")

PEER = "203.0.113.7"


@pytest.fixture(scope="module")
def quiet_server() -> Iterator[RedisServer]:
    """A private server no other test sends commands to: its command counts are ours."""
    with private_servers() as started:
        yield next(iter(started.values()))


def everything(**extra: Any) -> dict[str, Any]:
    """Middleware options that would make store calls on every request, were it enabled."""

    async def plan(request: Request) -> Policy:
        return Policy("plan", "2/minute")

    return {
        "policy": Policy("kill-default", "2/minute"),
        "rules": [
            Rule("/login", Policy("kill-login", "1/minute"), deduct_when=lambda s: True),
            Rule("/plan", plan),
        ],
        "application_policy": Policy("kill-app", "3/minute"),
        **extra,
    }


def test_disabled_asgi_middleware_makes_no_store_call(quiet_server: RedisServer, key_prefix: str):
    url = quiet_server.url

    async def main() -> tuple[list[Any], int, int]:
        async with AsyncLimiter.from_url(url, **exact_options(url, key_prefix)) as limiter:
            off = RateLimitMiddleware(plain_app, limiter=limiter, enabled=False, **everything())
            on = RateLimitMiddleware(plain_app, limiter=limiter, **everything())
            async with asgi_client(on) as http:
                assert (await http.get("/items")).status_code == 200  # the store is reachable
            before = quiet_server.command_calls()
            async with asgi_client(off) as http:
                replies = []
                for path in ["/items", "/login", "/plan"] * 10:
                    replies.append(
                        await http.post(path) if path == "/login" else await http.get(path)
                    )
            after = quiet_server.command_calls()
            async with asgi_client(on) as http:
                more = [await http.get("/items") for _ in range(3)]
            counted = quiet_server.command_calls()
        return [*replies, *more], after - before, counted - after

    replies, calls_off, calls_on = asyncio.run(main())
    assert calls_off == 0
    assert calls_on >= 3  # the same count sees an enabled middleware's calls
    off, on = replies[:30], replies[30:]
    assert all(r.status_code == 200 for r in off)
    assert not [h for r in off for h in r.headers if "ratelimit" in h or h == "retry-after"]
    assert [r.status_code for r in on] == [200, 429, 429]  # 1 earlier + 1, then the limit


def test_disabled_wsgi_middleware_makes_no_store_call(quiet_server: RedisServer, key_prefix: str):
    seen: list[Any] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.append(environ.get("ratekeeper", "absent"))
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    url = quiet_server.url
    with Limiter.from_url(url, **exact_options(url, key_prefix)) as limiter:
        options = everything()
        options["rules"] = options["rules"][:1]  # a sync integration takes no async callable
        wrapped = WSGIMiddleware(app, limiter=limiter, enabled=False, **options)
        before = quiet_server.command_calls()
        statuses = []
        for path in ["/items", "/login"] * 10:
            got: list[Any] = []
            environ = {"REQUEST_METHOD": "POST", "PATH_INFO": path, "REMOTE_ADDR": PEER}
            b"".join(wrapped(environ, lambda s, h, e=None, got=got: got.extend([s, h])))
            statuses.append(got[0])
            assert not [n for n, _ in got[1] if "ratelimit" in n.lower()]
        after = quiet_server.command_calls()
    assert after == before
    assert statuses == ["200 OK"] * 20
    assert seen == ["absent"] * 20  # untouched: not even the environ


# --- fastapi_dependency answers as the middleware does ------------------------------------------


def test_fastapi_dependency_answers_exactly_as_the_middleware():
    clock = ManualClock(1_700_000_000.0)
    policy = Policy("same", "2/minute")

    async def main() -> tuple[list[Any], list[Any]]:
        async with AsyncLimiter.from_url("memory://", clock=clock) as limiter:
            app = FastAPI()
            limited = fastapi_dependency(limiter, policy, key=header("x-api-key"))

            @app.get("/dep")
            async def dep(decision: Decision = Depends(limited)) -> dict[str, int]:  # noqa: B008
                return {"remaining": decision.remaining}

            middleware = RateLimitMiddleware(
                plain_app, limiter=limiter, policy=policy, key=header("x-api-key")
            )
            async with asgi_client(app) as http:
                by_dep = [await http.get("/dep", headers={"X-API-Key": "a"}) for _ in range(3)]
            async with asgi_client(middleware) as http:
                by_mw = [await http.get("/mw", headers={"X-API-Key": "b"}) for _ in range(3)]
        return by_dep, by_mw

    by_dep, by_mw = asyncio.run(main())
    assert [r.status_code for r in by_dep] == [r.status_code for r in by_mw] == [200, 200, 429]
    dep_denied, mw_denied = by_dep[2], by_mw[2]
    assert dep_denied.content == mw_denied.content  # the same problem+json, byte for byte
    names = ("content-type", "content-length", "ratelimit-policy", "ratelimit", "retry-after")
    for name in names:
        assert dep_denied.headers[name] == mw_denied.headers[name], name
    assert dep_denied.headers["content-type"] == "application/problem+json"
    for ok_dep, ok_mw in zip(by_dep[:2], by_mw[:2], strict=True):
        assert ok_dep.headers["ratelimit"] == ok_mw.headers["ratelimit"]


def test_an_apps_own_handler_for_the_denial_wins():
    from ratekeeper.asgi import RateLimitExceeded

    async def main() -> Any:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = FastAPI()

            @app.exception_handler(RateLimitExceeded)
            async def mine(request: Any, exc: RateLimitExceeded) -> Any:
                from fastapi.responses import PlainTextResponse

                return PlainTextResponse("slow down", status_code=exc.response[0])

            limited = fastapi_dependency(limiter, Policy("mine", "1/minute"))

            @app.get("/x", dependencies=[Depends(limited)])
            async def x() -> dict[str, bool]:
                return {"ok": True}

            async with asgi_client(app) as http:
                return [await http.get("/x") for _ in range(2)]

    ok, denied = asyncio.run(main())
    assert ok.status_code == 200
    assert denied.status_code == 429
    assert denied.text == "slow down"


# --- flask_limit on async views -----------------------------------------------------------------


def test_flask_limit_on_async_and_sync_views(backend: str, key_prefix: str):
    search = Policy("flask-async", "2/minute")
    seen: list[tuple[str, ...]] = []
    with Limiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
        app = flask.Flask("ratekeeper-async")

        @app.get("/async")
        @flask_limit(limiter, search, key=header("x-api-key"))
        async def async_view() -> Any:
            await asyncio.sleep(0)
            seen.append(tuple(d.policy for d in flask.request.environ["ratekeeper"]))
            return {"view": "async"}

        @app.get("/sync")
        @flask_limit(limiter, search, key=header("x-api-key"))
        def sync_view() -> Any:
            return {"view": "sync"}

        with app.test_client() as client:
            get = lambda path: client.get(path, headers={"X-API-Key": "ann"})  # noqa: E731
            replies = [get("/async"), get("/sync"), get("/async"), get("/sync")]
    assert [r.status_code for r in replies] == [200, 200, 429, 429]
    assert replies[0].json == {"view": "async"}
    assert replies[1].json == {"view": "sync"}
    assert replies[0].headers["RateLimit"] == '"flask-async";r=1;t=60'
    assert replies[2].headers["Content-Type"] == "application/problem+json"
    assert replies[2].json["policy"] == "flask-async"
    assert seen == [("flask-async",)]  # the denied async view never ran
