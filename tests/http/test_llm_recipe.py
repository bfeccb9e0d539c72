"""docs/llm-budget.md, end to end: the page's LLM gateway (``tests.support.llm_app``) under
``uvicorn --workers 2`` on the suite's Redis, 64 streamed requests at once from 2 API keys.

Each request has a prompt of 100 to 300 tokens and asks its fake model for 50 to 400 tokens
(seeded; ``max_tokens`` 400): 32 requests a key ask for about 13,600 tokens of a 10,000 a minute
budget. A refused request is sent again each time one of its key's requests ends (a refund, a
lease released), until a round admits none with nothing in flight: the budget is spent.

The limiter's clock is shifted so that the test starts half a second into a minute window: no
window ends during it, so the store's count is exactly the minute's tokens. Per key it checks
that the store counted exactly the usage the admitted responses reported (through ``peek``, and
the count itself when over the limit, where ``remaining`` is 0), and that this is within the
page's bound for the mode: at most the limit when each request reserves its ``max_tokens``; at
most the limit + (requests in flight) x (actual - estimate) when it reserves an estimate, with 4
in flight at most behind the cap, and all 32 of the key's without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from ratekeeper import Limiter
from ratekeeper.asgi import request_from_scope

from ..support.http_servers import web_process
from ..support.llm_app import (
    ENV_MODE,
    ENV_PREFIX,
    ENV_SHIFT,
    ENV_URL,
    IN_FLIGHT,
    MAX_TOKENS,
    REQUESTS,
    TOKENS,
    TYPICAL,
    api_key,
)
from ..support.servers import RedisServer
from ..support.web_apps import exact_options

KEYS = ("team-a", "team-b")
PER_KEY = 32
LIMIT = 10_000
CHAT = "/v1/chat/completions"
#: Measured figures by mode and key, for a run with ``-s`` to print.
FIGURES: dict[str, dict[str, dict[str, int]]] = {}


@dataclass(frozen=True)
class Job:
    key: str
    prompt: int  # tokens: 4 characters each, the page's estimate exactly
    completion: int  # tokens the fake model answers

    @property
    def body(self) -> dict[str, Any]:
        message = {"role": "user", "content": "word" * self.prompt}
        return {
            "messages": [message],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "completion_tokens": self.completion,
        }

    def estimate(self, mode: str) -> int:
        return self.prompt + (MAX_TOKENS if mode == "max_tokens" else TYPICAL)


@dataclass
class Outcome:
    admitted: list[tuple[Job, int]] = field(default_factory=list)  # with its reported usage
    refused: list[Job] = field(default_factory=list)  # still refused when the budget was spent
    sent: int = 0


def the_jobs(seed: int = 32) -> list[Job]:
    rng = random.Random(seed)
    jobs = [
        Job(KEYS[i % len(KEYS)], rng.randint(100, 300), rng.randint(50, 400))
        for i in range(PER_KEY * len(KEYS))
    ]
    rng.shuffle(jobs)
    return jobs


async def send(http: httpx.AsyncClient, job: Job) -> tuple[int, int | None]:
    """POST one streamed chat: its status, and the usage its last event reported (read to
    ``[DONE]``)."""
    headers = {"x-api-key": job.key}
    async with http.stream("POST", CHAT, json=job.body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None
        usage, done = None, False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                usage = json.loads(line[6:]).get("usage") or usage
        assert done
        assert usage is not None
        assert usage["prompt_tokens"] == job.prompt
        return 200, usage["total_tokens"]


async def run_key(http: httpx.AsyncClient, jobs: list[Job]) -> Outcome:
    """Send ``jobs`` at once; send the refused ones again whenever one admitted ends."""
    out = Outcome()
    tasks = {asyncio.ensure_future(send(http, job)): job for job in jobs}
    out.sent = len(tasks)
    while tasks:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        ended = False
        for task in done:
            job = tasks.pop(task)
            status, usage = task.result()
            if status == 200:
                assert usage is not None
                out.admitted.append((job, usage))
                ended = True
            else:
                assert status == 429, status
                out.refused.append(job)
        if ended and out.refused:
            again, out.refused = out.refused, []
            tasks.update({asyncio.ensure_future(send(http, job)): job for job in again})
            out.sent += len(again)
    return out


async def drive(url: str, jobs: list[Job]) -> dict[str, Outcome]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:
        outcomes = await asyncio.gather(
            *(run_key(http, [job for job in jobs if job.key == key]) for key in KEYS)
        )
        # The JSON form: charged the usage.total_tokens of its body.
        reply = await http.post(
            CHAT,
            json={"messages": [{"role": "user", "content": "hi" * 200}], "completion_tokens": 77},
            headers={"x-api-key": "team-json"},
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"] == {
            "prompt_tokens": 100,
            "completion_tokens": 77,
            "total_tokens": 177,
        }
    return dict(zip(KEYS, outcomes, strict=True))


def identity(key: str) -> str:
    return api_key(request_from_scope({"headers": [(b"x-api-key", key.encode())]}))  # type: ignore[return-value]


@contextlib.contextmanager
def gateway(mode: str, server: RedisServer, shift: float, prefix: str) -> Iterator[str]:
    """``uvicorn --workers 2 --factory tests.support.llm_app:create_app`` in ``mode``."""
    env = {ENV_URL: server.url, ENV_PREFIX: prefix, ENV_MODE: mode, ENV_SHIFT: repr(shift)}

    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "uvicorn", "tests.support.llm_app:create_app", "--factory",
            "--workers", "2", "--host", "127.0.0.1", "--port", str(port), "--log-level", "info",
        ]  # fmt: skip

    with web_process(command, f"uvicorn ({mode})", env=env) as running:
        running.wait_until(
            lambda: running.output().count("Application startup complete.") >= 2,
            "uvicorn's 2 workers",
        )
        yield running.url
    assert running.returncode in (0, -signal.SIGTERM), running.output()[-3000:]


def stored(limiter: Limiter, server: RedisServer, key: str) -> tuple[int, int]:
    """The tokens the store counts for ``key`` in this minute and this day."""
    (name,) = limiter.keys(TOKENS, identity(key))
    with server.client() as admin:
        fields = {k.decode(): int(v) for k, v in admin.hgetall(name).items()}
    # The rates as the policy names them: a minute's window, then a day's.
    assert fields["w1"] % 60_000_000 == 0, fields
    assert fields["w2"] % 86_400_000_000 == 0, fields
    return fields["c1"], fields["c2"]


@pytest.mark.parametrize("mode", ["max_tokens", "estimate+cap", "estimate"])
def test_the_budget_holds_its_bound(mode: str, servers: dict[str, RedisServer]) -> None:
    server = next(iter(servers.values()))
    jobs = the_jobs()
    # The limiter's now is half a second into a minute window from here on.
    shift = time.time() % 60 - 0.5
    prefix = f"llm-{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    with gateway(mode, server, shift, prefix) as url:
        outcomes = asyncio.run(drive(url, jobs))
    options = exact_options(server.url, prefix)
    limiter = Limiter.from_url(server.url, **options, clock=lambda: time.time() - shift)
    try:
        figures = FIGURES.setdefault(mode, {})
        for key, out in outcomes.items():
            admitted = sum(usage for _, usage in out.admitted)
            assert admitted == sum(job.prompt + job.completion for job, _ in out.admitted)
            minute, day = stored(limiter, server, key)
            assert minute == day == admitted  # settled exactly to the reported usage
            decision = limiter.peek(TOKENS, identity(key))
            assert decision.limit == LIMIT
            assert decision.remaining == max(0, LIMIT - admitted)
            assert len(out.admitted) <= REQUESTS.rates[0].limit
            over = max(0, *(usage - job.estimate(mode) for job, usage in out.admitted))
            if mode == "max_tokens":
                assert over == 0  # the estimate is an upper bound of the actual
                in_flight = 0
            else:
                in_flight = IN_FLIGHT.rates[0].limit if mode == "estimate+cap" else PER_KEY
            bound = LIMIT + in_flight * over
            documented = LIMIT + in_flight * (MAX_TOKENS - TYPICAL)
            assert admitted <= bound <= documented, (key, admitted, bound)
            figures[key] = {
                "admitted": admitted,
                "requests": len(out.admitted),
                "refused": len(out.refused),
                "sent": out.sent,
                "bound": bound,
                "documented": documented,
            }
        assert sum(len(out.admitted) for out in outcomes.values()) > 0
        assert stored(limiter, server, "team-json") == (177, 177)
    finally:
        limiter.close()
    print(mode, json.dumps(figures), f"{time.monotonic() - started:.1f} s")  # shown with -s
