"""Limits chosen per request, stacked and counted on the outcome, in process on every backend:

* plans (free, pro) chosen from a header or from a token's claim by sync and async policy
  callables, with an async key function: exactly each plan's limit per identity, under
  concurrent requests;
* an application policy stacked on the route's: admitted only while both admit, and exactly
  what a denial by one consumed from the other;
* ``deduct_when``: only the statuses it names are charged, a spent budget is refused before
  the handler runs (ASGI and WSGI);
* the decisions charged reach the handler (``request.state.ratekeeper``, the WSGI environ);
* ``enabled=False``: no store call at all (counted on a real server).

The cross-process versions (two uvicorn workers) are in ``test_web_servers.py``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from ratekeeper import AsyncLimiter, ConfigError, Decision, Limiter, ManualClock, Policy
from ratekeeper._http import Limiting, Request, several_workers
from ratekeeper.asgi import RateLimitMiddleware, Rule
from ratekeeper.identity import header
from ratekeeper.wsgi import RateLimitMiddleware as WSGIMiddleware

from ..support.web_apps import asgi_client, exact_options, plain_app

#: Client time that stands still, so header values (``t=``) are exact however slow the
#: machine; the store still decides (the default server clock is tested everywhere else).
T0 = 1_700_000_000.0


def still(backend: str, key_prefix: str, **extra: Any) -> dict[str, Any]:
    return {**exact_options(backend, key_prefix), "clock": ManualClock(T0), **extra}


FREE = Policy("plan-free", "3/minute")
PRO = Policy("plan-pro", "7/minute")
LIMITS = {"free": 3, "pro": 7}


def token(sub: str, plan: str) -> str:
    """A bearer token whose payload carries the claims (unsigned: the signature check is the
    auth layer's job; the limiter only reads the claim it verified)."""
    payload = base64.urlsafe_b64encode(json.dumps({"sub": sub, "plan": plan}).encode())
    return f"h.{payload.decode().rstrip('=')}.s"


def claims(request: Request) -> dict[str, Any]:
    value = request.headers.get("authorization", "")
    _, _, tok = value.partition("Bearer ")
    parts = tok.split(".")
    if len(parts) != 3:
        return {}
    padded = parts[1] + "=" * (-len(parts[1]) % 4)
    claimed: dict[str, Any] = json.loads(base64.urlsafe_b64decode(padded))
    return claimed


def plan_from_header(request: Request) -> Policy:
    return PRO if request.headers.get("x-plan") == "pro" else FREE


async def plan_from_header_async(request: Request) -> Policy:
    await asyncio.sleep(0)  # a real await: the driver must await it
    return plan_from_header(request)


def plan_from_claim(request: Request) -> Policy:
    return PRO if claims(request).get("plan") == "pro" else FREE


async def plan_from_claim_async(request: Request) -> Policy:
    await asyncio.sleep(0)
    return plan_from_claim(request)


async def user_of(request: Request) -> str | None:
    """The async key function: the user, from the API key header or the token's subject."""
    await asyncio.sleep(0)
    sub = claims(request).get("sub") or request.headers.get("x-user")
    return f"user:{sub}" if sub else None


def state_app() -> Starlette:
    """An app that reports what the middleware put in ``request.state.ratekeeper``."""

    async def report(request: StarletteRequest) -> JSONResponse:
        decisions: tuple[Decision, ...] = request.state.ratekeeper
        return JSONResponse({"policies": [d.policy for d in decisions]})

    return Starlette(routes=[Route("/{path:path}", report, methods=["GET", "POST"])])


CHOICES = {
    "header-sync": (plan_from_header, "header"),
    "header-async": (plan_from_header_async, "header"),
    "claim-sync": (plan_from_claim, "claim"),
    "claim-async": (plan_from_claim_async, "claim"),
}


@pytest.mark.parametrize("choice", list(CHOICES))
def test_plans_admit_exactly_each_plans_limit_per_identity(
    choice: str, backend: str, key_prefix: str
):
    chooser, source = CHOICES[choice]
    users = [("ann", "free"), ("bob", "free"), ("cat", "pro"), ("dan", "pro")]

    def headers(user: str, plan: str) -> dict[str, str]:
        if source == "header":
            return {"X-User": user, "X-Plan": plan}
        return {"Authorization": f"Bearer {token(user, plan)}"}

    async def main() -> dict[str, list[Any]]:
        options = still(backend, key_prefix)
        async with AsyncLimiter.from_url(backend, **options) as limiter:
            app = state_app()
            app.add_middleware(
                RateLimitMiddleware,
                limiter=limiter,
                rules=[Rule("/api/*", chooser, key=user_of)],
            )
            async with asgi_client(app) as http:
                # Every user's requests at once, interleaved: exact under concurrency.
                sent = [(u, p) for _ in range(LIMITS["pro"] + 4) for u, p in users]
                replies = await asyncio.gather(
                    *(http.get("/api/report", headers=headers(u, p)) for u, p in sent)
                )
        out: dict[str, list[Any]] = {u: [] for u, _ in users}
        for (u, _), r in zip(sent, replies, strict=True):
            out[u].append(r)
        return out

    for (user, plan), replies in zip(users, asyncio.run(main()).values(), strict=True):
        ok = [r for r in replies if r.status_code == 200]
        assert len(ok) == LIMITS[plan], (user, [r.status_code for r in replies])
        assert {r.status_code for r in replies} <= {200, 429}
        name = f"plan-{plan}"
        assert {r.json()["policies"][0] for r in ok} == {name}
        assert {r.headers["ratelimit-policy"] for r in replies} == {
            f'"{name}";q={LIMITS[plan]};w=60'
        }
        remaining = sorted(
            int(re.fullmatch(rf'"{name}";r=(\d+);t=60', r.headers["ratelimit"])[1])  # type: ignore[index]
            for r in ok
        )
        assert remaining == list(range(LIMITS[plan]))


def test_a_policy_callable_returning_none_leaves_the_request_unlimited():
    async def main() -> list[Any]:
        async with AsyncLimiter.from_url("memory://") as limiter:

            def plan(request: Request) -> Policy | None:
                return None if request.headers.get("x-plan") == "internal" else FREE

            app = RateLimitMiddleware(plain_app, limiter=limiter, rules=[Rule("*", plan)])
            async with asgi_client(app) as http:
                internal = [await http.get("/", headers={"X-Plan": "internal"}) for _ in range(5)]
                free = [await http.get("/") for _ in range(4)]
        return internal + free

    replies = asyncio.run(main())
    assert [r.status_code for r in replies] == [200] * 5 + [200, 200, 200, 429]
    assert all("ratelimit" not in r.headers for r in replies[:5])


def test_cost_callables_sync_and_async():
    bulk = Policy("bulk", "10/minute")

    async def size(request: Request) -> int:
        await asyncio.sleep(0)
        return int(request.headers.get("x-items", "1"))

    async def main() -> list[Any]:
        async with AsyncLimiter.from_url("memory://", clock=ManualClock(T0)) as limiter:
            app = RateLimitMiddleware(
                plain_app,
                limiter=limiter,
                rules=[
                    Rule("/async", bulk, cost=size),
                    Rule("/sync", bulk, cost=lambda r: int(r.headers["x-items"])),
                ],
            )
            async with asgi_client(app) as http:
                return [
                    await http.get("/async", headers={"X-Items": "4"}),
                    await http.get("/sync", headers={"X-Items": "5"}),
                    await http.get("/sync", headers={"X-Items": "2"}),
                    await http.get("/async", headers={"X-Items": "1"}),
                ]

    replies = asyncio.run(main())
    assert [r.status_code for r in replies] == [200, 200, 429, 200]
    assert [r.headers["ratelimit"] for r in replies] == [
        '"bulk";r=6;t=60',
        '"bulk";r=1;t=60',
        '"bulk";r=1;t=60',
        '"bulk";r=0;t=60',
    ]


def test_bad_choices_are_refused_when_configured_or_reported_as_bugs():
    async def async_plan(request: Request) -> Policy:
        return FREE

    # A sync integration cannot await: refused at configuration time, naming the rule.
    with pytest.raises(ConfigError, match=r"policy of rule '/x' is async"):
        Limiting(rules=[Rule("/x", async_plan)])
    with Limiter.from_url("memory://") as limiter, pytest.raises(ConfigError, match="key is"):
        WSGIMiddleware(plain_wsgi, limiter=limiter, policy=FREE, key=user_of)
    for bad in (
        lambda: Rule("/x", FREE, cost=0),
        lambda: Rule("/x", FREE, key="user"),  # type: ignore[arg-type]
        lambda: Rule("/x", FREE, deduct_when=401),  # type: ignore[arg-type]
        lambda: Rule("/x", None, deduct_when=lambda s: True),
        lambda: Limiting(policy=FREE, application_policy="app"),  # type: ignore[arg-type]
        lambda: Limiting(policy=FREE, application_key=header("x")),
        lambda: Limiting(policy=FREE, enabled="no"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ConfigError):
            bad()

    # A callable that returns the wrong thing is a bug: it reaches the caller, never a pass.
    async def main(rule: Rule) -> None:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = RateLimitMiddleware(plain_app, limiter=limiter, rules=[rule])
            async with asgi_client(app) as http:
                await http.get("/x")

    with pytest.raises(TypeError, match="not a Policy"):
        asyncio.run(main(Rule("/x", lambda r: "free")))
    with pytest.raises(TypeError, match="not an int >= 1"):
        asyncio.run(main(Rule("/x", FREE, cost=lambda r: 0)))
    sneaky = lambda r: plan_from_header_async(r)  # noqa: E731, PLW0108
    with pytest.raises(TypeError, match="declare it with async def"):
        asyncio.run(main(Rule("/x", sneaky)))


def plain_wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def call_wsgi(app: Any, environ: dict[str, Any]) -> tuple[int, dict[str, str]]:
    """Call a WSGI app: its status code and headers."""
    got: list[Any] = []
    b"".join(app(environ, lambda status, headers, exc_info=None: got.extend([status, headers])))
    return int(got[0].split()[0]), dict(got[1])


# --- stacked: an application policy and the route's ---------------------------------------------

APP = Policy("app", "5/minute")
SEARCH = Policy("search", "3/minute")


def stacked_app(limiter: AsyncLimiter) -> Any:
    app = state_app()
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        key=header("x-api-key"),
        rules=[Rule("/search", SEARCH)],
        exempt=["/health"],
        application_policy=APP,
    )
    return app


@pytest.mark.parametrize("deny_cache", [10_000, 0])
def test_a_denial_by_the_route_policy_consumes_nothing_from_the_application_policy(
    backend: str, key_prefix: str, deny_cache: int
):
    async def main() -> tuple[list[Any], list[Decision]]:
        options = still(backend, key_prefix, deny_cache=deny_cache)
        async with AsyncLimiter.from_url(backend, **options) as limiter:
            key = {"X-API-Key": "alice"}
            identity = header("x-api-key")(Request("GET", "/", {"x-api-key": "alice"}, None))
            assert identity is not None
            async with asgi_client(stacked_app(limiter)) as http:
                replies = [await http.get("/search", headers=key) for _ in range(6)]
                after_search = await limiter.peek(APP, identity)
                replies += [await http.get("/items", headers=key) for _ in range(3)]
                replies += [await http.get("/health", headers=key) for _ in range(3)]
                after_items = await limiter.peek(APP, identity)
        return replies, [after_search, after_items]

    replies, (after_search, after_items) = asyncio.run(main())
    statuses = [r.status_code for r in replies]
    # 3 searches pass both; 3 are denied by the route's policy...
    assert statuses[:6] == [200, 200, 200, 429, 429, 429]
    # ...and consumed nothing from the application's: 5 - 3 = 2 left, then /items spends them.
    assert after_search.remaining == 2
    assert statuses[6:9] == [200, 200, 429]
    assert after_items.remaining == 0
    assert statuses[9:] == [200, 200, 200]  # exempt from both
    first = replies[0]
    assert first.json() == {"policies": ["search", "app"]}
    assert first.headers["ratelimit-policy"] == '"search";q=3;w=60, "app";q=5;w=60'
    assert first.headers["ratelimit"] == '"search";r=2;t=60'  # the most constraining
    assert replies[2].headers["ratelimit"] == '"search";r=0;t=60'
    denied = replies[3]
    assert denied.json()["policy"] == "search"
    assert denied.headers["ratelimit"] == '"search";r=0;t=60'
    assert replies[7].headers["ratelimit"] == '"app";r=0;t=60'
    assert replies[8].json()["policy"] == "app"


@pytest.mark.parametrize("deny_cache", [10_000, 0])
def test_what_a_denial_by_the_application_policy_consumes_from_the_route_policy(
    backend: str, key_prefix: str, deny_cache: int
):
    """The figure: the first denial by the application policy after the route's admitted
    consumed 1 unit (the request's cost) of the route's policy; with the deny cache on (the
    default), the denials that follow while it holds consumed nothing; without it, each one
    consumed 1, until the route's policy denies first."""
    route = Policy("wide", "4/minute")

    async def main() -> tuple[list[int], list[int]]:
        options = still(backend, key_prefix, deny_cache=deny_cache)
        async with AsyncLimiter.from_url(backend, **options) as limiter:
            app = RateLimitMiddleware(
                plain_app,
                limiter=limiter,
                key=header("x-api-key"),
                rules=[Rule("/wide", route)],
                application_policy=Policy("app", "2/minute"),
            )
            identity = header("x-api-key")(Request("GET", "/", {"x-api-key": "bob"}, None))
            assert identity is not None
            statuses, route_left = [], []
            async with asgi_client(app) as http:
                for _ in range(5):
                    r = await http.get("/wide", headers={"X-API-Key": "bob"})
                    statuses.append(r.status_code)
                    route_left.append((await limiter.peek(route, identity)).remaining)
        return statuses, route_left

    statuses, route_left = asyncio.run(main())
    assert statuses == [200, 200, 429, 429, 429]
    if deny_cache:
        # The 3rd request: the route admitted (1 left of 4), the app denied: 1 unit of the
        # route consumed; then the app's cached denial answers first: nothing consumed.
        assert route_left == [3, 2, 1, 1, 1]
    else:
        # Each app denial consumed 1 of the route until the route itself denied (then the
        # application policy is not asked).
        assert route_left == [3, 2, 1, 0, 0]


def test_stacked_under_wsgi_and_the_environ_carries_the_decisions(backend: str, key_prefix: str):
    seen: list[tuple[str, ...]] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        seen.append(tuple(d.policy for d in environ["ratekeeper"]))
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    with Limiter.from_url(backend, **still(backend, key_prefix)) as limiter:
        wrapped = WSGIMiddleware(
            app,
            limiter=limiter,
            key=header("x-api-key"),
            rules=[Rule("/search", SEARCH)],
            application_policy=APP,
        )
        statuses = []
        headers: list[dict[str, str]] = []
        for path in ["/search"] * 4 + ["/items"] * 3:
            environ = {
                "REQUEST_METHOD": "GET",
                "PATH_INFO": path,
                "REMOTE_ADDR": "203.0.113.7",
                "HTTP_X_API_KEY": "carol",
            }
            status, got = call_wsgi(wrapped, environ)
            statuses.append(status)
            headers.append(got)
    assert statuses == [200, 200, 200, 429, 200, 200, 429]
    assert seen == [("search", "app")] * 3 + [("app",)] * 2
    assert headers[0]["RateLimit-Policy"] == '"search";q=3;w=60, "app";q=5;w=60'
    assert headers[5]["RateLimit"] == '"app";r=0;t=60'


# --- deduct_when: counting on the outcome -------------------------------------------------------

LOGIN = Policy("login", "3/minute")


def login_app(runs: list[int]) -> Starlette:
    async def login(request: StarletteRequest) -> PlainTextResponse:
        runs.append(1)
        body = await request.body()
        if body == b"right":
            return PlainTextResponse("welcome")
        if body == b"crash":
            raise RuntimeError("the handler failed")
        return PlainTextResponse("wrong password", status_code=401)

    return Starlette(routes=[Route("/login", login, methods=["POST"])])


def test_deduct_when_charges_only_failed_logins_and_refuses_before_the_handler(
    backend: str, key_prefix: str
):
    runs: list[int] = []

    async def main() -> tuple[list[Any], list[int]]:
        async with AsyncLimiter.from_url(backend, **still(backend, key_prefix)) as limiter:
            app = login_app(runs)
            app.add_middleware(
                RateLimitMiddleware,
                limiter=limiter,
                key=header("x-user"),
                rules=[Rule("/login", LOGIN, deduct_when=lambda status: status == 401)],
            )
            user = {"X-User": "eve"}
            replies = []
            async with asgi_client(app) as http:
                for body in [b"right", b"wrong", b"right", b"wrong", b"wrong", b"right", b"x"]:
                    replies.append(await http.post("/login", content=body, headers=user))
                other = await http.post("/login", content=b"wrong", headers={"X-User": "fay"})
        return [*replies, other], list(runs)

    replies, handler_runs = asyncio.run(main())
    assert [r.status_code for r in replies] == [200, 401, 200, 401, 401, 429, 429, 401]
    # Successes cost nothing; the 3rd failure spent the budget; the next two (a right password
    # among them) never ran the handler: 6 runs = 2 successes + 3 failures + fay's failure.
    assert len(handler_runs) == 6
    assert [r.headers["ratelimit"] for r in replies[:5]] == [
        '"login";r=3;t=0',  # a success: the peek's numbers, nothing charged
        '"login";r=2;t=60',
        '"login";r=2;t=60',
        '"login";r=1;t=60',
        '"login";r=0;t=60',
    ]
    assert replies[5].json()["policy"] == "login"
    assert 1 <= int(replies[5].headers["retry-after"]) <= 60
    assert replies[7].headers["ratelimit"] == '"login";r=2;t=60'  # another identity


def test_deduct_when_sees_an_exception_as_a_500(key_prefix: str):
    runs: list[int] = []

    async def main() -> list[int]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = RateLimitMiddleware(
                login_app(runs),
                limiter=limiter,
                key=header("x-user"),
                rules=[Rule("/login", LOGIN, deduct_when=lambda status: status >= 500)],
            )
            statuses = []
            async with asgi_client(app) as http:
                for _ in range(4):
                    try:
                        r = await http.post("/login", content=b"crash", headers={"X-User": "g"})
                        statuses.append(r.status_code)
                    except RuntimeError:
                        statuses.append(500)
        return statuses

    assert asyncio.run(main()) == [500, 500, 500, 429]
    assert len(runs) == 3


def test_deduct_when_under_wsgi(backend: str, key_prefix: str):
    runs: list[str] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        runs.append(environ["PATH_INFO"])
        ok = environ.get("HTTP_X_PASSWORD") == "right"
        start_response("200 OK" if ok else "401 Unauthorized", [("Content-Type", "text/plain")])
        return [b"ok" if ok else b"no"]

    with Limiter.from_url(backend, **still(backend, key_prefix)) as limiter:
        wrapped = WSGIMiddleware(
            app,
            limiter=limiter,
            key=header("x-user"),
            rules=[Rule("/login", LOGIN, deduct_when=lambda status: status == 401)],
        )
        statuses, limits = [], []
        for password in ["right", "wrong", "wrong", "right", "wrong", "wrong", "right"]:
            environ = {
                "REQUEST_METHOD": "POST",
                "PATH_INFO": "/login",
                "REMOTE_ADDR": "203.0.113.7",
                "HTTP_X_USER": "hal",
                "HTTP_X_PASSWORD": password,
            }
            status, got = call_wsgi(wrapped, environ)
            statuses.append(status)
            limits.append(got["RateLimit"])
    assert statuses == [200, 401, 401, 200, 401, 429, 429]
    assert len(runs) == 5
    assert limits[4] == '"login";r=0;t=60'


# --- the kill switch --------------------------------------------------------------------------


def test_several_workers_is_read_from_the_environment_and_the_parent():
    assert several_workers({"WEB_CONCURRENCY": "4"}, []) == "WEB_CONCURRENCY=4"
    assert several_workers({"WEB_CONCURRENCY": "1"}, []) is None
    python = "/usr/bin/python3"
    uvicorn_main = "/venv/lib/python3.11/site-packages/uvicorn/__main__.py"
    for argv, expected in [
        ([python, "-m", "uvicorn", "app:app", "--workers", "2"], "uvicorn with 2 workers"),
        ([python, "-m", "uvicorn", "app:app", "--workers=3"], "uvicorn with 3 workers"),
        ([uvicorn_main, "app:app", "--workers", "2"], "uvicorn with 2 workers"),
        (["/venv/bin/gunicorn", "-w", "4", "app:app"], "gunicorn with 4 workers"),
        ([python, "/venv/bin/gunicorn", "-w", "4", "app:app"], "gunicorn with 4 workers"),
        (["gunicorn", "-w8", "app:app"], "gunicorn with 8 workers"),
        ([python, "/venv/bin/hypercorn", "-w", "2", "app:app"], "hypercorn with 2 workers"),
        (["granian", "--interface", "asgi", "--workers", "2", "app:app"], "granian with 2 workers"),
        ([python, "-m", "uvicorn", "app:app", "--workers", "1"], None),
        ([python, "-m", "uvicorn", "app:app"], None),
        ([python, "manage.py", "--workers", "2"], None),
        ([], None),
    ]:
        assert several_workers({}, argv) == expected, argv
        # The same command line as this process's own: a supervisor preloading the app.
        assert several_workers({}, [], own_argv=argv) == expected, argv
    # Workers counted from a config file, or a retitled master: its children tell.
    assert several_workers({}, ["gunicorn: master [app]"], parent_children=3) == (
        "gunicorn with 3 worker processes"
    )
    assert several_workers({}, ["gunicorn: master [app]"], parent_children=1) is None
    assert several_workers({}, [python, "-m", "gunicorn", "app"], parent_children=2) == (
        "gunicorn with 2 worker processes"
    )
    # An explicit count of 1 wins over children (a reloader, a helper process).
    assert several_workers({}, ["gunicorn", "-w", "1"], parent_children=2) is None
    assert several_workers({}, ["bash"], parent_children=5) is None  # not a server


@pytest.mark.parametrize("endpoint", ["flask_limit", "fastapi_dependency"])
def test_an_endpoint_limiter_on_memory_under_several_workers_warns_as_the_middleware(
    endpoint: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    import ratekeeper._http._workers
    from ratekeeper.asgi import fastapi_dependency
    from ratekeeper.wsgi import flask_limit

    monkeypatch.setattr(ratekeeper._http._workers, "_warned", False)
    monkeypatch.setenv("WEB_CONCURRENCY", "2")
    policy = Policy("endpoint", "10/minute")
    with caplog.at_level("WARNING"):
        if endpoint == "flask_limit":
            flask_limit(Limiter.from_url("memory://"), policy)
        else:
            fastapi_dependency(AsyncLimiter.from_url("memory://"), policy)
    warned = [r.getMessage() for r in caplog.records if "several workers" in r.getMessage()]
    assert len(warned) == 1
    assert f"{endpoint}'s limiter is on memory://" in warned[0]
    assert "WEB_CONCURRENCY=2" in warned[0]


def test_deduct_when_on_a_websocket_counts_refused_handshakes():
    """A handshake the app closes before accepting is a 403, an accepted one a 101."""
    from ..support.web_apps import websocket_handshake, websocket_scope

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if dict(scope["headers"]).get(b"x-token") == b"good":
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": 1000})
        else:
            await send({"type": "websocket.close", "code": 1008})

    async def main() -> list[str]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            wrapped = RateLimitMiddleware(
                app,
                limiter=limiter,
                rules=[Rule("/ws", Policy("ws-bad", "2/minute"), deduct_when=lambda s: s == 403)],
            )
            out = []
            for token in ["good", "bad", "good", "bad", "good", "bad"]:
                sent = await websocket_handshake(wrapped, websocket_scope(x_token=token))
                out.append("accepted" if sent[0]["type"] == "websocket.accept" else "closed")
            return out

    # Accepted handshakes cost nothing; after 2 refused ones every handshake is refused.
    assert asyncio.run(main()) == ["accepted", "closed", "accepted", "closed", "closed", "closed"]


def test_an_application_policy_chosen_per_request_with_its_own_key():
    """The application policy per tenant plan (async), keyed by tenant; the route's per user.
    Two users of one tenant share the tenant's budget; an internal tenant has none."""
    tenant_small = Policy("tenant-small", "3/minute")

    async def tenant_plan(request: Request) -> Policy | None:
        await asyncio.sleep(0)
        return None if request.headers.get("x-tenant") == "internal" else tenant_small

    async def main() -> list[tuple[int, str | None]]:
        async with AsyncLimiter.from_url("memory://", clock=ManualClock(T0)) as limiter:
            app = RateLimitMiddleware(
                plain_app,
                limiter=limiter,
                key=header("x-user"),
                policy=Policy("per-user", "2/minute"),
                application_policy=tenant_plan,
                application_key=header("x-tenant"),
            )
            out = []
            async with asgi_client(app) as http:
                for user, tenant in [("u1", "acme"), ("u2", "acme"), ("u1", "acme"),
                                     ("u2", "acme"), ("u3", "internal"), ("u3", "internal"),
                                     ("u3", "internal")]:  # fmt: skip
                    r = await http.get("/", headers={"X-User": user, "X-Tenant": tenant})
                    out.append((r.status_code, r.headers.get("ratelimit-policy")))
            return out

    replies = asyncio.run(main())
    both = '"per-user";q=2;w=60, "tenant-small";q=3;w=60'
    assert replies[:3] == [(200, both)] * 3
    # u2's second request: per-user admits (1 left), the tenant's 3 are spent.
    assert replies[3] == (429, both)
    # The internal tenant: only the per-user policy applies.
    assert replies[4:] == [(200, '"per-user";q=2;w=60')] * 2 + [(429, '"per-user";q=2;w=60')]


def test_a_concurrency_policy_is_refused_where_a_request_would_be_charged_under_it() -> None:
    """A concurrency policy holds leases around work (``limiter.acquire``); a rule, the
    default policy or the application policy charging requests under it is refused when the
    middleware is configured, naming it (it used to fail on the first request)."""
    slots = Policy("slots", "4/minute", algorithm="concurrency")
    limiter = AsyncLimiter.from_url("memory://")
    with pytest.raises(ConfigError, match=r"rule policy 'slots' is a concurrency policy"):
        Rule("/v1/*", slots)
    with pytest.raises(ConfigError, match=r"'slots' is a concurrency policy.*acquire"):
        RateLimitMiddleware(plain_app, limiter=limiter, policy=slots)
    with pytest.raises(ConfigError, match=r"application_policy 'slots' is a concurrency"):
        RateLimitMiddleware(
            plain_app, limiter=limiter, policy=Policy("api", "10/minute"), application_policy=slots
        )
