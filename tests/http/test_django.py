"""ratekeeper.django in this process: settings errors and system checks, the decorator's keys,
methods, plans and trusted proxies, the middleware's rules from settings (deduct_when,
application policy), ENABLED=False without a store call (counted on a real Redis), and a
``manage.py check`` subprocess showing the memory:// warning.

Real servers with several workers are in ``test_django_servers.py``; DRF in ``test_drf.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import iscoroutinefunction

from tests.support.django_project import configure

configure()

from django.core.checks import run_checks  # noqa: E402
from django.core.exceptions import ImproperlyConfigured  # noqa: E402
from django.http import HttpRequest, HttpResponse, JsonResponse  # noqa: E402
from django.test import (  # noqa: E402
    AsyncClient,
    AsyncRequestFactory,
    Client,
    RequestFactory,
    override_settings,
)
from django.urls import path as route  # noqa: E402

from ratekeeper import ConfigError, ManualClock, Policy  # noqa: E402
from ratekeeper._http import problem_body, rate_limit_headers  # noqa: E402
from ratekeeper.django import RateLimitMiddleware, SettingsError, _view_policy, ratelimit  # noqa: E402
from ratekeeper.django._settings import current, request_view  # noqa: E402
from ratekeeper.identity import header  # noqa: E402

from ..support.servers import RedisServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MEMORY = {"STORAGE_URL": "memory://", "KEY_PREFIX": "dj-unit"}


def settings_with(**values: Any) -> Any:
    return override_settings(RATEKEEPER={**MEMORY, **values})


@pytest.fixture(autouse=True)
def fresh_memory() -> Iterator[None]:
    """Every test starts on a fresh memory:// store (a settings change builds new limiters)."""
    with settings_with():
        yield


def get(path: str = "/x", method: str = "GET", **meta: Any) -> HttpRequest:
    request: HttpRequest = getattr(RequestFactory(), method.lower())(path, **meta)
    return request


def ok(request: HttpRequest) -> HttpResponse:
    decisions = getattr(request, "ratekeeper", ())
    return JsonResponse({"decisions": [d.policy for d in decisions]})


def statuses(view: Any, requests: list[HttpRequest]) -> list[int]:
    return [view(request).status_code for request in requests]


# --- settings errors, at configuration time, naming the setting -----------------------------


@pytest.mark.parametrize(
    ("values", "named", "says"),
    [
        ({"STORAGE": "redis://x"}, "settings.RATEKEEPER", "unknown setting 'STORAGE'"),
        ({"STORAGE_URL": "bogus://x"}, "['STORAGE_URL']", "unsupported storage URL"),
        ({"STORAGE_URL": "redis://h:notaport/0"}, "['STORAGE_URL']", "notaport"),
        ({"FAILURE_MODE": "sideways"}, "['FAILURE_MODE']", "sideways"),
        ({"KEY_PREFIX": "a b"}, "['KEY_PREFIX']", "prefix"),
        ({"LIMITER_OPTIONS": {"timeout": 1}}, "['LIMITER_OPTIONS']", "timeout"),
        ({"LIMITER_OPTIONS": {"bogus": 1}}, "['LIMITER_OPTIONS']", "bogus"),
        ({"ENABLED": "no"}, "['ENABLED']", "True or False"),
        ({"TRUSTED_PROXIES": "10.0.0.0/8"}, "['TRUSTED_PROXIES']", "list of CIDRs"),
        ({"TRUSTED_PROXIES": ["10.0.0.0/33"]}, "['TRUSTED_PROXIES']", "CIDRs"),
        ({"KEY": "cookie:x"}, "['KEY']", "unknown key 'cookie:x'"),
        ({"KEY": "tests.nowhere.key"}, "['KEY']", "cannot import"),
        ({"POLICY": "100/minute"}, "['POLICY']", "a ratekeeper.Policy or a dict"),
        (
            {"POLICY": {"name": "api", "rates": "10/fortnight"}},
            "['POLICY']",
            "fortnight",
        ),
        (
            {"RULES": [{"path": "/a"}, {"path": "/b", "policy": {"name": "b", "rates": "0/s"}}]},
            "['RULES'][1]['policy']",
            "rate",
        ),
        ({"RULES": [{"policy": Policy("p", "1/s")}]}, "['RULES'][0]", "needs a 'path'"),
        (
            {"RULES": [{"path": "/a", "policy": Policy("p", "1/s"), "cost": 0}]},
            "['RULES'][0]",
            "cost",
        ),
        ({"MISSING_IDENTITY": "shrug"}, "settings.RATEKEEPER", "missing_identity"),
    ],
)
def test_a_bad_setting_is_an_error_naming_it(values: dict[str, Any], named: str, says: str):
    with settings_with(**values):
        with pytest.raises(SettingsError) as raised:
            current()
        assert str(raised.value).startswith("settings.RATEKEEPER"), raised.value
        assert named in str(raised.value), raised.value
        assert says in str(raised.value), raised.value
        # Both ratekeeper's and Django's configuration error.
        assert isinstance(raised.value, ConfigError)
        assert isinstance(raised.value, ImproperlyConfigured)
        # manage.py check reports it as an error with the same message.
        messages = run_checks(tags=["ratekeeper"])
        assert [m.id for m in messages] == ["ratekeeper.E001"]
        assert messages[0].msg == str(raised.value)
        assert messages[0].is_serious()


def test_the_middleware_needs_a_policy():
    with pytest.raises(SettingsError, match="needs a 'POLICY', 'RULES' or 'APPLICATION_POLICY'"):
        RateLimitMiddleware(ok)


def test_async_callables_are_refused_on_a_sync_chain_and_taken_on_an_async_one():
    async def plan(request: HttpRequest) -> Policy:
        return Policy("plan", "1/s")

    with settings_with(RULES=[{"path": "/a", "policy": plan}]):
        with pytest.raises(SettingsError, match=r"is async .* \(under WSGI; ASGI Django"):
            RateLimitMiddleware(ok)

        async def chain(request: HttpRequest) -> HttpResponse:
            return ok(request)

        assert iscoroutinefunction(RateLimitMiddleware(chain))


def test_bad_decorator_arguments_fail_at_import():
    with pytest.raises(SettingsError, match=r"ratelimit on .*: .*fortnight"):
        ratelimit("1/fortnight")(ok)
    with pytest.raises(SettingsError) as unknown:
        ratelimit("1/s", key="cookie:x")(ok)
    assert str(unknown.value).startswith("ratelimit on ok: key: ")  # said once
    assert "unknown key 'cookie:x'" in str(unknown.value)
    assert str(unknown.value).count("ratelimit on") == 1
    with pytest.raises(SettingsError, match="methods"):
        ratelimit("1/s", methods="GET")(ok)

    async def async_key(request: HttpRequest) -> str:
        return "k"

    with pytest.raises(SettingsError, match="is async"):
        ratelimit("1/s", key=async_key)(ok)  # ok is a sync view


def test_a_view_in_main_is_named_without_its_underscores():
    def login(request: HttpRequest) -> HttpResponse:
        return ok(request)

    login.__module__ = "__main__"  # a view in a script run as python app.py
    login.__qualname__ = "login"
    assert ratelimit("1/s")(login) is not login  # refused before: "policy name '__main__...'"
    assert _view_policy("1/s", login).name == "main.login"


# --- system checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("debug", "values", "warned"),
    [
        (False, {}, True),
        (True, {}, False),
        (False, {"ENABLED": False}, False),
        (False, {"STORAGE_URL": "redis://127.0.0.1:1/0"}, False),
    ],
)
def test_memory_without_debug_warns(debug: bool, values: dict[str, Any], warned: bool):
    with override_settings(DEBUG=debug), settings_with(**values):
        messages = run_checks(tags=["ratekeeper"])
    assert [m.id for m in messages] == (["ratekeeper.W001"] if warned else [])
    if warned:
        assert not messages[0].is_serious()
        assert "memory://" in messages[0].msg
        assert "DEBUG is off" in messages[0].msg


def test_drf_throttle_rates_are_checked():
    rest = {
        "DEFAULT_THROTTLE_CLASSES": ["ratekeeper.drf.RatekeeperThrottle"],
        "DEFAULT_THROTTLE_RATES": {"ok": "50/minute", "bad": "50/fortnight", "off": None},
    }
    with override_settings(REST_FRAMEWORK=rest, DEBUG=True):
        messages = run_checks(tags=["ratekeeper"])
    assert [m.id for m in messages] == ["ratekeeper.E002"]
    assert "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['bad']" in messages[0].msg


def test_manage_py_check_shows_the_warning_in_a_subprocess():
    """What a user runs: ``django-admin check`` on a project with memory:// and DEBUG off."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("RATEKEEPER_DJANGO_DEBUG", None)
    env["RATEKEEPER_DJANGO_STORAGE_URL"] = "memory://"
    command = [
        sys.executable,
        "-m",
        "django",
        "check",
        "--settings=tests.support.django_project.settings",
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "(ratekeeper.W001) settings.RATEKEEPER['STORAGE_URL'] is memory://" in done.stderr
    # --fail-level WARNING makes it fail a deploy pipeline; DEBUG on silences it.
    failing = subprocess.run(
        [*command, "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert failing.returncode == 1
    debug = subprocess.run(
        command,
        cwd=ROOT,
        env={**env, "RATEKEEPER_DJANGO_DEBUG": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert debug.returncode == 0
    assert "ratekeeper.W001" not in debug.stderr + debug.stdout


# --- the decorator --------------------------------------------------------------------------


def test_the_decorator_charges_only_its_methods_and_names_its_policy():
    view = ratelimit("2/minute", key="header:x-api-key", methods={"GET"})(ok)
    key = {"HTTP_X_API_KEY": "k1"}
    assert statuses(view, [get(**key) for _ in range(2)]) == [200, 200]
    assert statuses(view, [get(method="POST", **key) for _ in range(3)]) == [200] * 3
    denied = view(get(**key))
    assert denied.status_code == 429
    # The same 429 as the ASGI middleware: problem+json, RateLimit headers, Retry-After.
    assert denied["Content-Type"] == "application/problem+json"
    problem = json.loads(denied.content)
    assert problem["policy"] == "tests.http.test_django.ok"  # named after the view
    assert denied["RateLimit-Policy"] == '"tests.http.test_django.ok";q=2;w=60'
    assert 1 <= int(denied["Retry-After"]) <= 60
    head = view(get(method="HEAD", **key))  # a GET rule also charges HEAD
    assert head.status_code == 429
    assert view(get(HTTP_X_API_KEY="k2")).status_code == 200  # another identity


def test_the_429_is_the_shared_one_byte_for_byte():
    """The body and headers are rendered by ratekeeper._http, as for the ASGI middleware."""
    clock = ManualClock()
    policy = Policy("same", "1/minute")
    with settings_with(LIMITER_OPTIONS={"clock": clock}):
        view = ratelimit(policy, key="header:x-api-key")(ok)
        assert view(get(HTTP_X_API_KEY="k")).status_code == 200
        clock.advance(12.5)
        request = get(HTTP_X_API_KEY="k")
        denied = view(request)
        identity = header("x-api-key")(request_view(request))
        assert identity is not None
        decision = current().limiter().peek(policy, identity)  # the same denial, unchanged
    assert denied.status_code == 429
    assert not decision.allowed
    assert decision.retry_after == 47.5
    assert json.loads(denied.content)["retry_after"] == 47.5  # exact, not the window
    assert denied.content == problem_body(decision)
    for name, value in rate_limit_headers(decision):
        assert denied[name] == value, name
    assert denied["Retry-After"] == "48"


def test_key_names_as_django_ratelimit_users_expect():
    class User:
        is_authenticated = True

        def __init__(self, pk: int) -> None:
            self.pk = pk

    def with_user(request: HttpRequest, user: Any) -> HttpRequest:
        request.user = user  # type: ignore[attr-defined]
        return request

    by_user = ratelimit("1/minute", key="user_or_ip")(ok)
    assert by_user(with_user(get(), User(1))).status_code == 200
    assert by_user(with_user(get(), User(1))).status_code == 429
    assert by_user(with_user(get(), User(2))).status_code == 200  # another user, same address
    assert by_user(get()).status_code == 200  # anonymous: the address, a budget of its own
    assert by_user(get()).status_code == 429

    by_post = ratelimit("1/minute", key="post:username", methods={"POST"})(ok)
    assert by_post(get(method="POST", data={"username": "ann"})).status_code == 200
    assert by_post(get(method="POST", data={"username": "ann"})).status_code == 429
    assert by_post(get(method="POST", data={"username": "bob"})).status_code == 200

    by_query = ratelimit("1/minute", key="get:q")(ok)
    assert statuses(by_query, [get("/s?q=a"), get("/s?q=b"), get("/s?q=a")]) == [200, 200, 429]

    def tenant(request: HttpRequest) -> str | None:
        return request.headers.get("x-tenant")

    by_callable = ratelimit("1/minute", key=tenant)(ok)
    assert by_callable(get(HTTP_X_TENANT="t1")).status_code == 200
    assert by_callable(get(HTTP_X_TENANT="t1")).status_code == 429
    by_path = ratelimit("1/minute", key="tests.http.test_django.dotted_key")(ok)
    assert statuses(by_path, [get(HTTP_X_TENANT="t9"), get(HTTP_X_TENANT="t9")]) == [200, 429]


def test_class_based_views_and_an_anonymous_user_key():
    from django.utils.decorators import method_decorator
    from django.views import View

    @method_decorator(ratelimit("1/minute", key="user"), name="get")
    class Items(View):
        def get(self, request: HttpRequest) -> HttpResponse:
            return ok(request)

    view = Items.as_view()
    # key="user" on an anonymous request: no identity, so MISSING_IDENTITY's default limits
    # it by its address (as anonymous:ip:...), never lets it through unlimited.
    assert statuses(view, [get(), get(), get(method="HEAD")]) == [200, 429, 429]
    assert statuses(view, [get(REMOTE_ADDR="192.0.2.1")]) == [200]
    assert statuses(view, [get(method="POST")]) == [405]  # not served: not charged either


def dotted_key(request: HttpRequest) -> str | None:
    return request.headers.get("x-tenant")


def test_the_client_address_goes_through_the_trusted_proxies():
    with settings_with(TRUSTED_PROXIES=["10.0.0.0/8"]):
        view = ratelimit("1/minute", key="ip")(ok)
        proxy = {"REMOTE_ADDR": "10.1.2.3"}
        alice = {**proxy, "HTTP_X_FORWARDED_FOR": "198.51.100.7"}
        bob = {**proxy, "HTTP_X_FORWARDED_FOR": "198.51.100.8"}
        assert statuses(view, [get(**alice), get(**bob), get(**alice)]) == [200, 200, 429]
        # A client that is no trusted proxy cannot pick a fresh identity with the header.
        mallory = {"REMOTE_ADDR": "203.0.113.9"}
        forged = [get(**mallory, HTTP_X_FORWARDED_FOR=f"192.0.2.{i}") for i in range(3)]
        assert statuses(view, forged) == [200, 429, 429]
        # Nor spoof past the proxy that appended its real address.
        spoof = {**proxy, "HTTP_X_FORWARDED_FOR": "198.51.100.7, 192.0.2.200"}
        assert statuses(view, [get(**spoof), get(**spoof)]) == [200, 429]


@pytest.mark.parametrize("server", ["asgi", "wsgi"])
def test_plans_chosen_per_request_with_async_callables_on_an_async_view(server: str):
    """Under ASGI (an ASGIRequest) the AsyncLimiter decides; under WSGI (Django runs the async
    view on a loop of its own) the blocking limiter does, the callables still awaited."""
    free, pro = Policy("plan-free", "2/minute"), Policy("plan-pro", "5/minute")
    factory = AsyncRequestFactory() if server == "asgi" else RequestFactory()

    async def plan(request: HttpRequest) -> Policy | None:
        await asyncio.sleep(0)
        tier = request.headers.get("x-plan")
        return {"free": free, "pro": pro}.get(tier or "")

    async def user(request: HttpRequest) -> str | None:
        await asyncio.sleep(0)
        return request.headers.get("x-user")

    @ratelimit(plan, key=user)
    async def view(request: HttpRequest) -> HttpResponse:
        return ok(request)

    async def run() -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for tier in ("free", "pro", "none"):
            headers = {"x-plan": tier, "x-user": f"u-{tier}"}
            requests = [factory.get("/x", headers=headers) for _ in range(7)]
            out[tier] = [(await view(request)).status_code for request in requests]
        assert type(requests[0]).__name__ == f"{server.upper()}Request"
        assert current().enabled
        return out

    got = asyncio.run(run())
    assert got == {
        "free": [200] * 2 + [429] * 5,
        "pro": [200] * 5 + [429] * 2,
        "none": [200] * 7,  # no plan: not limited
    }


def test_shadow_decides_but_never_blocks_and_the_view_sees_the_decisions():
    view = ratelimit("1/minute", key="header:x-api-key", shadow=True)(ok)
    replies = [view(get(HTTP_X_API_KEY="s")) for _ in range(3)]
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert [r["RateLimit"] for r in replies][-1].endswith(";r=0;t=60")
    assert json.loads(replies[0].content) == {"decisions": ["tests.http.test_django.ok"]}


# --- the middleware from settings -------------------------------------------------------------


def test_middleware_rules_with_deduct_when_and_an_application_policy():
    login = Policy("logins", "2/minute")
    app_wide = Policy("app-wide", "5/minute")
    values = {
        "KEY": "header:x-api-key",
        "RULES": [
            {
                "path": "/api/*",
                "methods": ["POST"],
                "policy": login,
                "deduct_when": lambda status: status == 401,
            }
        ],
        "APPLICATION_POLICY": app_wide,
        "EXEMPT": ["/health"],
    }
    handled: list[str] = []

    def app(request: HttpRequest) -> HttpResponse:
        handled.append(request.path)
        failed = request.path.startswith("/api/") and request.headers.get("x-password") != "right"
        return HttpResponse(status=401 if failed else 200)

    with settings_with(**values):
        middleware = RateLimitMiddleware(app)
        key = {"HTTP_X_API_KEY": "m"}
        bad = [middleware(get("/api/items", "POST", **key)) for _ in range(3)]
        assert [r.status_code for r in bad] == [401, 401, 429]
        assert len(handled) == 2  # the third was refused before the handler ran
        assert json.loads(bad[2].content)["policy"] == "logins"
        # Both policies are in the headers of an admitted request.
        assert "logins" in bad[0]["RateLimit-Policy"]
        assert "app-wide" in bad[0]["RateLimit-Policy"]
        # The application policy counts everything but the exempt path: 2 so far, 3 left.
        fine = [middleware(get("/other", **key)) for _ in range(4)]
        assert [r.status_code for r in fine] == [200, 200, 200, 429]
        assert json.loads(fine[3].content)["policy"] == "app-wide"
        exempt = get("/health", **key)
        health = middleware(exempt)  # exempt: untouched
        assert health.status_code == 200
        assert not health.has_header("RateLimit")
        assert exempt.ratekeeper == ()  # nothing charged, as on ASGI and WSGI


# --- the middleware and a decorated view on one request ---------------------------------------

NARROW = Policy("dj-narrow", "2/minute")


@ratelimit(NARROW, key="header:x-api-key")
def narrow_sync(request: HttpRequest) -> HttpResponse:
    return ok(request)


@ratelimit(NARROW, key="header:x-api-key")
async def narrow_async(request: HttpRequest) -> HttpResponse:
    return ok(request)


#: The urlconf of the test below (``ROOT_URLCONF`` names this module).
urlpatterns = [route("narrow/sync", narrow_sync), route("narrow/async", narrow_async)]


@pytest.mark.parametrize("counted", ["before", "on_the_outcome"])
@pytest.mark.parametrize("view", ["sync", "async"])
@pytest.mark.parametrize("server", ["wsgi", "asgi"])
def test_a_decorated_view_behind_the_middleware_shows_the_policy_that_constrains(
    server: str, view: str, counted: str
):
    """The middleware's default policy (20/minute; or a rule counted on the outcome, with
    ``deduct_when``) and ``@ratelimit`` (2/minute) on one request, through Django's whole
    handler (``Client``: WSGI; ``AsyncClient``: ASGI). The admitted responses show the
    decorator's policy, which has fewer left; its 429 is its own, headers and all: the
    middleware adds nothing to it."""
    clock = ManualClock()
    api = Policy("api", "20/minute")
    deduct = counted == "on_the_outcome"
    values = {
        "RULES": [{"path": "/*", "policy": api, "deduct_when": lambda status: status < 500}]
        if deduct
        else [],
        "POLICY": api,
        "KEY": "header:x-api-key",
        "LEGACY_HEADERS": True,
        "LIMITER_OPTIONS": {"clock": clock},
    }
    url = f"/narrow/{view}"

    async def over_asgi() -> list[HttpResponse]:
        client = AsyncClient()
        replies = []
        for wait in (0.0, 0.0, 12.5):
            clock.advance(wait)
            replies.append(await client.get(url, headers={"x-api-key": "both"}))
        return replies

    with settings_with(**values), override_settings(ROOT_URLCONF=__name__):
        if server == "asgi":
            replies = asyncio.run(over_asgi())
        else:
            client = Client()
            replies = []
            for wait in (0.0, 0.0, 12.5):
                clock.advance(wait)
                replies.append(client.get(url, HTTP_X_API_KEY="both"))
    assert [r.status_code for r in replies] == [200, 200, 429]
    for remaining, admitted in zip((1, 0), replies[:2], strict=True):
        # Both limiters charged the request (one counted on the outcome, after the view);
        # every policy is listed, the narrower reported.
        charged = ["dj-narrow"] if deduct else ["api", "dj-narrow"]
        assert json.loads(admitted.content) == {"decisions": charged}
        assert admitted["RateLimit-Policy"] == '"api";q=20;w=60, "dj-narrow";q=2;w=60'
        assert admitted["RateLimit"] == f'"dj-narrow";r={remaining};t=60'
        assert admitted["X-RateLimit-Limit"] == "2"
        assert admitted["X-RateLimit-Remaining"] == str(remaining)
        assert not admitted.has_header("Retry-After")
    denied = replies[2]
    assert json.loads(denied.content)["policy"] == "dj-narrow"
    assert json.loads(denied.content)["retry_after"] == 47.5
    assert denied["RateLimit-Policy"] == '"dj-narrow";q=2;w=60'
    assert denied["RateLimit"] == '"dj-narrow";r=0;t=48'
    assert denied["Retry-After"] == "48"
    assert denied["X-RateLimit-Limit"] == "2"
    assert denied["X-RateLimit-Remaining"] == "0"


def test_stacked_decorators_show_the_policy_that_constrains():
    @ratelimit(Policy("wide", "5/minute"), key="header:x-api-key")
    @ratelimit(Policy("tight", "2/minute"), key="header:x-api-key")
    def view(request: HttpRequest) -> HttpResponse:
        return ok(request)

    replies = [view(get(HTTP_X_API_KEY="s")) for _ in range(3)]
    assert [r.status_code for r in replies] == [200, 200, 429]
    assert replies[0]["RateLimit-Policy"] == '"wide";q=5;w=60, "tight";q=2;w=60'
    assert [r["RateLimit"] for r in replies[:2]] == ['"tight";r=1;t=60', '"tight";r=0;t=60']
    assert replies[2]["RateLimit-Policy"] == '"tight";q=2;w=60'
    assert replies[2]["RateLimit"] == '"tight";r=0;t=60'


def test_memory_under_several_workers_logs_a_warning_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    import ratekeeper._http._workers

    monkeypatch.setattr(ratekeeper._http._workers, "_warned", False)
    monkeypatch.setenv("WEB_CONCURRENCY", "2")
    with settings_with(POLICY=Policy("api", "10/minute")), caplog.at_level("WARNING"):
        RateLimitMiddleware(ok)
        RateLimitMiddleware(ok)
    warned = [r.getMessage() for r in caplog.records if "several workers" in r.getMessage()]
    assert len(warned) == 1
    assert "ratekeeper.django.RateLimitMiddleware is on memory://" in warned[0]
    assert "WEB_CONCURRENCY=2" in warned[0]


def test_the_async_chain_with_an_async_key_and_deduct_when():
    """The middleware on Django's async chain (as under uvicorn): async key functions are
    awaited, deduct_when settles after the view, and the view sees the decisions."""

    async def account(request: HttpRequest) -> str | None:
        await asyncio.sleep(0)
        return request.headers.get("x-account")

    seen: list[int] = []

    async def app(request: HttpRequest) -> HttpResponse:
        seen.append(len(getattr(request, "ratekeeper", ())))
        failed = request.path == "/login" and request.headers.get("x-password") != "ok"
        return HttpResponse(status=401 if failed else 200)

    values = {
        "KEY": account,
        "RULES": [
            {
                "path": "/login",
                "policy": Policy("async-logins", "2/minute"),
                "deduct_when": lambda status: status == 401,
            },
            {"path": "/*", "policy": Policy("async-api", "3/minute")},
        ],
    }

    async def run() -> list[HttpResponse]:
        middleware = RateLimitMiddleware(app)
        assert iscoroutinefunction(middleware)
        factory = AsyncRequestFactory()
        replies = []
        for path, password in [("/login", "ok")] * 2 + [("/login", "no")] * 3:
            request = factory.get(path, headers={"x-account": "acct", "x-password": password})
            replies.append(await middleware(request))
        for _ in range(4):
            replies.append(await middleware(factory.get("/items", headers={"x-account": "acct"})))
        return replies

    with settings_with(**values):
        replies = asyncio.run(run())
    # Two good logins cost nothing; two failures spend the budget; the third is refused.
    assert [r.status_code for r in replies[:5]] == [200, 200, 401, 401, 429]
    assert len(seen) == 4 + 3  # the refused login never reached the view
    assert seen[:4] == [0, 0, 0, 0]  # deduct_when: charged after the view, nothing before
    assert [r.status_code for r in replies[5:]] == [200, 200, 200, 429]
    assert seen[4:] == [1, 1, 1]  # the view saw the decision of async-api
    assert replies[8]["RateLimit-Policy"] == '"async-api";q=3;w=60'


# --- ENABLED = False: untouched, and not one store call --------------------------------------


def test_disabled_makes_no_store_call(private_server: RedisServer):
    from rest_framework.test import APIRequestFactory

    from tests.support.django_project.views import Burst

    on_redis = {
        **MEMORY,
        "STORAGE_URL": private_server.url,
        "KEY_PREFIX": f"dj-{uuid.uuid4().hex[:8]}",
        "FAILURE_MODE": "raise",
        "LIMITER_OPTIONS": {"timeout": 5, "connect_timeout": 5},
        "KEY": "header:x-api-key",
        "RULES": [{"path": "/api/*", "policy": Policy("dj-api", "1/minute")}],
    }

    def traffic() -> list[HttpResponse]:
        client, factory, burst = Client(), APIRequestFactory(), Burst.as_view()
        replies = [client.get("/api/items", HTTP_X_API_KEY="z") for _ in range(5)]
        replies += [client.get("/views/sync", HTTP_X_API_KEY="z") for _ in range(10)]

        async def async_traffic() -> list[HttpResponse]:
            async_client = AsyncClient()
            out = [
                await async_client.get("/views/async", headers={"x-api-key": "z"})
                for _ in range(12)
            ]
            if current().enabled:  # its connections belong to this loop
                await current().async_limiter().close()
            return out

        replies += asyncio.run(async_traffic())
        replies += [burst(factory.get("/drf/burst")) for _ in range(55)]
        return replies

    with override_settings(RATEKEEPER={**on_redis, "ENABLED": False}):
        before = private_server.command_calls()
        replies = traffic()
        after = private_server.command_calls()
    assert after == before  # not one command: nothing was even connected
    assert {r.status_code for r in replies} == {200}
    assert not [r for r in replies if r.has_header("RateLimit")]
    # The count sees store calls: the same traffic enabled makes them, and is limited.
    with override_settings(RATEKEEPER=on_redis):
        replies = traffic()
        enabled_calls = private_server.command_calls() - after
        current().close()
    assert {r.status_code for r in replies} == {200, 429}
    # Every admission was decided by the store (a denial may come from the local deny cache).
    assert enabled_calls >= sum(r.status_code == 200 for r in replies) > 0


def test_the_decorator_counts_on_the_outcome() -> None:
    """``deduct_when`` on the decorator: only failed logins count, a success gives its
    reservation back, and once 3 have failed the view no longer runs."""
    ran: list[int] = []

    @ratelimit("3/minute", key="header:x-api-key", deduct_when=lambda status: status == 401)
    def login(request: HttpRequest) -> HttpResponse:
        ok = request.headers.get("x-password") == "right"
        ran.append(200 if ok else 401)
        return HttpResponse(status=200 if ok else 401)

    key = {"HTTP_X_API_KEY": "outcome"}
    right = [login(get("/login", "POST", HTTP_X_PASSWORD="right", **key)) for _ in range(5)]
    assert [r.status_code for r in right] == [200] * 5  # none counted
    wrong = [login(get("/login", "POST", **key)) for _ in range(5)]
    assert [r.status_code for r in wrong] == [401, 401, 401, 429, 429]
    assert ran == [200] * 5 + [401] * 3


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"key": "ip", "rate": "5/m"}, r"no rate= \(django-ratelimit's argument\): give the rates"),
        ({"method": "POST"}, r"no method= .*methods=\{'POST'\}"),
        ({"block": False}, r"no block= .*block=False is shadow=True"),
        ({"group": "expensive"}, r"no group= .*the same Policy"),
        ({"keyy": "ip"}, r"unexpected keyword argument 'keyy'"),
    ],
)
def test_django_ratelimit_arguments_say_what_to_write_instead(
    arguments: dict[str, Any], message: str
) -> None:
    policy = () if "rate" in arguments else ("5/m",)
    with pytest.raises(TypeError, match=message):
        ratelimit(*policy, **arguments)
    with pytest.raises(TypeError, match=r"needs the rates or a Policy as its first argument"):
        ratelimit(key="ip")
