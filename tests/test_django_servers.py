"""Django on real servers: the test project (``tests/django_project``) under gunicorn with 2
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
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .processes import log_text, wait_until
from .servers import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
THREADS = 8

pytestmark = pytest.mark.usefixtures("binaries")


@dataclass(frozen=True)
class Reply:
    status: int
    headers: httpx.Headers
    body: bytes


@dataclass(frozen=True)
class Served:
    kind: str
    url: str
    worker_pids: frozenset[str]


def _command(kind: str, port: int) -> list[str]:
    if kind == "gunicorn":
        return [
            sys.executable, "-m", "gunicorn", "tests.django_project.wsgi:application",
            "--workers", "2", "--bind", f"127.0.0.1:{port}", "--graceful-timeout", "5",
        ]  # fmt: skip
    return [
        sys.executable, "-m", "uvicorn", "tests.django_project.asgi:application",
        "--workers", "2", "--host", "127.0.0.1", "--port", str(port), "--lifespan", "off",
    ]  # fmt: skip


def _health(http: httpx.Client) -> str | None:
    try:
        reply = http.get("/health")
    except httpx.TransportError:
        return None
    return reply.headers.get("x-worker-pid") if reply.status_code == 200 else None


@pytest.fixture(scope="module", params=["gunicorn", "uvicorn"])
def served(request: pytest.FixtureRequest, private_server: RedisServer) -> Iterator[Served]:
    """The test project under ``gunicorn --workers 2`` (WSGI) or ``uvicorn --workers 2``
    (ASGI), until both workers have answered."""
    kind = request.param
    port = free_port()
    env = {
        **os.environ,
        "RATEKEEPER_DJANGO_STORAGE_URL": private_server.url,
        "RATEKEEPER_DJANGO_KEY_PREFIX": f"dj-{kind}-{uuid.uuid4().hex[:8]}",
    }
    env.pop("WEB_CONCURRENCY", None)
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            _command(kind, port), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            pids: set[str] = set()
            limits = httpx.Limits(max_keepalive_connections=0)  # a new connection each time
            with httpx.Client(base_url=url, timeout=5, limits=limits) as http:

                def both_workers() -> bool:
                    pid = _health(http)
                    if pid is not None:
                        pids.add(pid)
                    return len(pids) >= 2

                wait_until(both_workers, proc, log, kind)
            yield Served(kind, url, frozenset(pids))
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            assert "Traceback" not in log_text(log), log_text(log)[-3000:]


def hammer(url: str, path: str, headers: dict[str, str], count: int) -> list[Reply]:
    """``count`` GETs from ``THREADS`` threads released at once, each on a new connection."""
    start = threading.Barrier(THREADS)

    def run(n: int) -> list[Reply]:
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=url, timeout=30, limits=limits) as http:
            start.wait(30)
            out = []
            for _ in range(n):
                r = http.get(path, headers=headers)
                out.append(Reply(r.status_code, r.headers, r.content))
            return out

    shares = [count // THREADS + (i < count % THREADS) for i in range(THREADS)]
    with ThreadPoolExecutor(THREADS) as pool:
        return [reply for replies in pool.map(run, shares) for reply in replies]


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
    check_exact(hammer(served.url, "/api/items", key, 40), "dj-api", 12, served)
    # Another identity has its own budget; the exempt path is never limited.
    other = {"X-API-Key": f"mw-{uuid.uuid4()}"}
    check_exact(hammer(served.url, "/api/items", other, 16), "dj-api", 12, served)
    health = hammer(served.url, "/health", key, 24)
    assert {r.status for r in health} == {200}
    assert not [r for r in health if "ratelimit" in r.headers]


@pytest.mark.parametrize(
    ("path", "policy", "limit"), [("/views/sync", "dj-sync", 7), ("/views/async", "dj-async", 9)]
)
def test_the_decorator_admits_exactly_the_limit(served: Served, path: str, policy: str, limit: int):
    key = {"X-API-Key": f"view-{uuid.uuid4()}"}
    replies = hammer(served.url, path, key, 32)
    check_exact(replies, policy, limit, served)
    # The view saw its decision in request.ratekeeper.
    assert {json.loads(r.body)["decisions"] for r in replies if r.status == 200} == {1}


def test_both_workers_serve_and_share_one_store(served: Served):
    pids = {r.headers["x-worker-pid"] for r in hammer(served.url, "/health", {}, 48)}
    assert pids == served.worker_pids
    assert len(pids) == 2


def test_the_served_settings_pass_the_system_check_and_memory_would_not(
    private_server: RedisServer,
):
    """``manage.py check`` on the settings the servers run (DEBUG off): clean on the shared
    Redis; the same project on memory:// gets the W001 warning (several workers would each
    admit the whole limit)."""
    command = [sys.executable, "-m", "django", "check", "--settings=tests.django_project.settings"]
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
