"""The WSGI middleware on a blocking Limiter: Flask (test client), a raw WSGI app called
directly under ``wsgiref.validate``, and a real ``wsgiref`` server; the Flask decorator."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server
from wsgiref.util import setup_testing_defaults
from wsgiref.validate import validator

import flask
import httpx
import pytest

from ratekeeper import AsyncLimiter, CircuitBreaker, ConfigError, Limiter, ManualClock, Policy
from ratekeeper.identity import client_ip, first, header
from ratekeeper.wsgi import RateLimitMiddleware, Rule, flask_limit, request_from_environ

from ..support.http_servers import in_thread
from ..support.servers import free_port
from ..support.web_apps import exact_options

PEER = "203.0.113.7"


# --- construction --------------------------------------------------------------------------------


def test_an_async_limiter_is_refused():
    limiter = AsyncLimiter.from_url("memory://")
    try:
        with pytest.raises(ConfigError, match="blocking Limiter"):
            RateLimitMiddleware(wsgi_app, limiter=limiter, policy=Policy("p", "1/minute"))  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            flask_limit(limiter, Policy("p", "1/minute"))  # type: ignore[arg-type]
    finally:
        asyncio.run(limiter.close())


def test_a_middleware_needs_a_policy():
    with Limiter.from_url("memory://") as limiter, pytest.raises(ConfigError):
        RateLimitMiddleware(wsgi_app, limiter=limiter, exempt=["/health"])


def test_request_from_environ():
    environ = {
        "REQUEST_METHOD": "PUT",
        "PATH_INFO": "",
        "REMOTE_ADDR": "203.0.113.7",
        "HTTP_X_API_KEY": "k",
        "HTTP_X_FORWARDED_FOR": "1.2.3.4, 5.6.7.8",
        "CONTENT_TYPE": "text/plain",
        "wsgi.input": object(),
    }
    view = request_from_environ(environ)
    assert view.method == "PUT"
    assert view.path == "/"
    assert view.headers == {"x-api-key": "k", "x-forwarded-for": "1.2.3.4, 5.6.7.8"}
    assert view.peer == "203.0.113.7"
    assert view.raw is environ
    assert request_from_environ({"REMOTE_ADDR": ""}).peer is None


# --- a raw WSGI app, called directly -------------------------------------------------------------


def wsgi_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    body = json.dumps({"path": environ["PATH_INFO"]}).encode()
    start_response(
        "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    )
    return [body]


class Called:
    def __init__(self, status: str, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status = status
        self.code = int(status.split(maxsplit=1)[0])
        self.headers = headers
        self.body = body

    def get(self, name: str) -> str | None:
        values = [v for n, v in self.headers if n.lower() == name.lower()]
        assert len(values) <= 1, f"{name} sent {len(values)} times"
        return values[0] if values else None


def call(app: Any, path: str = "/", method: str = "GET", **environ: str) -> Called:
    """One request through ``app`` wrapped in ``wsgiref.validate``, which checks every WSGI
    rule the middleware must keep (str headers, status line, iterable closed...)."""
    env: dict[str, Any] = {
        "PATH_INFO": path,
        "REQUEST_METHOD": method,
        "REMOTE_ADDR": PEER,
        "QUERY_STRING": "",
        "SCRIPT_NAME": "",
    }
    env.update(environ)
    setup_testing_defaults(env)
    started: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        started.append((status, headers))
        return lambda data: None

    result = validator(app)(env, start_response)
    try:
        body = b"".join(result)
    finally:
        result.close()
    ((status, headers),) = started
    return Called(status, headers, body)


def test_a_raw_wsgi_app_is_limited():
    with Limiter.from_url("memory://") as limiter:
        app = RateLimitMiddleware(wsgi_app, limiter=limiter, policy=Policy("raw", "2/minute"))
        responses = [call(app) for _ in range(3)]
    assert [r.status for r in responses] == ["200 OK", "200 OK", "429 Too Many Requests"]
    assert [r.get("RateLimit") for r in responses] == [
        '"raw";r=1;t=60',
        '"raw";r=0;t=60',
        '"raw";r=0;t=60',
    ]
    assert responses[0].body == b'{"path": "/"}'
    denied = responses[2]
    assert denied.get("Content-Type") == "application/problem+json"
    assert denied.get("Content-Length") == str(len(denied.body))
    assert json.loads(denied.body)["status"] == 429
    assert 1 <= int(denied.get("Retry-After") or "0") <= 60


def test_rules_exemptions_and_keys_under_wsgi():
    with Limiter.from_url("memory://") as limiter:
        app = RateLimitMiddleware(
            wsgi_app,
            limiter=limiter,
            policy=Policy("default", "3/minute"),
            rules=[
                Rule("/login", Policy("login", "1/minute"), methods=frozenset({"POST"})),
                Rule(re.compile(r"/users/\d+"), Policy("users", "2/minute")),
                Rule("/keyed/*", Policy("keyed", "1/minute"), key=header("x-api-key")),
            ],
            exempt=["/health"],
        )
        login = [call(app, "/login", "POST").code for _ in range(2)]
        login_get = call(app, "/login").get("RateLimit")
        users = [call(app, f"/users/{i}").code for i in range(3)]
        keyed = [call(app, "/keyed/x", HTTP_X_API_KEY=k).code for k in ("a", "b", "a")]
        health = [call(app, "/health") for _ in range(10)]
    assert login == [200, 429]
    assert login_get == '"default";r=2;t=60'
    assert users == [200, 200, 429]
    assert keyed == [200, 200, 429]
    assert all(r.code == 200 for r in health)
    assert not any("ratelimit" in n.lower() for r in health for n, _ in r.headers)


def test_a_missing_identity_under_wsgi(backend: str, key_prefix: str):
    """``header()`` without a fallback: limited by the peer by default, 400 when rejected,
    unlimited only when explicitly allowed."""
    apps: dict[str, RateLimitMiddleware] = {}
    out: dict[str, list[Called]] = {}
    with Limiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
        for choice in ("client_ip", "reject", "allow"):
            apps[choice] = RateLimitMiddleware(
                wsgi_app,
                limiter=limiter,
                policy=Policy(f"wsgi-anon-{choice}", "2/minute"),
                key=header("x-api-key"),
                missing_identity=choice,  # type: ignore[arg-type]
            )
            out[choice] = [call(apps[choice]) for _ in range(3)]
        elsewhere = [call(apps["client_ip"], REMOTE_ADDR="203.0.113.8").code for _ in range(3)]
        keyed = [call(apps["allow"], HTTP_X_API_KEY="k").code for _ in range(3)]
        fallback = limiter.peek(Policy("wsgi-anon-client_ip", "2/minute"), f"anonymous:ip:{PEER}")
    assert [r.code for r in out["client_ip"]] == [200, 200, 429]
    assert out["client_ip"][0].get("RateLimit") == '"wsgi-anon-client_ip";r=1;t=60'
    assert not fallback.allowed
    assert elsewhere == [200, 200, 429]  # another address, its own budget
    # "allow" passes the anonymous ones unlimited; a keyed client still spends its own budget.
    assert [r.code for r in out["allow"]] == [200, 200, 200]
    assert all(r.get("RateLimit") is None for r in out["allow"])
    assert keyed == [200, 200, 429]
    rejected = out["reject"]
    assert [r.status for r in rejected] == ["400 Bad Request"] * 3
    for r in rejected:
        assert r.get("Content-Type") == "application/problem+json"
        assert r.get("Content-Length") == str(len(r.body))
        assert json.loads(r.body)["detail"] == (
            "The request carries no client identity, which this endpoint requires."
        )


def test_shadow_mode_under_wsgi():
    policy = Policy("wsgi-shadow", "2/minute")
    with Limiter.from_url("memory://") as limiter:
        app = RateLimitMiddleware(
            wsgi_app,
            limiter=limiter,
            policy=policy,
            rules=[Rule("/enforced", Policy("enforced", "1/minute"))],
            shadow=True,
        )
        responses = [call(app) for _ in range(4)]
        after = limiter.peek(policy, f"ip:{PEER}")
        enforced = [call(app, "/enforced").code for _ in range(2)]
    assert [r.code for r in responses] == [200] * 4
    assert [r.get("RateLimit") for r in responses][-1] == '"wsgi-shadow";r=0;t=60'
    assert not after.allowed
    # Global shadow covers every rule.
    assert enforced == [200, 200]

    with Limiter.from_url("memory://") as limiter:
        app = RateLimitMiddleware(
            wsgi_app,
            limiter=limiter,
            policy=Policy("enforced", "1/minute"),
            rules=[Rule("/trial", Policy("trial", "1/minute"), shadow=True)],
        )
        trial = [call(app, "/trial").code for _ in range(3)]
        enforced = [call(app, "/other").code for _ in range(3)]
    assert trial == [200, 200, 200]
    assert enforced == [200, 429, 429]


def test_the_client_ip_behind_a_trusted_proxy_under_wsgi():
    with Limiter.from_url("memory://") as limiter:
        app = RateLimitMiddleware(
            wsgi_app,
            limiter=limiter,
            policy=Policy("wsgi-proxy", "2/minute"),
            key=client_ip(["10.0.0.0/8"]),
        )
        liar = [
            call(
                app, REMOTE_ADDR="10.0.0.1", HTTP_X_FORWARDED_FOR=f"198.51.100.{i}, 203.0.113.9"
            ).code
            for i in range(5)
        ]
        direct = [
            call(app, REMOTE_ADDR="203.0.113.10", HTTP_X_FORWARDED_FOR=f"198.51.100.{i}").code
            for i in range(5)
        ]
    assert liar == [200, 200, 429, 429, 429]
    assert direct == [200, 200, 429, 429, 429]


@pytest.mark.parametrize(
    "environ",
    [
        {"HTTP_X_FORWARDED_FOR": "1.2.3.4, " * 120_000},
        {"HTTP_X_API_KEY": "k" * 1_000_000},
        {"HTTP_X_FORWARDED_FOR": "\udcff\x00garbage", "HTTP_X_API_KEY": "\udcff\udc80"},
        {"HTTP_FORWARDED": ";=," * 300_000, "REMOTE_ADDR": "not an address"},
    ],
)
def test_huge_or_garbage_headers_never_crash_a_wsgi_app(environ: dict[str, str]):
    with Limiter.from_url("memory://") as limiter:
        app = RateLimitMiddleware(
            wsgi_app,
            limiter=limiter,
            policy=Policy("wsgi-garbage", "2/minute"),
            key=first(header("x-api-key"), client_ip(["10.0.0.0/8", "203.0.113.0/24"])),
        )
        codes = [call(app, **environ).code for _ in range(3)]
    assert set(codes) <= {200, 429}
    assert codes[0] == 200


def test_degraded_decisions_under_wsgi():
    dead = f"redis://127.0.0.1:{free_port()}/0"
    options: dict[str, Any] = {"timeout": 0.5, "connect_timeout": 0.5}
    with Limiter.from_url(dead, failure_mode="open", **options) as limiter:
        app = RateLimitMiddleware(
            wsgi_app, limiter=limiter, policy=Policy("dead", "1/minute"), legacy_headers=True
        )
        open_ = [call(app) for _ in range(3)]
    with Limiter.from_url(
        dead, failure_mode="closed", breaker=CircuitBreaker(consecutive_failures=2), **options
    ) as limiter:
        app = RateLimitMiddleware(wsgi_app, limiter=limiter, policy=Policy("dead", "100/minute"))
        closed = [call(app) for _ in range(3)]
    assert [r.code for r in open_] == [200, 200, 200]
    assert not any(
        "ratelimit" in n.lower() or n == "Retry-After" for r in open_ for n, _ in r.headers
    )
    assert [r.code for r in closed] == [429, 429, 429]
    for r in closed:
        assert int(r.get("Retry-After") or "0") >= 1
        assert r.get("RateLimit") is None
        assert json.loads(r.body)["status"] == 429


# --- Flask ---------------------------------------------------------------------------------------


def flask_app(limiter: Limiter, **middleware: Any) -> flask.Flask:
    app = flask.Flask("ratekeeper-test")

    @app.get("/items")
    def items() -> Any:
        return {"items": [1, 2, 3]}

    @app.get("/health")
    def health() -> Any:
        return {"status": "ok"}

    @app.get("/own")
    def own() -> Any:
        return flask.Response("own", headers={"RateLimit": "app", "X-App": "kept"})

    app.wsgi_app = RateLimitMiddleware(app.wsgi_app, limiter=limiter, **middleware)  # type: ignore[method-assign]
    return app


def test_flask_behind_the_middleware(backend: str, key_prefix: str):
    policy = Policy("flask", "3/minute")
    with Limiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
        app = flask_app(limiter, policy=policy, exempt=["/health"], legacy_headers=True)
        with app.test_client() as client:
            items = [client.get("/items", environ_base={"REMOTE_ADDR": PEER}) for _ in range(4)]
            other = client.get("/items", environ_base={"REMOTE_ADDR": "203.0.113.8"})
            health = [client.get("/health", environ_base={"REMOTE_ADDR": PEER}) for _ in range(5)]
    assert [r.status_code for r in items] == [200, 200, 200, 429]
    for n, r in enumerate(items[:3], start=1):
        assert r.headers["RateLimit-Policy"] == '"flask";q=3;w=60'
        assert r.headers["RateLimit"] == f'"flask";r={3 - n};t=60'
        assert r.headers["X-RateLimit-Remaining"] == str(3 - n)
        assert r.json == {"items": [1, 2, 3]}
    denied = items[3]
    assert denied.headers["Content-Type"] == "application/problem+json"
    problem = json.loads(denied.data)
    assert problem["status"] == 429
    assert problem["title"] == "Too Many Requests"
    assert 1 <= int(denied.headers["Retry-After"]) <= 60
    assert other.status_code == 200
    assert all(r.status_code == 200 for r in health)
    assert all("RateLimit" not in r.headers for r in health)


def test_flask_app_headers_are_replaced_not_duplicated():
    with Limiter.from_url("memory://") as limiter:
        app = flask_app(limiter, policy=Policy("own", "5/minute"))
        with app.test_client() as client:
            response = client.get("/own", environ_base={"REMOTE_ADDR": PEER})
    assert response.headers.getlist("RateLimit") == ['"own";r=4;t=60']
    assert response.headers.getlist("X-App") == ["kept"]
    assert response.data == b"own"


# --- the Flask decorator -------------------------------------------------------------------------


def test_flask_limit_decorator(backend: str, key_prefix: str):
    search = Policy("flask-search", "2/minute")
    with Limiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
        app = flask.Flask("ratekeeper-decorator")

        @app.get("/search")
        @flask_limit(limiter, search, key=header("x-api-key", fallback=client_ip()))
        def do_search() -> Any:
            return {"results": ["apple"]}

        @app.get("/free")
        def free() -> Any:
            return "free"

        with app.test_client() as client:
            hits = [client.get("/search", headers={"X-API-Key": "a"}) for _ in range(3)]
            other = client.get("/search", headers={"X-API-Key": "b"})
            by_ip = [client.get("/search") for _ in range(3)]
            free_ones = [client.get("/free") for _ in range(3)]
    assert [r.status_code for r in hits] == [200, 200, 429]
    assert hits[0].json == {"results": ["apple"]}
    assert hits[0].headers["RateLimit-Policy"] == '"flask-search";q=2;w=60'
    assert hits[0].headers["RateLimit"] == '"flask-search";r=1;t=60'
    assert hits[1].headers["RateLimit"] == '"flask-search";r=0;t=60'
    denied = hits[2]
    assert denied.headers["Content-Type"] == "application/problem+json"
    problem = json.loads(denied.data)
    assert problem["status"] == 429
    assert problem["policy"] == "flask-search"
    assert 1 <= int(denied.headers["Retry-After"]) <= 60
    assert denied.headers["RateLimit"] == '"flask-search";r=0;t=60'
    assert other.status_code == 200
    assert [r.status_code for r in by_ip] == [200, 200, 429]
    assert all(r.status_code == 200 and "RateLimit" not in r.headers for r in free_ones)


def test_flask_limit_counts_on_the_outcome(backend: str, key_prefix: str):
    """``deduct_when`` on flask_limit: a success gives its reservation back, a failure (and a
    view that raises: a 500) keeps it; once 3 count, the view no longer runs."""
    login = Policy("flask-login", "3/minute")
    ran: list[str] = []
    with Limiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
        app = flask.Flask("ratekeeper-outcome")

        @app.post("/login")
        @flask_limit(limiter, login, deduct_when=lambda status: status >= 400)
        def do_login() -> Any:
            password = flask.request.headers.get("x-password")
            ran.append(password or "")
            if password == "boom":
                raise RuntimeError("the view failed")
            return ({"ok": True}, 200) if password == "right" else ({"ok": False}, 401)

        with app.test_client() as client:
            right = [client.post("/login", headers={"X-Password": "right"}) for _ in range(4)]
            boom = client.post("/login", headers={"X-Password": "boom"})
            wrong = [client.post("/login", headers={"X-Password": "wrong"}) for _ in range(3)]
    assert [r.status_code for r in right] == [200] * 4
    assert right[-1].headers["RateLimit"] == '"flask-login";r=3;t=0'
    assert boom.status_code == 500
    assert [r.status_code for r in wrong] == [401, 401, 429]
    assert ran == ["right"] * 4 + ["boom"] + ["wrong"] * 2


def test_flask_limit_cost_legacy_and_a_missing_identity():
    with Limiter.from_url("memory://") as limiter:
        app = flask.Flask("ratekeeper-decorator-2")

        @app.post("/bulk")
        @flask_limit(limiter, Policy("bulk", "5/minute"), cost=2, legacy_headers=True)
        def bulk() -> Any:
            return "ok"

        @app.get("/keyed")
        @flask_limit(limiter, Policy("keyed", "1/minute"), key=header("x-api-key"))
        def keyed() -> Any:
            return "ok"

        with app.test_client() as client:
            bulks = [client.post("/bulk") for _ in range(3)]
            anonymous = [client.get("/keyed") for _ in range(3)]
    assert [r.status_code for r in bulks] == [200, 200, 429]
    assert [r.headers["X-RateLimit-Remaining"] for r in bulks] == ["3", "1", "1"]
    assert bulks[2].headers["X-RateLimit-Limit"] == "5"
    # No identity: limited by the peer's address.
    assert [r.status_code for r in anonymous] == [200, 429, 429]
    assert anonymous[0].headers["RateLimit"] == '"keyed";r=0;t=60'


@pytest.mark.parametrize("view", ["sync", "async"])
@pytest.mark.parametrize("counted", ["before", "on_the_outcome"])
def test_flask_limit_behind_the_middleware_shows_the_policy_that_constrains(
    counted: str, view: str
):
    """The middleware's policy (20/minute; or counted on the outcome, with ``deduct_when``)
    and ``flask_limit`` (2/minute) on one request: the admitted responses show the
    decorator's policy, which has fewer left; its 429 is its own, headers and all."""
    clock = ManualClock()
    api = Policy("api", "20/minute")
    deduct = (lambda status: status < 500) if counted == "on_the_outcome" else None
    with Limiter.from_url("memory://", clock=clock) as limiter:
        app = flask.Flask("ratekeeper-nested")
        limited = flask_limit(limiter, Policy("narrow", "2/minute"), legacy_headers=True)

        if view == "async":

            @app.get("/narrow")
            @limited
            async def narrow() -> Any:
                return {"decisions": [d.policy for d in flask.request.environ["ratekeeper"]]}

        else:

            @app.get("/narrow")
            @limited
            def narrow() -> Any:
                return {"decisions": [d.policy for d in flask.request.environ["ratekeeper"]]}

        app.wsgi_app = RateLimitMiddleware(  # type: ignore[method-assign]
            app.wsgi_app,
            limiter=limiter,
            rules=[Rule("/*", api, deduct_when=deduct)],
            legacy_headers=True,
        )
        replies = []
        with app.test_client() as client:
            for wait in (0.0, 0.0, 12.5):
                clock.advance(wait)
                replies.append(client.get("/narrow", environ_base={"REMOTE_ADDR": PEER}))
    assert [r.status_code for r in replies] == [200, 200, 429]
    for remaining, admitted in zip((1, 0), replies[:2], strict=True):
        if deduct is None:  # charged before the view, which sees both decisions
            assert admitted.json == {"decisions": ["api", "narrow"]}
        assert admitted.headers["RateLimit-Policy"] == '"api";q=20;w=60, "narrow";q=2;w=60'
        assert admitted.headers["RateLimit"] == f'"narrow";r={remaining};t=60'
        assert admitted.headers["X-RateLimit-Limit"] == "2"
        assert admitted.headers["X-RateLimit-Remaining"] == str(remaining)
        assert "Retry-After" not in admitted.headers
    denied = replies[2]
    assert denied.json["policy"] == "narrow"
    assert denied.json["retry_after"] == 47.5
    assert denied.headers["RateLimit-Policy"] == '"narrow";q=2;w=60'
    assert denied.headers["RateLimit"] == '"narrow";r=0;t=48'
    assert denied.headers["Retry-After"] == "48"
    assert denied.headers["X-RateLimit-Limit"] == "2"
    assert denied.headers["X-RateLimit-Remaining"] == "0"


@pytest.mark.parametrize(
    ("choice", "expected"),
    [("client_ip", [200, 200, 429]), ("reject", [400, 400, 400]), ("allow", [200, 200, 200])],
)
def test_flask_limit_missing_identity(choice: str, expected: list[int]):
    runs: list[str] = []
    with Limiter.from_url("memory://") as limiter:
        app = flask.Flask("ratekeeper-decorator-anon")

        @app.get("/keyed")
        @flask_limit(
            limiter,
            Policy("keyed-anon", "2/minute"),
            key=header("x-api-key"),
            missing_identity=choice,  # type: ignore[arg-type]
        )
        def keyed() -> Any:
            runs.append("ran")
            return "ok"

        with app.test_client() as client:
            anonymous = [client.get("/keyed") for _ in range(3)]
            with_key = [client.get("/keyed", headers={"X-API-Key": "k"}) for _ in range(3)]
    assert [r.status_code for r in anonymous] == expected
    assert [r.status_code for r in with_key] == [200, 200, 429]
    if choice == "reject":
        assert anonymous[0].headers["Content-Type"] == "application/problem+json"
        assert anonymous[0].json["status"] == 400
        assert anonymous[0].json["title"] == "Bad Request"
    if choice == "allow":
        assert all("RateLimit" not in r.headers for r in anonymous)
    assert len(runs) == expected.count(200) + 2


@pytest.mark.parametrize("choice", ["deny", None, "Reject"])
def test_a_bad_missing_identity_is_a_config_error_under_wsgi(choice: Any):
    with Limiter.from_url("memory://") as limiter:
        with pytest.raises(ConfigError, match="missing_identity must be one of"):
            RateLimitMiddleware(
                wsgi_app, limiter=limiter, policy=Policy("p", "1/minute"), missing_identity=choice
            )
        with pytest.raises(ConfigError, match="missing_identity must be one of"):
            flask_limit(limiter, Policy("p", "1/minute"), missing_identity=choice)


# --- a real wsgiref server -----------------------------------------------------------------------


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def wsgiref_server() -> Iterator[Any]:
    """Serve the app given to ``start(app)`` on a free port (its URL returned), until the test
    ends."""
    with contextlib.ExitStack() as running:

        def start(app: Any) -> str:
            server = make_server("127.0.0.1", 0, app, handler_class=QuietHandler)
            return running.enter_context(in_thread(server))

        yield start


def test_a_real_wsgiref_server(server: Any, key_prefix: str, wsgiref_server: Any):
    policy = Policy("wsgiref", "4/minute")
    with Limiter.from_url(server.url, **exact_options(server.url, key_prefix)) as limiter:
        app = validator(
            RateLimitMiddleware(
                wsgi_app,
                limiter=limiter,
                policy=policy,
                key=header("x-api-key"),
                exempt=["/health"],
            )
        )
        url = wsgiref_server(app)
        with httpx.Client(base_url=url, timeout=10) as http:
            a = [http.get("/api", headers={"X-API-Key": "a"}) for _ in range(6)]
            b = [http.get("/api", headers={"X-API-Key": "b"}) for _ in range(5)]
            health = [http.get("/health", headers={"X-API-Key": "a"}) for _ in range(5)]
    assert [r.status_code for r in a] == [200] * 4 + [429] * 2
    assert [r.status_code for r in b] == [200] * 4 + [429]
    assert [r.headers["ratelimit"] for r in a[:4]] == [
        f'"wsgiref";r={n};t=60' for n in (3, 2, 1, 0)
    ]
    for r in a[4:]:
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["status"] == 429
        assert 1 <= int(r.headers["retry-after"]) <= 60
    assert all(r.status_code == 200 and "ratelimit" not in r.headers for r in health)
