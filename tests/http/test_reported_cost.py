"""Costs known when the response ends (``reported_cost``), in every integration that sees the
end of a response: the ASGI and WSGI middlewares' rules, ``flask_limit`` and Django's
``@ratelimit`` (and its settings' rules). The cost is an estimate reserved before the handler
runs, settled to what the handler reports (True: the value it stores) or to what a function of
the response returns, before the last chunk leaves.

On 1,000 tokens a minute with an estimate of 200 and an actual of 700 each time: admitted and
charged 700, admitted again (200 fits in the 300 left) and charged 700, then refused. Real
servers (gunicorn, uvicorn) run the Django form in ``test_django_servers.py``; the streamed ASGI
rule is in ``test_reservations.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ratekeeper import AsyncLimiter, ConfigError, Limiter, ManualClock, Policy

from ..support.web_apps import asgi_client

TOKENS = Policy("tokens", "1000/minute")
START = 1_700_000_000.0


def _blocking() -> Limiter:
    return Limiter.from_url("memory://", clock=ManualClock(START))


def _wsgi_client(app: Any) -> httpx.Client:
    transport = httpx.WSGITransport(app=app, remote_addr="203.0.113.7")
    return httpx.Client(transport=transport, base_url="http://testserver")


def _three_answers(send: Any) -> list[httpx.Response]:
    return [send() for _ in range(3)]


def _charged_700_twice(replies: list[httpx.Response], remaining: int) -> None:
    assert [r.status_code for r in replies] == [200, 200, 429]
    assert remaining == 0  # 2 x 700 = 1,400 of 1,000: the second's overrun is owed
    assert replies[2].json()["policy"] == "tokens"


# --- ASGI: a function of the response -----------------------------------------------------------


def test_asgi_rule_charges_what_a_function_of_the_response_returns() -> None:
    from ratekeeper.asgi import RateLimitMiddleware, ResponseView, Rule

    limiter = AsyncLimiter.from_url("memory://", clock=ManualClock(START))
    seen: list[ResponseView] = []

    def used(response: ResponseView) -> int:
        seen.append(response)
        return int(response.headers["x-tokens-used"])

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/plain"), (b"X-Tokens-Used", b"700")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"to", "more_body": True})
        await send({"type": "http.response.body", "body": b"be"})

    limited = RateLimitMiddleware(
        app, limiter=limiter, rules=[Rule("/v1/chat", TOKENS, cost=200, reported_cost=used)]
    )

    async def main() -> None:
        async with asgi_client(limited) as http:
            replies = [await http.post("/v1/chat") for _ in range(3)]
        after = await limiter.peek(TOKENS, "ip:203.0.113.7")
        _charged_700_twice(replies, after.remaining)
        assert [r.content for r in replies[:2]] == [b"tobe"] * 2
        await limiter.close()

    asyncio.run(main())
    assert [(r.status, r.headers["x-tokens-used"]) for r in seen] == [(200, "700")] * 2
    assert "ratekeeper" in seen[0].state  # the request's state, where handlers write


#: Reported costs that are not a whole number from 0 to 2**53, as handlers get them wrong.
BAD_COSTS = [3.5, -5, "300", True, 2**53 + 1]


@pytest.mark.parametrize("bad", BAD_COSTS, ids=repr)
def test_a_bad_reported_cost_keeps_the_estimate_and_the_response_completes(
    bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler streams its body and stores a bad cost in ``request.state`` (ASGI): every
    chunk reaches the client, the estimate stays charged, and one warning names the route and
    the policy, however many requests repeat it."""
    from ratekeeper.asgi import RateLimitMiddleware, Rule

    limiter = AsyncLimiter.from_url("memory://", clock=ManualClock(START))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in (b"to", b"be"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        scope["state"]["ratekeeper_cost"] = bad  # request.state.ratekeeper_cost = bad
        await send({"type": "http.response.body", "body": b"!"})

    limited = RateLimitMiddleware(
        app, limiter=limiter, rules=[Rule("/v1/*", TOKENS, cost=200, reported_cost=True)]
    )

    async def main() -> None:
        async with asgi_client(limited) as http:
            replies = [await http.post("/v1/chat") for _ in range(2)]
        assert [(r.status_code, r.content) for r in replies] == [(200, b"tobe!")] * 2
        assert (await limiter.peek(TOKENS, "ip:203.0.113.7")).remaining == 600
        await limiter.close()

    with caplog.at_level("WARNING", logger="ratekeeper"):
        asyncio.run(main())
    warned = [r.getMessage() for r in caplog.records if "reported cost" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "route /v1/*, policy 'tokens'" in warned[0]
    assert repr(bad) in warned[0]


@pytest.mark.parametrize("bad", BAD_COSTS, ids=repr)
def test_a_bad_reported_cost_under_wsgi_keeps_the_estimate(bad: object) -> None:
    """The same under the WSGI middleware, from a function of the response."""
    from ratekeeper.wsgi import RateLimitMiddleware, Rule

    limiter = _blocking()

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return iter([b"to", b"be"])

    limited = RateLimitMiddleware(
        app,
        limiter=limiter,
        rules=[Rule("/v1/chat", TOKENS, cost=200, reported_cost=lambda response: bad)],
    )
    with _wsgi_client(limited) as http:
        reply = http.post("/v1/chat")
    assert (reply.status_code, reply.content) == (200, b"tobe")
    assert limiter.peek(TOKENS, "ip:203.0.113.7").remaining == 800


def test_reported_cost_choices_are_checked_at_configuration() -> None:
    from ratekeeper.asgi import Rule, fastapi_dependency

    with pytest.raises(ConfigError, match="must be True, False or a function of the response"):
        Rule("/v1/chat", TOKENS, reported_cost="yes")  # type: ignore[arg-type]

    async def later(response: Any) -> int:
        return 1

    with pytest.raises(ConfigError, match="plain function of the response, not async"):
        Rule("/v1/chat", TOKENS, reported_cost=later)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="reported_cost needs a policy"):
        Rule("/health", None, reported_cost=True)
    # A dependency returns before the response exists: it has no such option.
    with pytest.raises(TypeError, match="reported_cost"):
        fastapi_dependency(AsyncLimiter.from_url("memory://"), TOKENS, reported_cost=True)  # type: ignore[call-arg]


# --- WSGI middleware ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["stored", "function"])
def test_wsgi_rule_settles_a_streamed_body_before_its_last_chunk(form: str) -> None:
    """A WSGI app streams its body; the cost is stored in the environ by its generator after
    the last chunk (True), or read from a response header (a function): settled before the
    last chunk reaches the server, and the app's iterable is closed."""
    from ratekeeper.wsgi import RateLimitMiddleware, Rule

    limiter = _blocking()
    closed: list[bool] = []

    class Body:
        def __init__(self, environ: dict[str, Any]) -> None:
            self.environ = environ

        def __iter__(self) -> Iterator[bytes]:
            yield b"to"
            yield b"be"
            self.environ["ratekeeper_cost"] = 700

        def close(self) -> None:
            closed.append(True)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("200 OK", [("Content-Type", "text/plain"), ("X-Tokens-Used", "700")])
        return Body(environ)

    reported: Any = True if form == "stored" else (lambda r: int(r.headers["x-tokens-used"]))
    limited = RateLimitMiddleware(
        app, limiter=limiter, rules=[Rule("/v1/chat", TOKENS, cost=200, reported_cost=reported)]
    )
    with _wsgi_client(limited) as http:
        replies = _three_answers(lambda: http.post("/v1/chat"))
    _charged_700_twice(replies, limiter.peek(TOKENS, "ip:203.0.113.7").remaining)
    assert [r.content for r in replies[:2]] == [b"tobe"] * 2
    assert closed == [True, True]


@pytest.mark.parametrize(("reported", "remaining"), [(700, 300), (90, 800), (None, 800)])
def test_a_wsgi_body_not_read_to_its_end_is_charged_what_was_reported(
    reported: int | None, remaining: int
) -> None:
    """The client goes away after the first chunk and the server closes the body: charged
    what was reported so far (700), or the estimate (200) if that is more (90, or nothing)."""
    from ratekeeper.wsgi import RateLimitMiddleware, Rule

    limiter = _blocking()

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("200 OK", [])
        environ["ratekeeper_cost"] = reported
        return iter([b"to", b"be"])

    limited = RateLimitMiddleware(
        app, limiter=limiter, rules=[Rule("/v1/chat", TOKENS, cost=200, reported_cost=True)]
    )
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/chat", "REMOTE_ADDR": "203.0.113.7"}
    body = limited(environ, lambda status, headers, exc_info=None: None)
    assert next(iter(body)) == b"to"  # the client went away after the first chunk
    body.close()  # type: ignore[attr-defined]
    assert limiter.peek(TOKENS, "ip:203.0.113.7").remaining == remaining
    body.close()  # type: ignore[attr-defined]  # a second close charges nothing more
    assert limiter.peek(TOKENS, "ip:203.0.113.7").remaining == remaining


@pytest.mark.parametrize("leaves", ["app stops", "send fails"])
@pytest.mark.parametrize(("per_chunk", "remaining"), [(10, 910), (3, 950)])
def test_an_abandoned_asgi_stream_is_charged_what_was_reported(
    leaves: str, per_chunk: int, remaining: int
) -> None:
    """Estimate 50; the handler reports its running cost after each of 9 chunks of 10, then
    the client leaves (the app stops, as Starlette's streams do on a disconnect, or the
    server's send fails): charged 90, what was reported; with 3 a chunk (27 reported), the
    estimate, 50, which is more."""
    from ratekeeper.asgi import RateLimitMiddleware, Rule

    limiter = AsyncLimiter.from_url("memory://", clock=ManualClock(START))
    sent: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in range(1, 10):
            scope["state"]["ratekeeper_cost"] = chunk * per_chunk
            await send({"type": "http.response.body", "body": b"x", "more_body": True})

    async def send(message: dict[str, Any]) -> None:
        if leaves == "send fails" and len(sent) == 9:
            raise OSError("the client went away")
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    limited = RateLimitMiddleware(
        app, limiter=limiter, rules=[Rule("/v1/chat", TOKENS, cost=50, reported_cost=True)]
    )
    scope = {
        "type": "http", "method": "POST", "path": "/v1/chat", "headers": [],
        "client": ("203.0.113.7", 5000), "state": {},
    }  # fmt: skip

    async def main() -> None:
        try:
            await limited(scope, receive, send)
        except OSError:
            assert leaves == "send fails"
        assert (await limiter.peek(TOKENS, "ip:203.0.113.7")).remaining == remaining
        await limiter.close()

    asyncio.run(main())
    assert len(sent) == (10 if leaves == "app stops" else 9)  # the start and the chunks sent
    assert all(m.get("more_body") for m in sent[1:])  # never a last one


def test_an_async_body_closed_before_its_last_chunk_says_so() -> None:
    """Django's async streamed bodies: ``finish(True)`` before the last chunk when read to the
    end, ``finish(False)`` when closed before it (the server's ``aclose``), once either way."""
    from ratekeeper._http import last_chunk_async

    async def chunks() -> Any:
        for chunk in (b"a", b"b", b"c"):
            yield chunk

    async def main() -> tuple[list[bool], list[bool]]:
        calls: dict[str, list[bool]] = {"read": [], "left": []}

        async def finish_for(name: str, complete: bool) -> None:
            calls[name].append(complete)

        async def read(complete: bool) -> None:
            await finish_for("read", complete)

        async def left(complete: bool) -> None:
            await finish_for("left", complete)

        assert [c async for c in last_chunk_async(chunks(), read)] == [b"a", b"b", b"c"]
        body = last_chunk_async(chunks(), left)
        assert await anext(body) == b"a"
        await body.aclose()
        return calls["read"], calls["left"]

    assert asyncio.run(main()) == ([True], [False])


# --- Flask ------------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True])
def test_flask_limit_charges_the_reported_cost(streamed: bool) -> None:
    import flask

    from ratekeeper.wsgi import flask_limit

    limiter = _blocking()
    app = flask.Flask(__name__)

    @app.post("/v1/chat")
    @flask_limit(limiter, TOKENS, cost=200, reported_cost=True)
    def chat() -> Any:
        if not streamed:
            flask.request.environ["ratekeeper_cost"] = 700
            return "tobe"

        @flask.stream_with_context
        def answer() -> Iterator[str]:
            yield "to"
            yield "be"
            flask.request.environ["ratekeeper_cost"] = 700

        return flask.Response(answer())

    with _wsgi_client(app) as http:
        replies = _three_answers(lambda: http.post("/v1/chat"))
    _charged_700_twice(replies, limiter.peek(TOKENS, "ip:203.0.113.7").remaining)
    assert [r.content for r in replies[:2]] == [b"tobe"] * 2


def test_flask_limit_charges_what_a_function_of_the_response_returns() -> None:
    import flask

    from ratekeeper.wsgi import flask_limit

    limiter = _blocking()
    app = flask.Flask(__name__)

    def usage(response: flask.Response) -> int:
        total: int = response.get_json()["usage"]["total_tokens"]
        return total

    @app.post("/v1/chat")
    @flask_limit(limiter, TOKENS, cost=200, reported_cost=usage)
    def chat() -> Any:
        return {"text": "tobe", "usage": {"total_tokens": 700}}

    with _wsgi_client(app) as http:
        replies = _three_answers(lambda: http.post("/v1/chat"))
    _charged_700_twice(replies, limiter.peek(TOKENS, "ip:203.0.113.7").remaining)


# --- Django (in process; real servers in test_django_servers.py) ------------------------------


def test_django_decorator_and_rule_charge_what_a_function_of_the_response_returns() -> None:
    from tests.support.django_project import configure

    configure()
    from django.http import HttpRequest, HttpResponse, JsonResponse
    from django.test import RequestFactory, override_settings

    from ratekeeper.django import RateLimitMiddleware, ratelimit
    from ratekeeper.django._settings import current

    def used(response: HttpResponse) -> int:
        return int(response["X-Tokens-Used"])

    @ratelimit(TOKENS, key="ip", cost=200, reported_cost=used)
    def chat(request: HttpRequest) -> HttpResponse:
        response = JsonResponse({"text": "tobe"})
        response["X-Tokens-Used"] = "700"
        return response

    def request() -> HttpRequest:
        made: HttpRequest = RequestFactory().post("/v1/chat", REMOTE_ADDR="203.0.113.7")
        return made

    with override_settings(RATEKEEPER={"STORAGE_URL": "memory://", "KEY_PREFIX": "rc"}):
        statuses = [chat(request()).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        assert current().limiter().peek(TOKENS, "ip:203.0.113.7").remaining == 0

    # The same from the settings' RULES, the middleware reading request.ratekeeper_cost.
    def view(request: HttpRequest) -> HttpResponse:
        request.ratekeeper_cost = 700  # type: ignore[attr-defined]
        return HttpResponse(b"tobe")

    rules = [{"path": "/v1/*", "policy": TOKENS, "cost": 200, "reported_cost": True}]
    settings = {"STORAGE_URL": "memory://", "KEY_PREFIX": "rc2", "KEY": "ip", "RULES": rules}
    with override_settings(RATEKEEPER=settings):
        middleware = RateLimitMiddleware(view)
        statuses = [middleware(request()).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        assert current().limiter().peek(TOKENS, "ip:203.0.113.7").remaining == 0
