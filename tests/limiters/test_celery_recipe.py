"""The Celery recipe, with a real worker: a task calls ``limiter.wait(...)`` before its outbound
call, and tasks running at once on a worker keep to the shared limit.

The broker and the result backend are the test Redis server (databases 1 and 2); the worker is
Celery's own test worker (``celery.contrib.testing.worker.start_worker``) with a pool of 4
threads, so several tasks wait at the same time. The outbound call goes to a real local HTTP
server that counts what it received.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from ratekeeper import Limiter, Policy

from ..support.http_servers import Upstream
from ..support.servers import RedisServer
from .test_wait import assert_at_most_per_window

celery = pytest.importorskip("celery")
from celery.contrib.testing.worker import start_worker  # noqa: E402

TASKS = 12
LIMIT = 5


class StampedLimiter(Limiter):
    """Notes, per thread, when the last hit was sent (``wait`` calls ``self.hit``)."""

    stamps = threading.local()

    def hit(self, policy: Policy, identity: Any, cost: int = 1) -> Any:
        self.stamps.sent = time.time()
        return super().hit(policy, identity, cost)


def _db(url: str, db: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{db}"


def test_tasks_wait_for_the_shared_limit(server: RedisServer, upstream: Upstream) -> None:
    run = uuid.uuid4().hex[:8]
    app = celery.Celery(f"recipe-{run}")
    app.conf.update(
        broker_url=_db(server.url, 1),
        result_backend=_db(server.url, 2),
        broker_connection_retry_on_startup=True,
        task_default_queue=f"q-{run}",  # no other run's tasks
        worker_hijack_root_logger=False,
    )

    # -- the recipe ----------------------------------------------------------------------
    limiter = StampedLimiter.from_url(
        server.url, key_prefix=f"celery-{run}", timeout=5, connect_timeout=5
    )
    partner_api = Policy("partner-api", f"{LIMIT} per second")

    @app.task(name=f"call_partner-{run}")  # in your code: plain @app.task
    def call_partner(item: int) -> dict[str, Any]:
        limiter.wait(partner_api, "partner", timeout=30)  # blocks until the shared limit admits
        admitted = (limiter.stamps.sent, time.time())
        response = httpx.get(upstream.url, headers={"x-tenant": "partner"})
        return {"item": item, "status": response.status_code, "admitted": admitted}

    # ------------------------------------------------------------------------------------

    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
            started = time.time()
            results = [call_partner.delay(i) for i in range(TASKS)]
            done = [result.get(timeout=60) for result in results]
            elapsed = time.time() - started
    finally:
        limiter.close()
    assert sorted(d["item"] for d in done) == list(range(TASKS))
    assert all(d["status"] == 200 for d in done)
    assert upstream.received == {"partner": TASKS}
    admissions = [tuple(d["admitted"]) for d in done]
    assert assert_at_most_per_window(admissions, LIMIT) == LIMIT
    # 12 calls at 5 per second: waves at 0, 1 and 2 s.
    print(f"\n{TASKS} Celery tasks at {LIMIT}/s on 4 worker threads: {elapsed:.2f} s")
    assert 2.0 <= elapsed <= 6.0
