"""Every ```python block of README.md and docs/**/*.md runs here (issue #32), so the pages cannot
drift from the code.

Each block is one test, named ``page:line`` (the line of its opening fence), and is executed with
``exec`` in a fresh namespace (top-level ``await`` allowed), its line numbers those of the page.
Before it runs:

* every Redis URL in it is replaced: a plain ``redis://...`` by a database of its own
  (``DOCS_DB``, flushed before each block) on the suite's first shared server, with patient
  timeouts so that a loaded machine cannot degrade an exact count; a ``...+cluster://`` URL by
  the shared cluster's (``cluster`` fixture: so ``rediss+cluster://user:secret@...`` loses its TLS
  and its credentials here), and a ``...+sentinel://`` URL by the shared Sentinel group's;
* the names a fragment takes from its page (an ``app``, a ``limiter``, your own functions such as
  ``claims``) are given by its ``Case`` below, which also checks what the block built or printed.

Markers, HTML comments right above a fence (invisible on the site; keep them rare):

* ``<!-- continues -->``: the block runs in the namespace the previous block of the page left;
* ``<!-- setup: code -->``: ``code`` runs first, in the block's namespace (URLs replaced alike);
* ``<!-- not run: reason -->``: the block is not run; ``NOT_RUN`` must list it with its reason.

Django blocks (settings, views, DRF) run in a child process of their own (``django_child``),
which configures Django from the settings the block assigns, then runs the rest of it. Every
block must match exactly one ``Case`` and every ``Case`` one block, so a new block fails here until
it has a check.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import io
import json
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from ratekeeper import AsyncLimiter, Limiter, Policy

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: The database of the shared server the blocks use (the other tests use database 0).
DOCS_DB = 11
#: Client seconds for the blocks' limiters on the test server (the default is 20 ms).
PATIENT = "socket_timeout=5&socket_connect_timeout=5"
#: Blocks that cannot run here, with the reason: must equal the ``<!-- not run -->`` markers.
NOT_RUN: dict[str, str] = {}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*$")
_URL = re.compile(r"\b(?:redis|rediss|valkey|valkeys)(?P<kind>\+cluster|\+sentinel)?://[^\s\"']*")
#: The peer address of every test request.
PEER = "203.0.113.7"


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence
    code: str
    markers: tuple[str, ...]  # the comments right above the fence, in order

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def marker(self, name: str) -> str | None:
        """The text after ``name:`` of the marker ``name``, "" for a bare one, None if absent."""
        for text in self.markers:
            head, colon, rest = text.partition(":")
            if head.strip() == name:
                return rest.strip() if colon else ""
        return None


def _markers_above(lines: list[str], fence: int) -> tuple[str, ...]:
    """The HTML comments right above line index ``fence`` (blank lines between allowed)."""
    text = "\n".join(lines[:fence]).rstrip()
    found: list[str] = []
    while text.endswith("-->") and (start := text.rfind("<!--")) >= 0:
        found.append(textwrap.dedent(text[start + 4 : -3]).strip())
        text = text[:start].rstrip()
    return tuple(reversed(found))


def extract(path: Path) -> list[Block]:
    """The ```python blocks of one page, in order (an indented block is dedented)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        end = index + 1
        while lines[end].strip() != "```":
            end += 1
        code = textwrap.dedent("\n".join(lines[index + 1 : end]))
        page = path.relative_to(ROOT).as_posix()
        blocks.append(Block(page, index + 1, code, _markers_above(lines, index)))
        index = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in extract(page)]


# --- what a block runs against ---------------------------------------------------------------


@dataclass
class Env:
    """What a case's ``given`` and ``check`` see: the URLs, and what the block printed."""

    request: pytest.FixtureRequest
    redis_url: str
    printed: io.StringIO = field(default_factory=io.StringIO)
    _cache: dict[str, str] = field(default_factory=dict)

    def url_for(self, kind: str | None) -> str:
        if kind is None:
            return self.redis_url
        if kind not in self._cache:
            fixture = "cluster" if kind == "+cluster" else "sentinel_group"
            self._cache[kind] = self.request.getfixturevalue(fixture).url
        return self._cache[kind]

    def substitute(self, code: str) -> str:
        return _URL.sub(lambda m: self.url_for(m["kind"]), code)

    def limiter(self) -> Limiter:
        return Limiter.from_url(self.redis_url)

    def async_limiter(self) -> AsyncLimiter:
        return AsyncLimiter.from_url(self.redis_url)


def run_block(code: str, block: Block, ns: dict[str, Any], env: Env) -> None:
    """Run ``code`` (the block's, or its setup) in ``ns``, with the page's line numbers."""
    source = "\n" * block.line + env.substitute(code)
    compiled = compile(source, block.page, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    with contextlib.redirect_stdout(env.printed):
        result = eval(compiled, ns)
        if inspect.iscoroutine(result):
            asyncio.run(result)


# --- the cases: what each block is given and what is checked ----------------------------------

Namespace = dict[str, Any]


@dataclass(frozen=True)
class Case:
    page: str
    contains: str  # a piece of the block's code that tells it from the page's other blocks
    check: Callable[[Namespace, Env], None]
    given: Callable[[Env], Namespace] = lambda env: {}
    #: The code to run, from the block's (the whole block by default).
    part: Callable[[str], str] = lambda code: code
    #: Run in a child process (Django): the name of its check in ``DJANGO_CHECKS``.
    django: str | None = None
    ignore: tuple[str, ...] = ()  # warning messages (regexes) the block may raise


def from_ratekeeper(code: str) -> str:
    """A migration block shows the other library, then ours from its ``# ratekeeper`` line: the
    other library's part is only compiled (it is not installed here), ours runs."""
    compile(code, "<migration>", "exec")
    return code[code.index("# ratekeeper") :]


def remaining(limiter: Limiter, policy: Policy, identity: str) -> int:
    """How many units ``identity`` has left under ``policy`` (a peek: nothing consumed)."""
    decision = limiter.peek(policy, identity)
    assert not decision.degraded, decision
    return decision.remaining if decision.allowed else 0


def asgi_calls(
    app: Any, calls: list[tuple[str, str, dict[str, str]]], *, peer: str = PEER
) -> list[httpx.Response]:
    """Send ``calls`` (method, path, headers; a POST with the body ``{}``) through ``app`` in
    process, one event loop, then close the AsyncLimiters its middleware holds on that loop."""

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=(peer, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            responses = [
                await http.request(
                    method, path, headers=headers, json={} if method == "POST" else None
                )
                for method, path, headers in calls
            ]
        for middleware in getattr(app, "user_middleware", []):
            limiter = middleware.kwargs.get("limiter")
            if isinstance(limiter, AsyncLimiter):
                await limiter.close()
        return responses

    return asyncio.run(main())


def gets(path: str, count: int, **headers: str) -> list[tuple[str, str, dict[str, str]]]:
    return [("GET", path, headers)] * count


def flask_statuses(app: Any, method: str, path: str, count: int) -> list[int]:
    client = app.test_client()
    return [
        client.open(path, method=method, environ_base={"REMOTE_ADDR": PEER}).status_code
        for _ in range(count)
    ]


def denied_at(statuses: list[int], at: int) -> None:
    """Requests ``1..at-1`` were admitted (whatever the placeholder view then did), ``at`` was
    refused: a page's ``def view(): ...`` returns None, which the framework answers with a 500."""
    assert 429 not in statuses[: at - 1], statuses
    assert statuses[at - 1] == 429, statuses


def starlette_app(env: Env) -> Namespace:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def ok(request: Any) -> JSONResponse:
        return JSONResponse({"ok": True})

    routes = [Route(path, ok) for path in ("/", "/search", "/health")]
    return {"app": Starlette(routes=routes)}


def flask_app(env: Env) -> Namespace:
    from flask import Flask

    app = Flask("docs")

    @app.post("/login")
    def login() -> tuple[str, int]:
        return "wrong password", 401

    @app.get("/ping")
    def ping() -> str:
        return "pong"

    return {"app": app, "limiter": env.limiter(), "Policy": Policy}


# README.md


def check_readme_code(ns: Namespace, env: Env) -> None:
    decision = ns["decision"]
    assert decision.allowed, decision
    assert env.printed.getvalue().startswith("10 9 "), env.printed.getvalue()  # the tightest
    assert remaining(ns["limiter"], ns["api"], "partner-api") == 9  # wait() was admitted


def check_readme_flask(ns: Namespace, env: Env) -> None:
    denied_at(flask_statuses(ns["app"], "GET", "/export", 3), 3)  # 2/minute
    response = ns["app"].test_client().get("/health", environ_base={"REMOTE_ADDR": PEER})
    assert response.status_code == 404, response  # exempt: not limited, and no such route
    assert "RateLimit" not in response.headers


def check_readme_fastapi(ns: Namespace, env: Env) -> None:
    app = ns["app"]

    @app.get("/search")
    async def search() -> dict[str, bool]:
        return {"ok": True}

    responses = asgi_calls(app, [*gets("/search", 11), ("POST", "/search", {})])
    assert [r.status_code for r in responses[:10]] == [200] * 10
    assert responses[10].status_code == 429  # the search rule, 10/minute, GET only
    assert responses[10].headers["retry-after"]
    assert responses[11].status_code == 405  # POST: the default policy admitted it


# docs/


def check_api(ns: Namespace, env: Env) -> None:
    decision = ns["decision"]
    assert decision.allowed, decision
    assert (decision.limit, decision.remaining) == (5, 3), decision  # cost=2


def check_choosing(ns: Namespace, env: Env) -> None:
    limiter, jobs = ns["limiter"], ns["jobs"]
    assert ns["lease"].allowed
    held = [limiter.acquire(jobs, "tenant-7") for _ in range(6)]  # the first was released
    assert [lease.allowed for lease in held] == [True] * 5 + [False]
    for lease in held:
        lease.release()
    assert ns["search"].algorithm == "gcra"
    assert ns["daily"].algorithm == "sliding_window"


def check_cluster(ns: Namespace, env: Env) -> None:
    policy = Policy("docs-cluster", "2/minute")
    assert [ns["limiter"].hit(policy, "a").allowed for _ in range(3)] == [True, True, False]

    async def hits() -> list[bool]:
        async with ns["alimiter"] as limiter:
            return [(await limiter.hit(policy, "b")).allowed for _ in range(3)]

    assert asyncio.run(hits()) == [True, True, False]


def check_sentinel(ns: Namespace, env: Env) -> None:
    policy = Policy("docs-sentinel", "2/minute")
    assert [ns["limiter"].hit(policy, "a").allowed for _ in range(3)] == [True, True, False]


def check_index(ns: Namespace, env: Env) -> None:
    assert ns["decision"].allowed, ns["decision"]
    assert ns["decision"].remaining == 9, ns["decision"]
    assert env.printed.getvalue() == ""  # admitted: nothing printed


def outbound_given(env: Env) -> Namespace:
    return {"limiter": env.limiter(), "Policy": Policy}


def check_httpx(ns: Namespace, env: Env) -> None:
    upstream = env.request.getfixturevalue("upstream")
    with ns["client"] as client:
        statuses = [client.get(upstream.url).status_code for _ in range(10)]
    assert statuses == [200] * 10
    assert sum(upstream.received.values()) == 10
    host = httpx.URL(upstream.url).host
    assert remaining(ns["limiter"], Policy("github", "10/second"), host) == 0


def check_httpx_cost(ns: Namespace, env: Env) -> None:
    used = ns["used"]
    assert used(httpx.Response(200, json={"usage": {"total_tokens": 700}})) == 700
    assert used(httpx.Response(503)) == 0
    ns["llm"].close()


def check_celery(ns: Namespace, env: Env) -> None:
    monkeypatch = env.request.getfixturevalue("monkeypatch")
    sent: list[str] = []

    def get(url: str) -> httpx.Response:  # the partner is not on loopback
        sent.append(url)
        return httpx.Response(200)

    monkeypatch.setattr(httpx, "get", get)
    assert ns["call_partner"].apply(args=(7,)).get() == 200
    assert sent == ["https://partner.example/items/7"]
    assert remaining(ns["limiter"], ns["partner"], "partner") == 4


def per_request_given(env: Env) -> Namespace:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from ratekeeper.asgi import RateLimitMiddleware, Rule
    from ratekeeper.identity import client_ip

    async def handler(request: Any) -> JSONResponse:
        await namespace["endpoint"](request)
        return JSONResponse([d.policy for d in request.state.ratekeeper])

    namespace: Namespace = {
        "Policy": Policy,
        "RateLimitMiddleware": RateLimitMiddleware,
        "Rule": Rule,
        "client_ip": client_ip,
        "limiter": env.async_limiter(),
        "app": Starlette(routes=[Route("/api/items", handler, methods=["GET", "POST"])]),
        "claims": lambda request: {"plan": request.headers.get("x-plan")},
    }

    async def verify_token(request: Any) -> dict[str, str]:
        return {"sub": request.headers["authorization"]}

    namespace["verify_token"] = verify_token
    return namespace


def check_per_request(ns: Namespace, env: Env) -> None:
    free = {"authorization": "ann"}
    pro = {"authorization": "bob", "x-plan": "pro"}
    post = asgi_calls(ns["app"], [("POST", "/api/items", free), ("POST", "/api/items", pro)])
    assert [r.json() for r in post] == [["free", "app"], ["pro", "app"]]
    limiter = env.limiter()
    try:  # cost 5 for a POST on the plan's policy, 1 on the application's
        assert remaining(limiter, ns["FREE"], "user:ann") == 95
        assert remaining(limiter, ns["PRO"], "user:bob") == 4995
        assert remaining(limiter, Policy("app", "10000/hour"), "user:bob") == 9999
    finally:
        limiter.close()


def llm_given(env: Env) -> Namespace:
    from types import SimpleNamespace

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from ratekeeper.asgi import RateLimitMiddleware, Rule

    class Model:  # a model client whose reply costs 700 tokens
        async def stream(self, body: Any) -> Any:
            for text in ("Hello", " world"):
                yield SimpleNamespace(text=text, usage=SimpleNamespace(total_tokens=700))

    async def chat(request: Any) -> Any:
        return await namespace["chat"](request)

    namespace: Namespace = {
        "Policy": Policy,
        "StreamingResponse": StreamingResponse,
        "RateLimitMiddleware": RateLimitMiddleware,
        "Rule": Rule,
        "limiter": env.async_limiter(),
        "upstream": Model(),
        "api_key": lambda request: f"key:{request.headers['x-api-key']}",
        "estimate_tokens": lambda request: 200,
        "app": Starlette(routes=[Route("/v1/chat", chat, methods=["POST"])]),
    }
    return namespace


def check_llm(ns: Namespace, env: Env) -> None:
    (response,) = asgi_calls(ns["app"], [("POST", "/v1/chat", {"x-api-key": "k1"})])
    assert response.status_code == 200
    assert response.text == "Hello world"
    limiter = env.limiter()
    try:  # the estimate was 200; the handler reported 700
        assert remaining(limiter, ns["tokens"], "key:k1") == 100000 - 700
    finally:
        limiter.close()


def llm_budget_given(env: Env) -> Namespace:
    from ..support.llm_app import FakeModel  # streams one token per event, usage in the last

    return {"upstream": FakeModel()}


def _chat(key: str | None, content: str, **fields: Any) -> tuple[dict[str, str], Any]:
    headers = {} if key is None else {"x-api-key": key}
    return headers, {"messages": [{"role": "user", "content": content}], **fields}


def chat_calls(app: Any, calls: list[Any], limiter: AsyncLimiter) -> list[httpx.Response]:
    """POST each (headers, body) of ``calls`` to the gateway's chat route, one event loop
    (a callable among them is called there, between two requests), then close ``limiter``
    on it."""

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=(PEER, 40000))
        responses = []
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            for call in calls:
                if callable(call):
                    call()
                    continue
                headers, body = call
                responses.append(
                    await http.post("/v1/chat/completions", headers=headers, json=body)
                )
        await limiter.close()
        return responses

    return asyncio.run(main())


def gateway_identity(ns: Namespace, key: str) -> str:
    from ratekeeper.asgi import request_from_scope

    return ns["api_key"](request_from_scope({"headers": [(b"x-api-key", key.encode())]}))


def check_llm_gateway(ns: Namespace, env: Env) -> None:
    streamed, answered, keyless, greedy = chat_calls(
        ns["app"],
        [
            _chat("k1", "word" * 50, stream=True, completion_tokens=30),  # 50 + 30 tokens
            _chat("k1", "hi" * 20, completion_tokens=7),  # 10 + 7, as JSON
            _chat(None, "hi", completion_tokens=7),
            _chat("k1", "hi", max_tokens=5000, completion_tokens=7),
        ],
        ns["limiter"],
    )
    assert streamed.status_code == 200, streamed.text
    assert streamed.text.count("tok ") == 30
    assert '"total_tokens": 80' in streamed.text
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["total_tokens"] == 17
    assert keyless.status_code == 400  # missing_identity="reject"
    assert greedy.status_code == 400  # max_tokens above MAX_TOKENS
    limiter = env.limiter()
    try:  # reserved prompt + 4096 each, settled to 80 and 17; two requests
        key = gateway_identity(ns, "k1")
        assert remaining(limiter, ns["TOKENS"], key) == 100000 - 80 - 17
        assert remaining(limiter, ns["REQUESTS"], key) == 60 - 2
    finally:
        limiter.close()


def check_llm_estimating(ns: Namespace, env: Env) -> None:
    limiter = env.limiter()
    key = gateway_identity(ns, "k2")
    try:
        held = [limiter.acquire(ns["IN_FLIGHT"], key) for _ in range(4)]
        assert all(lease.allowed for lease in held)
        call = _chat("k2", "word" * 40, stream=True, completion_tokens=650)  # estimate 540
        reserved: list[int] = []

        def release_one() -> None:
            reserved.append(remaining(limiter, ns["TOKENS"], key))
            held[0].release()

        capped, streamed = chat_calls(ns["estimating"], [call, release_one, call], ns["limiter"])
        assert capped.status_code == 429, capped.text  # 4 in flight already
        assert capped.json() == {"error": "too many requests in flight"}
        assert reserved == [100000]  # refused before anything was reserved
        assert streamed.status_code == 200, streamed.text
        assert remaining(limiter, ns["TOKENS"], key) == 100000 - 690  # settled past the estimate
        for lease in held:
            lease.release()
    finally:
        limiter.close()


def llm_client_given(env: Env) -> Namespace:
    monkeypatch = env.request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")

    def api(request: httpx.Request) -> httpx.Response:  # the model's API, streaming
        assert request.headers["authorization"] == "Bearer sk-test"
        body = json.loads(request.content)
        assert body["stream"] is True
        if body["messages"][0]["content"] == "busy":
            return httpx.Response(429, json={"error": "slow down"})
        events = [
            {"choices": [{"delta": {"content": "Hello"}}]},
            {"choices": [{"delta": {"content": " there"}}]},
            {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2,
                                      "total_tokens": 32}},
        ]  # fmt: skip
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, content=sse.encode())

    monkeypatch.setattr(httpx, "AsyncHTTPTransport", lambda: httpx.MockTransport(api))
    return {}


def check_llm_client(ns: Namespace, env: Env) -> None:
    async def main() -> str:
        text = await ns["complete"]([{"role": "user", "content": "word" * 30}], max_tokens=64)
        with pytest.raises(httpx.HTTPStatusError):
            await ns["complete"]([{"role": "user", "content": "busy"}])
        await ns["llm"].aclose()
        await ns["limiter"].close()
        return text

    assert asyncio.run(main()) == "Hello there"
    limiter = env.limiter()
    try:  # reserved 30 + 64, settled to 32; the refused call's reservation cancelled
        assert remaining(limiter, ns["TOKENS"], "openai") == 200000 - 32
        assert remaining(limiter, ns["REQUESTS"], "api.openai.com") == 500 - 2
    finally:
        limiter.close()


def check_proxies_key(ns: Namespace, env: Env) -> None:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from ratekeeper.asgi import RateLimitMiddleware

    async def echo(request: Any) -> JSONResponse:
        return JSONResponse(request.state.ratekeeper[0].policy)

    app = Starlette(routes=[Route("/", echo)])
    policy = Policy("docs-proxies", "1/minute")
    app.add_middleware(
        RateLimitMiddleware, limiter=env.async_limiter(), policy=policy, key=ns["key"]
    )
    forged = {"x-forwarded-for": "198.51.100.1"}
    # From a trusted proxy, the forwarded address is the client: each one its own budget.
    assert [r.status_code for r in asgi_calls(app, gets("/", 2, **forged), peer="10.1.2.3")] == [
        200,
        429,
    ]
    # From anyone else, the header is ignored: the peer is the client.
    other = {"x-forwarded-for": "198.51.100.2"}
    calls = gets("/", 1, **forged) + gets("/", 1, **other)
    assert [r.status_code for r in asgi_calls(app, calls, peer="192.0.2.9")] == [200, 429]


def check_worker(ns: Namespace, env: Env) -> None:
    worker = ns["NoProxyHeadersWorker"]
    assert issubclass(worker, ns["UvicornWorker"])
    assert worker.CONFIG_KWARGS["proxy_headers"] is False
    assert worker.CONFIG_KWARGS["loop"] == ns["UvicornWorker"].CONFIG_KWARGS["loop"]


def reservations_given(env: Env) -> Namespace:
    from types import SimpleNamespace

    return {
        "limiter": env.limiter(),
        "Policy": Policy,
        "api_key": "key:k1",
        "estimate": 200,
        "prompt": "Hello",
        "call_the_model": lambda prompt: SimpleNamespace(usage=SimpleNamespace(total_tokens=700)),
    }


def check_reservations(ns: Namespace, env: Env) -> None:
    assert ns["r"].allowed
    # 700 settled for the first; the second kept its estimate of 200.
    assert remaining(ns["limiter"], ns["tokens"], "key:k1") == 100000 - 700 - 200


def check_testing(ns: Namespace, env: Env) -> None:
    ns["store"].down = False
    assert ns["limiter"].hit(Policy("api", "10/minute"), "alice").reason is None


def check_waiting(ns: Namespace, env: Env) -> None:
    assert ns["decision"].allowed, ns["decision"]
    assert ns["decision"].remaining == 4, ns["decision"]
    assert ns["RateLimited"].__name__ == "RateLimited"


def check_decorators(ns: Namespace, env: Env) -> None:
    ns["send"]("alice", "hi")
    ns["fetch"]("acme", "/items")
    assert remaining(ns["limiter"], Policy("send", "10/minute"), "alice") == 9
    assert remaining(ns["limiter"], ns["partner"], "acme") == 4


def web_given(env: Env) -> Namespace:
    return starlette_app(env)


def check_web(ns: Namespace, env: Env) -> None:
    calls = [
        *gets("/search", 11, **{"x-api-key": "k-3f9a61c2"}),
        ("GET", "/search", {"x-api-key": "k-unknown"}),
        ("GET", "/health", {"x-api-key": "k-3f9a61c2"}),
    ]
    responses = asgi_calls(ns["app"], calls)
    assert [r.status_code for r in responses] == [200] * 10 + [429, 200, 200]
    assert "ratelimit" in responses[0].headers  # the known key's own budget ...
    assert (
        responses[11].headers["ratelimit"] != responses[10].headers["ratelimit"]
    )  # ... not the ip's
    assert "ratelimit" not in responses[12].headers  # exempt


def fastapi_given(env: Env) -> Namespace:
    from fastapi import FastAPI

    from ratekeeper import Decision

    return {
        "app": FastAPI(),
        "async_limiter": env.async_limiter(),
        "Policy": Policy,
        "Decision": Decision,
    }


def check_fastapi_dependency(ns: Namespace, env: Env) -> None:
    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=ns["app"], client=(PEER, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            responses = [await http.get("/search") for _ in range(11)]
        await ns["async_limiter"].close()
        return responses

    responses = asyncio.run(main())
    assert [r.json() for r in responses[:10]] == [{"remaining": n} for n in range(9, -1, -1)]
    assert responses[10].status_code == 429
    assert responses[10].headers["retry-after"]


def check_web_flask(ns: Namespace, env: Env) -> None:
    denied_at(flask_statuses(ns["app"], "GET", "/export", 3), 3)


def check_migration_flask(ns: Namespace, env: Env) -> None:
    denied_at(flask_statuses(ns["app"], "GET", "/slow", 2), 2)  # 1 per day


def check_migration_middleware(ns: Namespace, env: Env) -> None:
    statuses = flask_statuses(ns["app"], "POST", "/login", 6)
    assert statuses == [401] * 5 + [429]  # failed logins count, 5 per 15 minutes
    assert flask_statuses(ns["app"], "GET", "/ping", 1) == [200]  # exempt


def check_migration_fastapi(ns: Namespace, env: Env) -> None:
    app = ns["app"]
    responses = asgi_calls(app, gets("/home", 6))
    denied_at([r.status_code for r in responses], 6)
    asyncio.run(ns["limiter"].close())


def check_in_child(ns: Namespace, env: Env) -> None:
    """The child process asserted what it checks; its last line says what it saw."""
    assert ns["child says"] == "ok", ns["child says"]


CASES = [
    Case("README.md", 'limiter.wait(api, "partner-api"', check_readme_code),
    Case("README.md", "from flask import Flask", check_readme_flask),
    Case("README.md", "from fastapi import FastAPI", check_readme_fastapi),
    Case("README.md", "# settings.py", check_in_child, django="settings"),
    Case("docs/api.md", "async with AsyncLimiter", check_api, lambda env: {"user_id": "u1"}),
    Case("docs/choosing-an-algorithm.md", "limiter.acquire(jobs", check_choosing),
    Case("docs/cluster.md", "redis+cluster://", check_cluster),
    Case("docs/cluster.md", "redis+sentinel://", check_sentinel),
    Case("docs/django.md", "# settings.py", check_in_child, django="settings"),
    Case("docs/django.md", "REST_FRAMEWORK", check_in_child, django="drf"),
    Case("docs/index.md", "limiter.hit(api", check_index),
    Case(
        "docs/migration.md",
        "django_ratelimit",
        check_in_child,
        part=from_ratekeeper,
        django="migration",
    ),
    Case(
        "docs/migration.md",
        "Flask-Limiter",
        check_migration_flask,
        flask_app,
        part=from_ratekeeper,
    ),
    Case("docs/migration.md", "app.wsgi_app = RateLimitMiddleware(", check_migration_middleware),
    Case(
        "docs/migration.md",
        "# slowapi",
        check_migration_fastapi,
        lambda env: {"app": fastapi_given(env)["app"]},
        part=from_ratekeeper,
    ),
    Case("docs/outbound.md", "client = httpx.Client(", check_httpx, outbound_given),
    Case("docs/outbound.md", "actual_cost=used", check_httpx_cost),
    Case("docs/outbound.md", "from celery import Celery", check_celery),
    Case("docs/llm-budget.md", "class ReadBody", check_llm_gateway, llm_budget_given),
    Case(
        "docs/llm-budget.md",
        "class InFlight",
        check_llm_estimating,
        lambda env: {"limiter": env.async_limiter()},
    ),
    Case("docs/llm-budget.md", "async def complete(", check_llm_client, llm_client_given),
    Case("docs/per-request.md", "def plan(request)", check_per_request, per_request_given),
    Case("docs/per-request.md", "async def chat(", check_llm, llm_given),
    Case("docs/proxies.md", "request_view", check_in_child, django="proxies"),
    Case(
        "docs/proxies.md",
        "key=client_ip(",
        check_proxies_key,
        lambda env: {"client_ip": __import__("ratekeeper.identity").identity.client_ip},
    ),
    Case(
        "docs/proxies.md",
        "NoProxyHeadersWorker",
        check_worker,
        ignore=(r"The `uvicorn\.workers` module is deprecated",),
    ),
    Case("docs/reservations.md", "limiter.reserve(", check_reservations, reservations_given),
    Case("docs/testing.md", "FlakyStorage", check_testing),
    Case("docs/waiting.md", "decision = limiter.wait(", check_waiting),
    Case("docs/waiting.md", "from ratekeeper.decorators import limit", check_decorators),
    Case("docs/web.md", "def api_key_or_ip", check_web, web_given),
    Case("docs/web.md", "fastapi_dependency", check_fastapi_dependency, fastapi_given),
    Case(
        "docs/web.md",
        "from ratekeeper.wsgi import flask_limit",
        check_web_flask,
        flask_app,
    ),
]


def case_of(block: Block) -> Case:
    found = [c for c in CASES if c.page == block.page and c.contains in block.code]
    assert len(found) == 1, (
        f"{block.id}: {len(found)} cases match this block; give it exactly one Case in "
        f"{Path(__file__).name} (what it is given, and what to check)"
    )
    return found[0]


def test_the_pages_have_the_blocks_we_know() -> None:
    """Every case matches one block (none is stale), the not-run markers are the listed ones."""
    assert len(BLOCKS) >= 29
    for case in CASES:
        matching = [b.id for b in BLOCKS if b.page == case.page and case.contains in b.code]
        assert len(matching) == 1, (case.page, case.contains, matching)
    marked = {b.id: b.marker("not run") for b in BLOCKS if b.marker("not run") is not None}
    assert marked == NOT_RUN
    for block in BLOCKS:
        known = ("continues", "setup", "not run")
        for text in block.markers:
            assert text.partition(":")[0].strip() in known, (block.id, text)


def test_marker_parsing() -> None:
    lines = ["text", "<!-- setup: x = 1", "y = 2 -->", "", "<!-- continues -->", "```python"]
    block = Block("p.md", 6, "", _markers_above(lines, 5))
    assert block.marker("continues") == ""
    assert block.marker("setup") == "x = 1\ny = 2"
    assert block.marker("not run") is None
    assert _markers_above(["<!-- a -->", "prose", "```python"], 2) == ()


# --- running them ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def namespaces() -> dict[str, Namespace]:
    """The namespace each page's last block left, for a block that continues it."""
    return {}


@pytest.fixture
def env(request: pytest.FixtureRequest, servers: dict[str, Any]) -> Env:
    server = next(iter(servers.values()))
    with server.client(db=DOCS_DB) as admin:
        admin.flushdb()
    url = f"{server.url.rsplit('/', 1)[0]}/{DOCS_DB}?{PATIENT}"
    return Env(request, url)


def _close_limiters(ns: Namespace) -> None:
    for value in ns.values():
        if isinstance(value, Limiter):
            value.close()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block(block: Block, env: Env, namespaces: dict[str, Namespace]) -> None:
    if block.id in NOT_RUN:
        pytest.skip(f"<!-- not run: {NOT_RUN[block.id]} -->")
    case = case_of(block)
    code = case.part(block.code)
    if case.django is not None:
        ns = {"child says": run_django_child(block, code, case.django, env)}
        case.check(ns, env)
        return
    if block.marker("continues") is not None:
        assert block.page in namespaces, f"{block.id} continues a block that did not run"
        ns = namespaces[block.page]
        ns.update(case.given(env))
    else:  # the names given are the namespace (the given functions may look names up in it)
        ns = case.given(env)
        ns.setdefault("__name__", "docs_block")
    setup = block.marker("setup")
    with warnings.catch_warnings():
        for message in case.ignore:
            warnings.filterwarnings("ignore", message=message)
        if setup:
            run_block(setup, block, ns, env)
        run_block(code, block, ns, env)
    namespaces[block.page] = ns
    try:
        case.check(ns, env)
    finally:
        _close_limiters(ns)


# --- Django, in a child process ---------------------------------------------------------------


def run_django_child(block: Block, code: str, check: str, env: Env) -> str:
    job = {"page": block.page, "line": block.line, "code": env.substitute(code), "check": check}
    job["url"] = env.redis_url
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", f"from {__name__} import django_child as c; c()"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _settings_statement(node: ast.stmt) -> bool:
    """An import, or an assignment to UPPER_CASE names: what runs before Django is set up."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    return isinstance(node, ast.Assign) and all(
        isinstance(t, ast.Name) and t.id.isupper() for t in node.targets
    )


def _configure(ns: Namespace, url: str) -> None:
    """Django set up with the settings the block assigned (its ``...``: what a project has)."""
    import django
    from django.conf import settings

    def filled(names: list[Any], *mine: str) -> list[Any]:
        return [item for name in names for item in (mine if name is Ellipsis else (name,))]

    block = {name: value for name, value in ns.items() if name.isupper()}
    apps = filled(
        block.pop("INSTALLED_APPS", [...]), "django.contrib.contenttypes", "django.contrib.auth"
    )
    if "REST_FRAMEWORK" in block:
        apps.append("rest_framework")
    middleware = filled(
        block.pop("MIDDLEWARE", [...]),
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
    )
    ratekeeper = block.pop("RATEKEEPER", {"STORAGE_URL": url})
    settings.configure(
        DEBUG=False,
        SECRET_KEY="docs",
        ALLOWED_HOSTS=["testserver"],
        INSTALLED_APPS=apps,
        MIDDLEWARE=middleware,
        RATEKEEPER=ratekeeper,
        SESSION_ENGINE="django.contrib.sessions.backends.signed_cookies",
        ROOT_URLCONF="docs_urls",
        DATABASES={},
        USE_TZ=True,
        **block,
    )
    django.setup()


def _urls(patterns: dict[str, Callable[..., Any]]) -> None:
    import types

    from django.urls import path

    module = types.ModuleType("docs_urls")
    module.urlpatterns = [path(route, view) for route, view in patterns.items()]  # type: ignore[attr-defined]
    sys.modules["docs_urls"] = module


def _statuses(method: str, path: str, count: int, **extra: Any) -> list[int]:
    from django.test import Client

    client = Client(raise_request_exception=False, REMOTE_ADDR=PEER)
    send = getattr(client, method.lower())
    data = extra.pop("data", {})
    return [send(path, data, **extra).status_code for _ in range(count)]


def _check_settings(ns: Namespace) -> str:
    from django.core.management import call_command
    from django.http import HttpResponse

    _urls(
        {
            "reset/": ns["reset_password"],
            "login": lambda request: HttpResponse("wrong password", status=401),
        }
    )
    call_command("check", fail_level="WARNING", stdout=io.StringIO())  # ratekeeper.E001, W001
    denied_at(_statuses("POST", "/reset/", 6, data={"username": "ann"}), 6)  # 5/minute
    login = _statuses("POST", "/login", 6)
    assert login == [401] * 5 + [429], login  # the middleware's rule: failed logins count
    return "ok"


def _check_drf(ns: Namespace) -> str:
    from django.core.management import call_command

    _urls({"upload": ns["UploadView"].as_view()})
    call_command("check", fail_level="WARNING", stdout=io.StringIO())  # ratekeeper.E002
    statuses = _statuses("GET", "/upload", 51)
    assert statuses == [405] * 50 + [429], statuses  # throttled before dispatch; no get()
    return "ok"


def _check_migration(ns: Namespace) -> str:
    _urls({"login": ns["login"]})
    denied_at(_statuses("POST", "/login", 6), 6)  # 5/m
    return "ok"


def _check_proxies(ns: Namespace) -> str:
    from django.test import RequestFactory

    made = RequestFactory()
    forwarded = {"HTTP_FORWARDED": "for=198.51.100.7"}
    via_proxy = ns["client"](made.get("/", REMOTE_ADDR="10.0.0.5", **forwarded))
    direct = ns["client"](made.get("/", REMOTE_ADDR="192.0.2.9", **forwarded))
    assert "198.51.100.7" in str(via_proxy), via_proxy
    assert "192.0.2.9" in str(direct), direct
    return "ok"


DJANGO_CHECKS: dict[str, Callable[[Namespace], str]] = {
    "settings": _check_settings,
    "drf": _check_drf,
    "migration": _check_migration,
    "proxies": _check_proxies,
}


def django_child() -> None:
    """Run a Django block: its settings, then Django set up, then the rest, then its check."""
    job = json.load(sys.stdin)
    tree = ast.parse("\n" * job["line"] + job["code"], job["page"])
    ns: Namespace = {"__name__": "docs_block"}
    configured = False
    for node in tree.body:
        if not configured and not _settings_statement(node):
            _configure(ns, job["url"])
            configured = True
            from rest_framework.views import APIView

            ns.setdefault("APIView", APIView)
        exec(compile(ast.Module([node], []), job["page"], "exec"), ns)
    if not configured:
        _configure(ns, job["url"])
    print(DJANGO_CHECKS[job["check"]](ns))
