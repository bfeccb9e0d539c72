"""Responses: IETF RateLimit headers, Retry-After, problem+json, legacy headers, custom denials,
no duplicated headers; and the rule matching shared by both middlewares.

Exact header values come from limiters on a :class:`ManualClock`, so the state is known.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import httpx
import pytest

from ratekeeper import (
    AsyncLimiter,
    ConfigError,
    Decision,
    Limiter,
    ManualClock,
    Policy,
    Rate,
    asgi,
    testing,
    wsgi,
)
from ratekeeper._http import (
    Admission,
    Limiting,
    Request,
    Rule,
    StoreCall,
    drive_async,
    make_rules,
    match_rule,
    merge_headers,
    missing_identity_response,
    problem_body,
    rate_limit_headers,
    response_headers,
)
from ratekeeper.identity import header

from ..support.web_apps import asgi_client, plain_app

#: The start of a minute: fixed windows are aligned to it.
MINUTE = 1_699_999_980.0
PEER = "203.0.113.7"


#: ``ratekeeper.testing.decision`` for policy "name" under 100/minute: 42 left, a reset in 16.2 s.
decision = functools.partial(
    testing.decision, rate="100/minute", remaining=42, reset_after=16.2, policy="name"
)


# --- the pure functions --------------------------------------------------------------------------


def test_rate_limit_headers_of_an_admission():
    assert rate_limit_headers(decision()) == [
        ("RateLimit-Policy", '"name";q=100;w=60'),
        ("RateLimit", '"name";r=42;t=17'),
    ]


def test_windows_and_resets_are_whole_seconds_rounded_up():
    headers = dict(rate_limit_headers(decision(reset_after=0.001, rate=Rate(5, 1.5))))
    assert headers == {"RateLimit-Policy": '"name";q=5;w=2', "RateLimit": '"name";r=42;t=1'}
    assert dict(rate_limit_headers(decision(reset_after=0.0)))["RateLimit"] == '"name";r=42;t=0'


@pytest.mark.parametrize(
    ("retry_after", "header"),
    [(0.2, "1"), (0.0001, "1"), (1.0, "1"), (1.2, "2"), (2.0, "2"), (59.001, "60"), (0.0, "1")],
)
def test_retry_after_is_whole_seconds_rounded_up(retry_after: float, header: str):
    denied = decision(allowed=False, remaining=0, retry_after=retry_after)
    headers = rate_limit_headers(denied)
    assert [v for n, v in headers if n == "Retry-After"] == [header]
    assert math.ceil(retry_after) <= int(header)  # never early


def test_a_cost_that_can_never_pass_has_no_retry_after():
    never = decision(allowed=False, remaining=0, retry_after=math.inf)
    assert "Retry-After" not in dict(rate_limit_headers(never))
    assert "retry_after" not in json.loads(problem_body(never))


def test_legacy_headers_only_when_asked():
    plain = rate_limit_headers(decision())
    assert not [n for n, _ in plain if n.startswith("X-")]
    legacy = rate_limit_headers(decision(), legacy=True)
    assert legacy[-3:] == [
        ("X-RateLimit-Limit", "100"),
        ("X-RateLimit-Remaining", "42"),
        ("X-RateLimit-Reset", "17"),
    ]


def test_degraded_decisions_get_no_rate_limit_headers():
    assert response_headers(decision(degraded=True, reason="unavailable/closed")) == []
    assert response_headers(decision(degraded=True, reason="unavailable/closed"), legacy=True) == []
    denied = decision(
        allowed=False, remaining=0, retry_after=2.5, degraded=True, reason="unavailable/closed"
    )
    assert response_headers(denied, legacy=True) == [("Retry-After", "3")]
    assert response_headers(decision()) == rate_limit_headers(decision())


def test_problem_body():
    body = json.loads(problem_body(decision(allowed=False, remaining=0, retry_after=0.2)))
    assert body["status"] == 429
    assert body["title"] == "Too Many Requests"
    assert body["type"] == "about:blank"
    assert body["policy"] == "name"
    assert body["retry_after"] == 0.2
    assert "name" in body["detail"]
    assert "100/minute" in body["detail"]


@pytest.mark.parametrize(
    "retry_after", [0.0004, 0.2, 1.0, 59.9991, 12345.6789, 1e16, math.inf, None]
)
def test_the_problem_body_is_compact_json_of_the_problem(retry_after: float | None):
    """The body is built from a kept prefix per policy and rate: byte for byte what
    ``json.dumps`` of the whole problem gives."""
    denial = replace(decision(allowed=False, remaining=0), retry_after=retry_after)
    problem: dict[str, Any] = {
        "type": "about:blank",
        "title": "Too Many Requests",
        "status": 429,
        "detail": f"Rate limit exceeded for policy 'name' ({denial.rate}).",
        "policy": "name",
    }
    if retry_after is not None and math.isfinite(retry_after):
        problem["retry_after"] = math.ceil(retry_after * 1000) / 1000
    expected = json.dumps(problem, separators=(",", ":")).encode()
    assert problem_body(denial) == problem_body(denial) == expected


def test_headers_are_decoded_only_when_read():
    def scope() -> dict[str, Any]:
        return {
            "type": "http",
            "method": "GET",
            "path": "/",
            "headers": [(b"x-api-key", b"k"), (b"X-Two", b"a"), (b"x-two", b"b")],
            "client": (PEER, 1),
        }

    async def decide(limiting: Limiting, view: Request) -> Any:
        async with AsyncLimiter.from_url("memory://") as limiter:
            return await drive_async(limiting.admit(view), limiter)

    # client_ip() with no trusted proxy never reads a header: they are never decoded.
    view = asgi.request_from_scope(scope())
    admission = asyncio.run(decide(Limiting(policy=Policy("p", "5/minute")), view))
    assert admission.decisions[0].remaining == 4
    assert view.headers._decoded is None  # type: ignore[attr-defined]
    # A key function that reads one decodes them all, once; repeated names are joined.
    view = asgi.request_from_scope(scope())
    keyed = Limiting(policy=Policy("p", "5/minute"), key=header("x-api-key"))
    asyncio.run(decide(keyed, view))
    assert view.headers._decoded == {"x-api-key": "k", "x-two": "a, b"}  # type: ignore[attr-defined]
    assert view.headers == {"x-api-key": "k", "x-two": "a, b"}
    assert "x-two" in view.headers
    assert len(view.headers) == 2


def test_merge_headers_drops_the_apps_copies_whatever_their_case():
    ours = [("RateLimit", "ours"), ("Retry-After", "3")]
    app = [("ratelimit", "app"), ("RETRY-AFTER", "9"), ("Content-Type", "text/plain")]
    assert merge_headers(app, ours) == [("Content-Type", "text/plain"), *ours]


# --- rules ---------------------------------------------------------------------------------------

API = Policy("api", "10/minute")
USERS = Policy("users", "10/minute")
DEFAULT = Policy("default", "10/minute")


def names(rules: Iterable[Rule], method: str, path: str) -> str | None:
    rule = match_rule(tuple(rules), method, path)
    if rule is None:
        return None
    return "exempt" if rule.policy is None else rule.policy.name


def test_globs_match_anything_including_slashes():
    rules = [Rule("/api/*", API), Rule("/users/*/avatar", USERS)]
    assert names(rules, "GET", "/api/items") == "api"
    assert names(rules, "GET", "/api/items/7/parts") == "api"
    assert names(rules, "GET", "/users/7/avatar") == "users"
    assert names(rules, "GET", "/apix") is None
    assert names(rules, "GET", "/API/items") is None  # case matters
    assert names(rules, "GET", "/users/7/avatar.png") is None


def test_regexes_must_match_the_whole_path():
    rules = [Rule(re.compile(r"/users/\d+"), USERS)]
    assert names(rules, "GET", "/users/42") == "users"
    assert names(rules, "GET", "/users/42/x") is None
    assert names(rules, "GET", "/v1/users/42") is None


def test_methods_are_matched_case_insensitively_as_declared():
    rule = Rule("/api/*", API, methods=frozenset({"post", "Put"}))
    assert rule.methods == frozenset({"POST", "PUT"})
    assert names([rule], "POST", "/api/x") == "api"
    assert names([rule], "PUT", "/api/x") == "api"
    assert names([rule], "GET", "/api/x") is None


def test_a_get_rule_matches_head_as_frameworks_route_it():
    get = Rule("/search*", API, methods={"get"})
    assert get.methods == frozenset({"GET"})  # kept as declared
    assert names([get], "GET", "/search") == "api"
    assert names([get], "HEAD", "/search") == "api"
    for method in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH"):
        assert names([get], method, "/search") is None
    head = Rule("/x", API, methods={"HEAD"})
    assert names([head], "HEAD", "/x") == "api"
    assert names([head], "GET", "/x") is None
    assert names([Rule("/x", API, methods={"OPTIONS"})], "OPTIONS", "/x") == "api"


def first_call(limiting: Limiting, request: Request) -> StoreCall | Admission | None:
    """The first store call ``admit`` asks for (the policy and identity charged), or what it
    returns without one."""
    steps = limiting.admit(request)
    try:
        step = steps.send(None)
        while isinstance(step, StoreCall) and step.cached:
            step = steps.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    assert isinstance(step, StoreCall)
    return step


def route_of(limiting: Limiting, method: str, **headers: str) -> str | None:
    """The policy a request is charged to, ``"reject"``, or None when it is not charged."""
    found = first_call(
        limiting,
        Request(method, "/api/x", {k.replace("_", "-"): v for k, v in headers.items()}, PEER),
    )
    if found is None:
        return None
    if isinstance(found, Admission):
        assert found.response is not None
        return "reject" if found.response[0] == 400 else "?"
    return found.policy.name


PREFLIGHT = {"origin": "https://a.example", "access_control_request_method": "PUT"}


def test_preflights_are_exempt_unless_the_rule_names_options_or_preflight_is_charge():
    plain = Limiting(policy=DEFAULT)
    assert route_of(plain, "OPTIONS", **PREFLIGHT) is None
    assert route_of(plain, "OPTIONS") == "default"  # no preflight: charged
    assert route_of(plain, "OPTIONS", origin="https://a.example") == "default"
    assert route_of(plain, "GET", **PREFLIGHT) == "default"  # only OPTIONS can be one
    charge = Limiting(policy=DEFAULT, preflight="charge")
    assert route_of(charge, "OPTIONS", **PREFLIGHT) == "default"
    named = Limiting(rules=[Rule("/api/*", API, methods={"options", "PUT"})], policy=DEFAULT)
    assert route_of(named, "OPTIONS", **PREFLIGHT) == "api"
    # A GET rule does not match OPTIONS; the default then exempts the preflight.
    get = Limiting(rules=[Rule("/api/*", API, methods={"GET"})], policy=DEFAULT)
    assert route_of(get, "OPTIONS", **PREFLIGHT) is None


def test_a_missing_identity_is_routed_by_the_option():
    def nobody(request: Request) -> str | None:
        return None

    assert route_of(Limiting(policy=DEFAULT, key=nobody), "GET") == "default"
    fallback = first_call(Limiting(policy=DEFAULT, key=nobody), Request("GET", "/", {}, PEER))
    assert isinstance(fallback, StoreCall)
    assert fallback.identity == f"anonymous:ip:{PEER}"
    assert route_of(Limiting(policy=DEFAULT, key=nobody, missing_identity="reject"), "GET") == (
        "reject"
    )
    assert route_of(Limiting(policy=DEFAULT, key=nobody, missing_identity="allow"), "GET") is None
    shadow = Limiting(policy=DEFAULT, key=nobody, missing_identity="reject", shadow=True)
    assert route_of(shadow, "GET") is None
    # With an identity, the option changes nothing.
    for choice in ("client_ip", "reject", "allow"):
        keyed = Limiting(policy=DEFAULT, missing_identity=choice)  # type: ignore[arg-type]
        found = first_call(keyed, Request("GET", "/", {}, PEER))
        assert isinstance(found, StoreCall)
        assert found.identity == f"ip:{PEER}"


def test_the_rejection_is_problem_json():
    status, headers, body = missing_identity_response()
    assert status == 400
    assert headers == [
        ("Content-Type", "application/problem+json"),
        ("Content-Length", str(len(body))),
    ]
    assert json.loads(body) == {
        "type": "about:blank",
        "title": "Bad Request",
        "status": 400,
        "detail": "The request carries no client identity, which this endpoint requires.",
    }


def test_first_match_wins_exemptions_first_default_last():
    rules = make_rules(
        DEFAULT,
        [Rule("/api/users/*", USERS), Rule("/api/*", API), Rule("/api/users/me", DEFAULT)],
        ["/api/health", re.compile(r"/health(z)?")],
    )
    assert names(rules, "GET", "/api/users/me") == "users"
    assert names(rules, "GET", "/api/other") == "api"
    assert names(rules, "GET", "/api/health") == "exempt"  # even though /api/* matches
    assert names(rules, "GET", "/healthz") == "exempt"
    assert names(rules, "GET", "/elsewhere") == "default"


def test_without_a_default_unmatched_paths_are_not_limited():
    rules = make_rules(None, [Rule("/api/*", API)], [])
    assert names(rules, "GET", "/elsewhere") is None


@pytest.mark.parametrize(
    "build",
    [
        Limiting,
        lambda: Limiting(rules=[Rule("/x", None)], exempt=["/health"]),
        lambda: make_rules(None, ["/api/*"], []),
        lambda: make_rules("api", [], []),
        lambda: Rule(42, API),  # type: ignore[arg-type]
        lambda: Rule("/x", "api"),  # type: ignore[arg-type]
        lambda: Rule("/x", API, cost=0),
        lambda: Rule("/x", API, cost=True),
        lambda: Rule("/x", API, methods="GET"),  # type: ignore[arg-type]
        lambda: Rule("/x", API, methods=set()),
        lambda: Rule("/x", API, methods={""}),
        lambda: Rule("/x", API, methods={"GET", 1}),  # type: ignore[arg-type]
        lambda: Limiting(policy=API, missing_identity="deny"),  # type: ignore[arg-type]
        lambda: Limiting(policy=API, preflight=False),  # type: ignore[arg-type]
    ],
)
def test_bad_rules_are_config_errors(build: Callable[[], Any]):
    with pytest.raises(ConfigError):
        build()


# --- through the middlewares: ASGI and WSGI, one driver each -------------------------------------


class Response:
    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def get_all(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n.lower() == name.lower()]

    def get(self, name: str) -> str | None:
        values = self.get_all(name)
        assert len(values) <= 1, f"{name} sent {len(values)} times: {values}"
        return values[0] if values else None


def wsgi_plain_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    body = json.dumps({"path": environ["PATH_INFO"]}).encode()
    start_response("200 OK", [("Content-Type", "application/json")])
    return [body]


def asgi_app_with_headers(extra: list[tuple[bytes, bytes]]) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain"), *extra],
            }
        )
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def wsgi_app_with_headers(extra: list[tuple[bytes, bytes]]) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response(
            "200 OK",
            [("Content-Type", "text/plain")] + [(n.decode(), v.decode()) for n, v in extra],
        )
        return [b"ok"]

    return app


def run_requests(
    flavor: str,
    *,
    clock: ManualClock,
    count: int,
    app: Any = None,
    path: str = "/",
    before: Callable[[int], None] = lambda i: None,
    **middleware: Any,
) -> list[Response]:
    """``count`` GETs of ``path`` through the ``flavor`` middleware on a fresh memory limiter;
    ``before(i)`` runs before request ``i`` (to move the clock)."""
    if flavor == "asgi":

        async def main() -> list[Response]:
            out = []
            async with AsyncLimiter.from_url("memory://", clock=clock) as limiter:
                wrapped = asgi.RateLimitMiddleware(app or plain_app, limiter=limiter, **middleware)
                async with asgi_client(wrapped, client=(PEER, 40000)) as http:
                    for i in range(count):
                        before(i)
                        r = await http.get(path)
                        out.append(
                            Response(r.status_code, list(r.headers.multi_items()), r.content)
                        )
            return out

        return asyncio.run(main())

    out = []
    with Limiter.from_url("memory://", clock=clock) as limiter:
        wrapped = wsgi.RateLimitMiddleware(app or wsgi_plain_app, limiter=limiter, **middleware)
        transport = httpx.WSGITransport(app=wrapped, remote_addr=PEER)
        with httpx.Client(transport=transport, base_url="http://testserver") as http:
            for i in range(count):
                before(i)
                r = http.get(path)
                out.append(Response(r.status_code, list(r.headers.multi_items()), r.content))
    return out


FLAVORS = ["asgi", "wsgi"]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_exact_headers_for_a_known_state(flavor: str):
    """A fixed window of 100/minute, 43 s into the window: the nth request leaves 100 - n and
    the window resets in 17 s."""
    clock = ManualClock(MINUTE + 43)
    policy = Policy("name", "100/minute", "fixed_window")
    responses = run_requests(flavor, clock=clock, count=58, policy=policy)
    assert [r.status for r in responses] == [200] * 58
    for n, r in enumerate(responses, start=1):
        assert r.get("RateLimit-Policy") == '"name";q=100;w=60'
        assert r.get("RateLimit") == f'"name";r={100 - n};t=17'
        assert r.get("Retry-After") is None
        assert r.get("X-RateLimit-Limit") is None
    assert responses[-1].get("RateLimit") == '"name";r=42;t=17'


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_429_has_retry_after_rounded_up_and_a_problem_body(flavor: str):
    """One per second: a second request 0.8 s after the first must wait exactly 0.2 s."""
    clock = ManualClock(MINUTE)
    responses = run_requests(
        flavor,
        clock=clock,
        count=3,
        policy=Policy("one", "1/second"),
        before=lambda i: clock.advance(0.8 if i == 1 else 0.0),
    )
    assert [r.status for r in responses] == [200, 429, 429]
    denied = responses[1]
    assert denied.get("Retry-After") == "1"
    assert denied.get("RateLimit-Policy") == '"one";q=1;w=1'
    assert denied.get("RateLimit") == '"one";r=0;t=1'
    assert denied.get("Content-Type") == "application/problem+json"
    assert denied.get("Content-Length") == str(len(denied.body))
    problem = json.loads(denied.body)
    assert problem["status"] == 429
    assert problem["title"] == "Too Many Requests"
    assert "'one'" in problem["detail"]
    assert "1/second" in problem["detail"]
    assert problem["retry_after"] == pytest.approx(0.2)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_retry_after_of_a_longer_wait(flavor: str):
    clock = ManualClock(MINUTE)
    responses = run_requests(
        flavor,
        clock=clock,
        count=4,
        policy=Policy("three", "3 per 10 seconds"),
        before=lambda i: clock.advance(1.25 if i == 3 else 0.0),
    )
    assert [r.status for r in responses] == [200, 200, 200, 429]
    # Denied 1.25 s after three hits: 8.75 s to wait, sent as 9.
    assert responses[3].get("Retry-After") == "9"
    assert json.loads(responses[3].body)["retry_after"] == pytest.approx(8.75)
    assert responses[3].get("RateLimit") == '"three";r=0;t=9'


@pytest.mark.parametrize("flavor", FLAVORS)
def test_legacy_headers_when_enabled(flavor: str):
    clock = ManualClock(MINUTE + 43)
    policy = Policy("name", "3/minute", "fixed_window")
    responses = run_requests(flavor, clock=clock, count=4, policy=policy, legacy_headers=True)
    assert [r.status for r in responses] == [200, 200, 200, 429]
    for n, r in enumerate(responses, start=1):
        assert r.get("X-RateLimit-Limit") == "3"
        assert r.get("X-RateLimit-Remaining") == str(max(0, 3 - n))
        assert r.get("X-RateLimit-Reset") == "17"
        assert r.get("RateLimit") == f'"name";r={max(0, 3 - n)};t=17'


def custom_denied(decision: Decision, request: Request) -> tuple[int, list[tuple[str, str]], bytes]:
    body = f"slow down on {request.path}, {decision.policy}".encode()
    return 503, [("Content-Type", "text/plain"), ("X-Denied-By", "ratekeeper")], body


@pytest.mark.parametrize("flavor", FLAVORS)
def test_custom_denied_response(flavor: str):
    clock = ManualClock(MINUTE)
    responses = run_requests(
        flavor,
        clock=clock,
        count=2,
        path="/things",
        policy=Policy("tiny", "1/minute"),
        denied=custom_denied,
    )
    assert [r.status for r in responses] == [200, 503]
    denied = responses[1]
    assert denied.body == b"slow down on /things, tiny"
    assert denied.get("Content-Type") == "text/plain"
    assert denied.get("X-Denied-By") == "ratekeeper"
    assert denied.get("Retry-After") == "60"
    assert denied.get("RateLimit") == '"tiny";r=0;t=60'
    assert denied.get("Content-Length") == str(len(denied.body))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_custom_denial_cannot_duplicate_our_headers(flavor: str):
    def denied(decision: Decision, request: Request) -> tuple[int, list[tuple[str, str]], bytes]:
        return 429, [("ratelimit", "mine"), ("RETRY-AFTER", "999")], b"no"

    responses = run_requests(
        flavor, clock=ManualClock(MINUTE), count=2, policy=Policy("t", "1/minute"), denied=denied
    )
    assert responses[1].status == 429
    assert responses[1].get_all("RateLimit") == ['"t";r=0;t=60']
    assert responses[1].get_all("Retry-After") == ["60"]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_custom_denial_that_sets_content_length_gets_it_once(flavor: str):
    """A denial builder that sets its own Content-Length (copied from a framework response,
    say) must not end up with two: ``_respond`` (asgi.py) and the WSGI denial path both append
    one without looking, so the response carries ``Content-Length`` twice."""

    def denied(decision: Decision, request: Request) -> tuple[int, list[tuple[str, str]], bytes]:
        return 429, [("Content-Type", "text/plain"), ("Content-Length", "4")], b"nope"

    responses = run_requests(
        flavor, clock=ManualClock(MINUTE), count=2, policy=Policy("t", "1/minute"), denied=denied
    )
    assert responses[1].status == 429
    assert responses[1].body == b"nope"
    assert responses[1].get_all("Content-Length") == ["4"]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_an_app_that_sets_its_own_rate_limit_headers_sends_ours_once(flavor: str):
    extra = [(b"RateLimit", b"app"), (b"ratelimit-policy", b"app"), (b"X-App", b"kept")]
    app = asgi_app_with_headers(extra) if flavor == "asgi" else wsgi_app_with_headers(extra)
    responses = run_requests(
        flavor,
        clock=ManualClock(MINUTE + 43),
        count=2,
        app=app,
        policy=Policy("name", "100/minute", "fixed_window"),
    )
    for n, r in enumerate(responses, start=1):
        assert r.status == 200
        assert r.get_all("RateLimit") == [f'"name";r={100 - n};t=17']
        assert r.get_all("RateLimit-Policy") == ['"name";q=100;w=60']
        assert r.get_all("X-App") == ["kept"]
        assert r.body == b"ok"


@pytest.mark.parametrize("flavor", FLAVORS)
def test_no_header_appears_twice(flavor: str):
    clock = ManualClock(MINUTE)
    responses = run_requests(
        flavor, clock=clock, count=3, policy=Policy("twice", "2/minute"), legacy_headers=True
    )
    assert [r.status for r in responses] == [200, 200, 429]
    for r in responses:
        lowered = [n.lower() for n, _ in r.headers]
        assert len(lowered) == len(set(lowered)), r.headers
