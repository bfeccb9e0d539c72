"""The DRF worker for ``tests/test_drf.py``: a spawned process that configures the test project
on the given store and calls one DRF view through DRF's request machinery
(``APIRequestFactory``) from several threads released together."""

from __future__ import annotations

import os
import threading
from typing import Any

#: Seconds a worker waits for the others at the start line before giving up.
BARRIER_TIMEOUT = 120.0


def hammer(
    url: str,
    key_prefix: str,
    view_name: str,
    threads: int,
    per_thread: int,
    barrier: Any,
    results: Any,
) -> None:
    """Call view ``view_name`` (``ratekeeper`` or ``drf``) ``per_thread`` times from each of
    ``threads`` threads; put ``{"pid", "statuses", "errors"}`` on ``results``."""
    os.environ["RATEKEEPER_DJANGO_STORAGE_URL"] = url
    os.environ["RATEKEEPER_DJANGO_KEY_PREFIX"] = key_prefix
    from . import configure

    configure()
    from rest_framework.test import APIRequestFactory

    from .views import Burst, DRFBurst

    view = {"ratekeeper": Burst, "drf": DRFBurst}[view_name].as_view()
    statuses: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def run() -> None:
        factory = APIRequestFactory()
        requests = [factory.get(f"/drf/{view_name}") for _ in range(per_thread)]
        mine: list[int] = []
        try:
            barrier.wait(BARRIER_TIMEOUT)
            mine = [view(request).status_code for request in requests]
        except Exception as exc:
            with lock:
                errors.append(repr(exc))
        with lock:
            statuses.extend(mine)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    results.put({"pid": os.getpid(), "statuses": statuses, "errors": errors})
