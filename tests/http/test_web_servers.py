"""Real servers, real HTTP: uvicorn with two worker processes sharing one Redis/Valkey, and
``ratekeeper demo --serve``.

The uvicorn app is ``tests.support.web_apps:create_app`` (a Starlette API behind the ASGI
middleware);
it finds the store through an environment variable. All requests come from 127.0.0.1, so the
identities are API keys. Each client thread opens a new connection per request, so both workers
take part, which the ``X-Worker-Pid`` response header shows.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import websockets.exceptions
import websockets.sync.client

from ..support.http_servers import Reply, WebProcess, hammer, web_process
from ..support.servers import RedisServer, find_binaries
from ..support.web_apps import ENV_PREFIX, ENV_URL

FLAVORS = [binary.flavor for binary in find_binaries()]
API = "/api/items"


@dataclass(frozen=True)
class Served:
    url: str
    worker_pids: frozenset[str]
    key_prefix: str
    store_url: str


def _env(store_url: str) -> dict[str, str]:
    """The app factory's store, under a key prefix no other run uses."""
    return {ENV_URL: store_url, ENV_PREFIX: f"web-{uuid.uuid4().hex[:12]}"}


@contextlib.contextmanager
def uvicorn(factory: str, store_url: str, workers: int = 2) -> Iterator[tuple[Served, WebProcess]]:
    """``uvicorn --workers N --factory <factory>`` on ``store_url`` (see :func:`_env`), once
    every worker has started; its exit checked after it stops."""
    env = _env(store_url)

    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "uvicorn", factory, "--factory",
            "--workers", str(workers), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "info",
        ]  # fmt: skip

    with web_process(command, "uvicorn", env=env) as running:
        running.wait_until(
            lambda: running.output().count("Application startup complete.") >= workers,
            f"uvicorn's {workers} workers",
        )
        pids = frozenset(re.findall(r"Started server process \[(\d+)\]", running.output()))
        assert len(pids) == workers
        yield Served(running.url, pids, env[ENV_PREFIX], store_url), running
    assert running.returncode in (0, -signal.SIGTERM), running.output()[-3000:]


@pytest.fixture(scope="module", params=FLAVORS)
def served(request: pytest.FixtureRequest, servers: dict[str, RedisServer]) -> Iterator[Served]:
    """``uvicorn --workers 2 --factory tests.support.web_apps:create_app`` on this flavor's
    server."""
    with uvicorn("tests.support.web_apps:create_app", servers[request.param].url) as (served, _):
        yield served


def check_replies(replies: list[Reply], limit: int = 12, body: Any = None) -> None:
    """Exactly ``limit`` admissions, each with its own remaining count; the rest proper 429s."""
    ok = [r for r in replies if r.status == 200]
    denied = [r for r in replies if r.status == 429]
    assert len(ok) == limit, [r.status for r in replies]
    assert len(denied) == len(replies) - limit
    remaining = []
    for r in ok:
        assert r.headers["ratelimit-policy"] == f'"served-api";q={limit};w=60'
        match = re.fullmatch(r'"served-api";r=(\d+);t=(\d+)', r.headers["ratelimit"])
        assert match is not None, r.headers["ratelimit"]
        remaining.append(int(match[1]))
        assert int(match[2]) == 60
        assert "retry-after" not in r.headers
        assert json.loads(r.body) == (body or {"items": [1, 2, 3]})
    # Atomic and exact across both workers: every admission saw a different count.
    assert sorted(remaining) == list(range(limit))
    for r in denied:
        assert r.headers["ratelimit-policy"] == f'"served-api";q={limit};w=60'
        assert re.fullmatch(r'"served-api";r=0;t=(60|59)', r.headers["ratelimit"])
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert r.headers["content-type"] == "application/problem+json"
        problem = json.loads(r.body)
        assert problem["status"] == 429
        assert problem["policy"] == "served-api"


def test_top_lists_the_identities_over_their_limit_across_two_workers(
    servers: dict[str, RedisServer],
):
    """200 identities send Zipf traffic (identity i sends 420 // i requests) through 2
    uvicorn workers on one Redis, on 20 per minute: identities 1 to 20 go over their limit.
    ``ratekeeper top --policy top-api --json`` lists exactly those 20, in order of denials,
    with the exact counts (20 identities fit the 64 counters of each worker's summary)."""
    server = next(iter(servers.values()))
    sent = {f"client-{i}": 420 // i for i in range(1, 201)}
    expected = [(identity, n - 20) for identity, n in sent.items() if n > 20]
    assert len(expected) == 20
    traffic = [{"X-Client": identity} for identity, n in sent.items() for _ in range(n)]
    random.Random(3).shuffle(traffic)
    with uvicorn("tests.support.web_apps:create_top_app", server.url) as (served, running):
        replies = hammer(served.url, API, traffic)
        denied = Counter(r.sent["X-Client"] for r in replies if r.status == 429)
        assert sorted(denied.items()) == sorted(expected)  # the limit held, exactly
        command = [
            str(Path(sys.executable).parent / "ratekeeper"), "top", "--storage", server.url,
            "--policy", "top-api", "--key-prefix", served.key_prefix, "--limit", "25", "--json",
        ]  # fmt: skip
        total = sum(n for _, n in expected)
        found: dict[str, Any] = {}

        def merged() -> bool:  # each worker merges within 5 s of its first unmerged denial
            nonlocal found
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            (found,) = json.loads(out)
            return int(found["total"]) == total

        running.wait_until(merged, "both workers' merges")
    assert [(o["identity"], o["denied"]) for o in found["offenders"]] == expected
    assert found["error"] == total // 64


def test_one_identity_gets_exactly_the_limit_across_two_workers(served: Served):
    replies = hammer(served.url, API, [{"X-API-Key": f"alice-{uuid.uuid4()}"}] * 40)
    check_replies(replies)
    pids = {r.headers["x-worker-pid"] for r in replies if r.status == 200}
    assert pids <= served.worker_pids


def test_two_identities_are_independent(served: Served):
    bob, carol = f"bob-{uuid.uuid4()}", f"carol-{uuid.uuid4()}"
    replies = hammer(served.url, API, [{"X-API-Key": bob}, {"X-API-Key": carol}] * 25)
    assert len(replies) == 50
    for key in (bob, carol):
        check_replies([r for r in replies if r.sent["X-API-Key"] == key])
    # A third identity is untouched by both.
    check_replies(hammer(served.url, API, [{"X-API-Key": f"dave-{uuid.uuid4()}"}] * 16))


def test_both_workers_serve_and_share_the_limit(served: Served):
    key = f"erin-{uuid.uuid4()}"
    replies = hammer(served.url, API, [{"X-API-Key": key}] * 64)
    check_replies(replies)
    served_by = {r.headers.get("x-worker-pid") for r in replies if r.status == 200}
    denied_by = {r.headers.get("x-worker-pid") for r in replies if r.status == 429}
    # Denials come from the middleware, before the app: no pid header there.
    assert denied_by == {None}
    assert served_by <= served.worker_pids
    health = hammer(served.url, "/health", [{}] * 40)
    health_pids = {r.headers["x-worker-pid"] for r in health}
    assert health_pids == served.worker_pids  # both workers answered, sharing one store


def test_health_is_never_limited(served: Served):
    key = f"frank-{uuid.uuid4()}"
    replies = hammer(served.url, "/health", [{"X-API-Key": key}] * 40)
    assert [r.status for r in replies] == [200] * 40
    assert not [h for r in replies for h in r.headers if "ratelimit" in h or h == "retry-after"]
    # And cost nothing: the key still has its whole budget.
    check_replies(hammer(served.url, API, [{"X-API-Key": key}] * 13))


def test_a_denied_websocket_handshake_is_refused(served: Served):
    ws_url = served.url.replace("http://", "ws://") + "/ws"
    headers = {"X-API-Key": f"gina-{uuid.uuid4()}"}
    with websockets.sync.client.connect(ws_url, additional_headers=headers, open_timeout=30) as ws:
        assert ws.recv(timeout=30) == "hello"
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        websockets.sync.client.connect(ws_url, additional_headers=headers, open_timeout=30)
    assert refused.value.response.status_code == 403
    # Another identity still gets in.
    other = {"X-API-Key": f"hank-{uuid.uuid4()}"}
    with websockets.sync.client.connect(ws_url, additional_headers=other, open_timeout=30) as ws:
        assert ws.recv(timeout=30) == "hello"


# --- counting on the outcome, across both workers ----------------------------------------------


def test_failed_logins_count_across_two_workers_then_the_handler_never_runs(served: Served):
    """``deduct_when`` on 401: 5 failed logins a minute per user, whichever worker serves
    them; then the next attempts (a right password too) are refused before the handler runs,
    which the handler's own run counter in the shared store shows."""
    store = redis.Redis.from_url(served.store_url)
    runs_key = f"{served.key_prefix}:login-runs"
    counted_by: set[str] = set()
    limits = httpx.Limits(max_keepalive_connections=0)  # a new connection per request
    with httpx.Client(base_url=served.url, timeout=30, limits=limits) as http:
        # Users one after another until both workers have served counted failures (the
        # kernel hands each new connection to either worker: a run of 40 users all on one
        # worker has not been seen, 10 in a row has).
        for _ in range(40):
            user = {"X-User": f"mallory-{uuid.uuid4()}"}
            before = int(store.get(runs_key) or 0)
            replies = []
            for password in ["right", *["wrong"] * 5, "wrong", "right"]:
                replies.append(
                    http.post("/login", headers={**user, "X-API-Key": user["X-User"],
                                                 "X-Password": password})
                )  # fmt: skip
            after = int(store.get(runs_key) or 0)
            assert [r.status_code for r in replies] == [200, *[401] * 5, 429, 429]
            assert after - before == 6  # 1 success + 5 failures; the 429s never ran it
            for n, r in zip((4, 3, 2, 1, 0), replies[1:6], strict=True):
                # t: the window empties 60 s after the first failure (59 on a slow machine)
                assert re.fullmatch(rf'"served-login";r={n};t=(59|60)', r.headers["ratelimit"])
            for r in replies[6:]:
                assert r.json()["policy"] == "served-login"
                assert "x-worker-pid" not in r.headers
                assert 1 <= int(r.headers["retry-after"]) <= 60
            counted_by |= {r.headers["x-worker-pid"] for r in replies[1:6]}
            if counted_by == served.worker_pids:
                break
    store.close()
    assert counted_by == served.worker_pids


# --- Litestar -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litestar_served(servers: dict[str, RedisServer]) -> Iterator[Served]:
    """``uvicorn --workers 2 --factory tests.support.web_apps:create_litestar_app``."""
    with uvicorn("tests.support.web_apps:create_litestar_app", servers[FLAVORS[0]].url) as (
        served,
        _,
    ):
        yield served


def test_litestar_admits_exactly_the_limit_with_the_headers(litestar_served: Served):
    key = f"ivy-{uuid.uuid4()}"
    replies = hammer(litestar_served.url, API, [{"X-API-Key": key}] * 40)
    # The handler sees the decision in request.state.ratekeeper.
    check_replies(replies, body={"items": [1, 2, 3], "policies": ["served-api"]})
    health = hammer(litestar_served.url, "/health", [{"X-API-Key": key}] * 8)
    assert [r.status for r in health] == [200] * 8
    assert not [h for r in health for h in r.headers if "ratelimit" in h]


# --- memory:// under several workers ------------------------------------------------------------

MEMORY_WARNING = "is on memory:// in a process that is one of several workers"


@pytest.mark.parametrize("workers", [2, 1])
def test_memory_under_several_uvicorn_workers_warns_once_a_worker(workers: int):
    with uvicorn("tests.support.web_apps:create_app", "memory://", workers=workers) as (
        served,
        running,
    ):
        with httpx.Client(base_url=served.url, timeout=10) as http:
            for _ in range(4):
                assert http.get(API).status_code == 200
        output = running.output()
    if workers == 2:
        assert output.count(MEMORY_WARNING) == 2, output  # once in each worker
        assert "(uvicorn with 2 workers)" in output
    else:
        assert MEMORY_WARNING not in output, output


def test_memory_under_several_gunicorn_workers_warns_once_a_worker():
    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "gunicorn", "-w", "2", "-b", f"127.0.0.1:{port}",
            "tests.support.web_apps:create_wsgi_app()",
        ]  # fmt: skip

    with web_process(command, "gunicorn", env=_env("memory://")) as running:
        running.wait_until(
            lambda: running.output().count(MEMORY_WARNING) >= 2, "gunicorn's workers"
        )
        with httpx.Client(base_url=running.url, timeout=10) as http:
            assert http.get(API).status_code == 200
    output = running.output()
    assert output.count(MEMORY_WARNING) == 2, output  # once in each worker (WSGI middleware)
    assert "(gunicorn with 2 workers)" in output


# --- ratekeeper demo --serve ---------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["memory", *FLAVORS[:1]])
def test_demo_serve(storage: str, servers: dict[str, RedisServer]):
    def command(port: int) -> list[str]:
        argv = [str(Path(sys.executable).with_name("ratekeeper")), "demo", "--serve"]
        argv += ["--port", str(port)]
        if storage != "memory":
            # Query options reach redis-py: a slow store must not make the demo fail open.
            argv += [
                "--storage",
                f"{servers[storage].url}?socket_timeout=5&socket_connect_timeout=5",
            ]
        return argv

    with web_process(command, "ratekeeper demo --serve") as running:
        url = running.url
        with httpx.Client(base_url=url, timeout=10) as http:
            started = time.monotonic()
            items = [http.get(API) for _ in range(6)]
            within = time.monotonic() - started
            search = [http.get("/api/search") for _ in range(3)]
            health = [http.get("/health") for _ in range(20)]
    output = running.output()
    assert running.returncode in (0, -signal.SIGTERM)
    assert within < 10  # the window is 10 s: the sixth request must fall inside it
    assert url in output
    curl = [line for line in output.splitlines() if "curl" in line]
    assert curl, output
    assert f"{url}/api/items" in curl[0]
    assert [r.status_code for r in items] == [200] * 5 + [429]
    assert [r.headers["ratelimit"] for r in items[:5]] == [
        f'"demo-api";r={n};t=10' for n in (4, 3, 2, 1, 0)
    ]
    assert items[0].headers["ratelimit-policy"] == '"demo-api";q=5;w=10'
    sixth = items[5]
    assert sixth.headers["content-type"] == "application/problem+json"
    assert 1 <= int(sixth.headers["retry-after"]) <= 10
    assert sixth.json()["status"] == 429
    assert [r.status_code for r in search] == [200, 200, 429]
    assert {r.headers["ratelimit-policy"] for r in search} == {'"demo-search";q=2;w=10'}
    assert [r.status_code for r in health] == [200] * 20
    assert all(r.json() == {"status": "ok"} for r in health)
    assert not [h for r in health for h in r.headers if "ratelimit" in h or h == "retry-after"]
