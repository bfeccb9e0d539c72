"""The DRF worker for ``tests/http/test_drf.py``: a spawned process that configures the test project
on the given store and calls DRF views through DRF's request machinery (``APIRequestFactory``)
from several threads released together."""

from __future__ import annotations

import os
import threading
from typing import Any

#: Seconds a worker waits for the others at the start line before giving up.
BARRIER_TIMEOUT = 120.0


def hammer(
    url: str,
    key_prefix: str,
    view_names: tuple[str, ...],
    threads: int,
    per_thread: int,
    barrier: Any,
    queue: Any,
) -> None:
    """For each of ``view_names`` (``ratekeeper``, ``drf``) in turn, call that view
    ``per_thread`` times from each of ``threads`` threads, all processes' threads released
    together by ``barrier``; put ``{"pid", "statuses": {view: [...]}, "errors"}`` on
    ``queue``."""
    os.environ["RATEKEEPER_DJANGO_STORAGE_URL"] = url
    os.environ["RATEKEEPER_DJANGO_KEY_PREFIX"] = key_prefix
    from . import configure

    configure()
    from rest_framework.test import APIRequestFactory

    from .views import Burst, DRFBurst

    classes = {"ratekeeper": Burst, "drf": DRFBurst}
    statuses: dict[str, list[int]] = {name: [] for name in view_names}
    errors: list[str] = []
    lock = threading.Lock()

    def run(name: str) -> None:
        view = classes[name].as_view()
        factory = APIRequestFactory()
        requests = [factory.get(f"/drf/{name}") for _ in range(per_thread)]
        mine: list[int] = []
        try:
            barrier.wait(BARRIER_TIMEOUT)
            mine = [view(request).status_code for request in requests]
        except Exception as exc:
            with lock:
                errors.append(repr(exc))
        with lock:
            statuses[name].extend(mine)

    for name in view_names:
        workers = [threading.Thread(target=run, args=(name,)) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    queue.put({"pid": os.getpid(), "statuses": statuses, "errors": errors})
