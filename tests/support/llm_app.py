"""The LLM token budget of docs/llm-budget.md (the page's code, typed, with the test's
numbers), as the app ``tests/http/test_llm_recipe.py`` serves under ``uvicorn --workers 2
--factory tests.support.llm_app:create_app``.

The gateway is the page's, with the test's numbers: per API key (``X-API-Key``) 10,000 tokens a
minute and 1,000,000 a day (``TOKENS``, one ``sliding_window`` policy with both rates) and 60
requests a minute (``REQUESTS``); ``max_tokens`` at most 400. Its model is :class:`FakeModel`,
which streams one token per event and reports the usage in the last one. The environment:

* ``RATEKEEPER_LLM_REDIS_URL``, ``RATEKEEPER_LLM_KEY_PREFIX``: the store, and a key prefix no
  other run uses;
* ``RATEKEEPER_LLM_MODE``: what a request reserves. ``max_tokens`` (the page's recommended
  default): its prompt and its ``max_tokens``; ``estimate+cap``: its prompt and a typical
  reply (``TYPICAL``), behind a cap of ``IN_FLIGHT`` requests in flight per key;
  ``estimate``: the same without the cap;
* ``RATEKEEPER_LLM_CLOCK_SHIFT``: seconds the limiter's clock is behind the real one, so that
  the test runs at the start of a minute window and no window ends during it (the test counts
  a minute's tokens exactly).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ratekeeper import AsyncLimiter, Policy
from ratekeeper.asgi import RateLimitMiddleware, Rule, request_from_scope
from ratekeeper.identity import header

from .web_apps import exact_options

ENV_URL = "RATEKEEPER_LLM_REDIS_URL"
ENV_PREFIX = "RATEKEEPER_LLM_KEY_PREFIX"
ENV_MODE = "RATEKEEPER_LLM_MODE"
ENV_SHIFT = "RATEKEEPER_LLM_CLOCK_SHIFT"
MODES = ("max_tokens", "estimate+cap", "estimate")

TOKENS = Policy("llm-tokens", "10000/minute;1000000/day", algorithm="sliding_window")
REQUESTS = Policy("llm-requests", "60/minute")
#: The most a request may ask for, and what it gets when it names no ``max_tokens``.
MAX_TOKENS = 400
#: A typical reply's tokens: the estimate of the modes that do not reserve ``max_tokens``.
TYPICAL = 100
#: ``estimate+cap``: requests in flight per key, at most (a lease times out after 5 minutes).
IN_FLIGHT = Policy("llm-in-flight", "4 per 5 minutes", algorithm="concurrency")
#: The fake model's pace: it yields the event loop after every token, and waits a millisecond
#: after every ``PACE`` tokens (a model takes time; so requests overlap).
PACE = 10

api_key = header("x-api-key")


def prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's tokens, estimated: 4 characters a token, rounded up."""
    chars = sum(len(message["content"]) for message in body["messages"])
    return -(-chars // 4)


def reserved(request: Any) -> int:
    """What a request reserves: its prompt, and the most it may generate (an upper bound)."""
    body = request.raw["state"]["llm"]
    return prompt_tokens(body) + body["max_tokens"]


def estimated(request: Any) -> int:
    """What a request reserves in the estimate modes: its prompt, and a typical reply."""
    body = request.raw["state"]["llm"]
    return prompt_tokens(body) + min(TYPICAL, body["max_tokens"])


class ReadBody:
    """Reads the JSON body before the limiter runs (the cost depends on it) into
    scope["state"]["llm"], then hands the same bytes on to the app."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body, more = body + message.get("body", b""), message.get("more_body", False)
        try:
            chat = json.loads(body)
            chat.setdefault("max_tokens", MAX_TOKENS)
            prompt_tokens(chat)
            valid = type(chat["max_tokens"]) is int and 1 <= chat["max_tokens"] <= MAX_TOKENS
        except (ValueError, TypeError, KeyError, AttributeError):
            valid = False
        if not valid:
            return await JSONResponse({"error": "not a chat request"}, 400)(scope, receive, send)
        scope.setdefault("state", {})["llm"] = chat
        unread = [{"type": "http.request", "body": body}]

        async def replay() -> Any:
            return unread.pop() if unread else await receive()

        return await self.app(scope, replay, send)


class InFlight:
    """At most the policy's limit of requests in flight per key, across every worker: a
    lease taken before anything is reserved, released once the response has ended."""

    def __init__(self, app: Any, *, limiter: AsyncLimiter, policy: Policy, key: Any) -> None:
        self.app, self.limiter, self.policy, self.key = app, limiter, policy, key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        identity = self.key(request_from_scope(scope)) if scope["type"] == "http" else None
        if identity is None:
            return await self.app(scope, receive, send)
        async with self.limiter.acquire(self.policy, identity) as lease:
            if not lease.allowed:
                refused = JSONResponse({"error": "too many requests in flight"}, 429)
                return await refused(scope, receive, send)
            return await self.app(scope, receive, send)


class FakeModel:
    """A model that answers ``completion_tokens`` tokens (the test's instruction, in the body;
    at most ``max_tokens``), streamed one per event in the OpenAI shape, the usage in the last
    event. Its prompt tokens are ``prompt_tokens`` exactly: the page's estimate is its
    tokenizer."""

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        prompt = prompt_tokens(body)
        completion = min(body["completion_tokens"], body["max_tokens"])
        for n in range(completion):
            yield {"choices": [{"delta": {"content": "tok "}}]}
            await asyncio.sleep(0.001 if n % PACE == PACE - 1 else 0)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion}
        yield {"choices": [], "usage": {**usage, "total_tokens": prompt + completion}}

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        events = [event async for event in self.stream(body)]
        text = "".join(e["choices"][0]["delta"]["content"] for e in events[:-1])
        message = {"role": "assistant", "content": text}
        return {"choices": [{"message": message}], "usage": events[-1]["usage"]}


def create_app(mode: str | None = None) -> Any:
    """The uvicorn factory: the page's gateway, reserving as ``mode`` (default: the
    environment's ``RATEKEEPER_LLM_MODE``, else ``max_tokens``) says."""
    mode = mode or os.environ.get(ENV_MODE, "max_tokens")
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE} must be one of {MODES}, got {mode!r}")
    url = os.environ[ENV_URL]
    shift = float(os.environ.get(ENV_SHIFT, "0"))
    options = exact_options(url, os.environ[ENV_PREFIX])
    if shift:
        options["clock"] = lambda: time.time() - shift
    limiter = AsyncLimiter.from_url(url, **options)
    upstream = FakeModel()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await limiter.close()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = request.state.llm
        if not body.get("stream"):
            reply = await upstream.complete(body)
            request.state.ratekeeper_cost = reply["usage"]["total_tokens"]
            return JSONResponse(reply)

        async def events() -> AsyncIterator[str]:
            used = prompt_tokens(body)  # the running total, in case the client leaves early
            async for event in upstream.stream(body):
                used = event["usage"]["total_tokens"] if event.get("usage") else used + 1
                request.state.ratekeeper_cost = used
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    cost = reserved if mode == "max_tokens" else estimated
    rule = Rule("/v1/chat/completions", TOKENS, methods={"POST"}, cost=cost, reported_cost=True)
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        key=api_key,
        missing_identity="reject",
        rules=[rule],
        application_policy=REQUESTS,
        exempt=["/health"],
    )
    app.add_middleware(ReadBody)
    if mode == "estimate+cap":
        app.add_middleware(InFlight, limiter=limiter, policy=IN_FLIGHT, key=api_key)
    return app
