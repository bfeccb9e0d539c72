"""Django on real servers: the test project (``tests/support/django_project``) under gunicorn with 2
worker processes (WSGI) and under uvicorn with 2 worker processes (ASGI), both on one private
Redis/Valkey server that this module starts. Each server runs with its own key prefix.

On each: the middleware from ``settings.RATEKEEPER`` (12/minute on ``/api/*``), the decorator
on a sync view (7/minute) and on an async view (9/minute) admit exactly their limit to one
identity hammered from 8 threads, each request on a new connection, with every admission
seeing a different remaining count (atomic across both workers); the denials are the shared
problem+json 429 with the IETF RateLimit headers, answered before the view (no worker pid).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from ..support.http_servers import ROOT, Reply, hammer, web_process
from ..support.servers import RedisServer

pytestmark = pytest.mark.usefixtures("binaries")


@dataclass(frozen=True)
class Served:
    kind: str
    url: str
    worker_pids: frozenset[str]


def _command(kind: str, port: int) -> list[str]:
    if kind == "gunicorn":
        return [
            sys.executable, "-m", "gunicorn", "tests.support.django_project.wsgi:application",
            "--workers", "2", "--bind", f"127.0.0.1:{port}", "--graceful-timeout", "5",
        ]  # fmt: skip
    return [
        sys.executable, "-m", "uvicorn", "tests.support.django_project.asgi:application",
        "--workers", "2", "--host", "127.0.0.1", "--port", str(port), "--lifespan", "off",
    ]  # fmt: skip


@pytest.fixture(scope="module", params=["gunicorn", "uvicorn"])
def served(request: pytest.FixtureRequest, private_server: RedisServer) -> Iterator[Served]:
    """The test project under ``gunicorn --workers 2`` (WSGI) or ``uvicorn --workers 2``
    (ASGI), until both workers have answered."""
    kind = request.param
    env = {
        "RATEKEEPER_DJANGO_STORAGE_URL": private_server.url,
        "RATEKEEPER_DJANGO_KEY_PREFIX": f"dj-{kind}-{uuid.uuid4().hex[:8]}",
    }
    with web_process(lambda port: _command(kind, port), kind, env=env) as running:
        pids: set[str] = set()

        def both_workers() -> bool:
            try:  # a new connection each time, so that either worker may take it
                reply = httpx.get(f"{running.url}/health", timeout=5)
            except httpx.TransportError:
                return False
            if reply.status_code == 200:
                pids.add(reply.headers["x-worker-pid"])
            return len(pids) >= 2

        running.wait_until(both_workers, f"{kind}'s 2 workers")
        yield Served(kind, running.url, frozenset(pids))
    assert "Traceback" not in running.output(), running.output()[-3000:]


def check_exact(replies: list[Reply], policy: str, limit: int, served: Served) -> None:
    """Exactly ``limit`` admitted, each with its own remaining count; the rest the shared 429."""
    ok = [r for r in replies if r.status == 200]
    denied = [r for r in replies if r.status == 429]
    assert len(ok) == limit, sorted(r.status for r in replies)
    assert len(denied) == len(replies) - limit
    remaining = []
    for r in ok:
        assert r.headers["ratelimit-policy"] == f'"{policy}";q={limit};w=60'
        match = re.fullmatch(rf'"{policy}";r=(\d+);t=60', r.headers["ratelimit"])
        assert match is not None, r.headers["ratelimit"]
        remaining.append(int(match[1]))
        assert "retry-after" not in r.headers
        assert r.headers["x-worker-pid"] in served.worker_pids
    # Atomic across both workers: every admission saw a different count.
    assert sorted(remaining) == list(range(limit))
    for r in denied:
        assert r.headers["content-type"] == "application/problem+json"
        assert r.headers["ratelimit-policy"] == f'"{policy}";q={limit};w=60'
        assert re.fullmatch(rf'"{policy}";r=0;t=(60|59)', r.headers["ratelimit"])
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert "x-worker-pid" not in r.headers  # answered before the view
        problem = json.loads(r.body)
        assert problem["status"] == 429
        assert problem["title"] == "Too Many Requests"
        assert problem["policy"] == policy
        assert 0 < problem["retry_after"] <= 60


def test_the_middleware_from_settings_admits_exactly_the_limit(served: Served):
    key = {"X-API-Key": f"mw-{uuid.uuid4()}"}
    check_exact(hammer(served.url, "/api/items", [key] * 40), "dj-api", 12, served)
    # Another identity has its own budget; the exempt path is never limited.
    other = {"X-API-Key": f"mw-{uuid.uuid4()}"}
    check_exact(hammer(served.url, "/api/items", [other] * 16), "dj-api", 12, served)
    health = hammer(served.url, "/health", [key] * 24)
    assert {r.status for r in health} == {200}
    assert not [r for r in health if "ratelimit" in r.headers]


@pytest.mark.parametrize(
    ("path", "policy", "limit"), [("/views/sync", "dj-sync", 7), ("/views/async", "dj-async", 9)]
)
def test_the_decorator_admits_exactly_the_limit(served: Served, path: str, policy: str, limit: int):
    key = {"X-API-Key": f"view-{uuid.uuid4()}"}
    replies = hammer(served.url, path, [key] * 32)
    check_exact(replies, policy, limit, served)
    # The view saw its decision in request.ratekeeper.
    assert {json.loads(r.body)["decisions"] for r in replies if r.status == 200} == {1}


def test_failed_logins_in_parallel_reach_the_view_exactly_the_limit(served: Served):
    """The README's login rule (3 failed logins per 15 minutes, counted on 401): 30 wrong
    passwords at once, then 30 more: the view runs exactly 3 times (each of its runs is a
    401), every other attempt is refused before it. Each attempt reserves its cost until its
    status is known, so the attempts in flight count too."""
    user = {"X-API-Key": f"login-{uuid.uuid4()}"}
    first = hammer(served.url, "/login", [user] * 30)
    second = hammer(served.url, "/login", [user] * 30)
    statuses = sorted(r.status for r in [*first, *second])
    assert statuses == [401] * 3 + [429] * 57
    ran = [r for r in [*first, *second] if r.status == 401]
    assert {r.headers["x-worker-pid"] for r in ran} <= served.worker_pids
    for r in [*first, *second]:
        if r.status == 429:
            assert json.loads(r.body)["policy"] == "dj-login"
            assert "x-worker-pid" not in r.headers


@pytest.mark.parametrize("path", ["/tokens/sync", "/tokens/async"])
def test_a_streamed_answer_is_charged_the_tokens_it_reports(served: Served, path: str):
    """``@ratelimit(..., cost=200, reported_cost=True)`` on a view that streams its answer and
    sets ``request.ratekeeper_cost = 700`` after its last chunk, on 1,000 tokens a minute:
    charged 700, then 700 again (the estimate of 200 fits the 300 left), then refused with the
    wait for the overrun; under gunicorn (WSGI) and uvicorn (ASGI), sync and async bodies."""
    user = {"X-API-Key": f"tokens-{uuid.uuid4()}"}
    replies = []
    for _ in range(3):
        reply = httpx.get(f"{served.url}{path}", headers=user, timeout=10)
        replies.append(reply)
    assert [r.status_code for r in replies] == [200, 200, 429]
    assert [r.content for r in replies[:2]] == [b"tobeornot"] * 2
    # The headers leave before the body, so they show the estimate: 1,000 - 200, then the
    # 300 left after the first answer's 700, less the second's estimate.
    assert replies[0].headers["ratelimit"] == '"dj-tokens";r=800;t=60'
    assert replies[1].headers["ratelimit"].startswith('"dj-tokens";r=100;')
    problem = replies[2].json()
    assert problem["policy"] == "dj-tokens"
    assert 0 < problem["retry_after"] <= 60


def test_both_workers_serve_and_share_one_store(served: Served):
    pids = {r.headers["x-worker-pid"] for r in hammer(served.url, "/health", [{}] * 48)}
    assert pids == served.worker_pids
    assert len(pids) == 2


def test_the_served_settings_pass_the_system_check_and_memory_would_not(
    private_server: RedisServer,
):
    """``manage.py check`` on the settings the servers run (DEBUG off): clean on the shared
    Redis; the same project on memory:// gets the W001 warning (several workers would each
    admit the whole limit)."""
    command = [
        sys.executable,
        "-m",
        "django",
        "check",
        "--settings=tests.support.django_project.settings",
    ]
    for url, warned in ((private_server.url, False), ("memory://", True)):
        env = {**os.environ, "RATEKEEPER_DJANGO_STORAGE_URL": url}
        env.pop("RATEKEEPER_DJANGO_DEBUG", None)
        done = subprocess.run(
            [*command, "--fail-level", "WARNING"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert ("ratekeeper.W001" in done.stderr) is warned, done.stderr
        assert done.returncode == (1 if warned else 0), done.stderr
        if not warned:
            assert "System check identified no issues" in done.stdout
