"""Worker functions for the multi-process tests.

They live at module level in an importable module so that ``multiprocessing``'s "spawn" and
"forkserver" start methods can import them in the child. Each worker builds its own limiter,
reports ``{"pid", "admitted", "denied", "errors"}`` through a queue and closes everything it
opened. A generous timeout is used: a StorageTimeout would leave the outcome of a hit unknown and
make an exact count impossible, which is not what these workers measure.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from ratekeeper import AsyncLimiter, Limiter, Policy

#: Seconds a worker waits for the others at the start line before giving up.
BARRIER_TIMEOUT = 60.0
#: Reply and connect timeout for worker limiters: long enough never to fire on a loaded machine.
STORE_TIMEOUT = 10.0


def _result(admitted: int, denied: int, errors: list[str]) -> dict[str, Any]:
    return {"pid": os.getpid(), "admitted": admitted, "denied": denied, "errors": errors}


def threaded_hits(
    *,
    url: str,
    key_prefix: str,
    policy_name: str,
    rates: str,
    identity: str,
    threads: int,
    hits_per_thread: int,
    cost: int,
    barrier: Any,
    queue: Any,
) -> None:
    """``threads`` threads share one Limiter and each hit ``hits_per_thread`` times.

    ``barrier`` is a ``multiprocessing.Barrier`` with one party per thread of every process, so
    all threads of all processes start hitting together. Admitted units of cost are reported.
    """
    policy = Policy(policy_name, rates)
    admitted = denied = 0
    errors: list[str] = []
    lock = threading.Lock()
    limiter = Limiter.from_url(
        url, key_prefix=key_prefix, timeout=STORE_TIMEOUT, connect_timeout=STORE_TIMEOUT
    )

    def run() -> None:
        nonlocal admitted, denied
        mine_admitted = mine_denied = 0
        try:
            # A peek opens this thread's connection (and loads the script) without consuming.
            limiter.peek(policy, identity, cost)
            barrier.wait(BARRIER_TIMEOUT)
            for _ in range(hits_per_thread):
                if limiter.hit(policy, identity, cost).allowed:
                    mine_admitted += cost
                else:
                    mine_denied += 1
        except Exception as exc:
            with lock:
                errors.append(repr(exc))
        with lock:
            admitted += mine_admitted
            denied += mine_denied

    try:
        workers = [threading.Thread(target=run) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        limiter.close()
    queue.put(_result(admitted, denied, errors))


def async_hits(
    *,
    url: str,
    key_prefix: str,
    policy_name: str,
    rates: str,
    identity: str,
    tasks: int,
    hits_per_task: int,
    barrier: Any,
    queue: Any,
) -> None:
    """``tasks`` concurrent asyncio tasks share one AsyncLimiter and each hit ``hits_per_task``.

    ``barrier`` has one party per process: every process opens its connections first, then all
    processes release their tasks together.
    """
    policy = Policy(policy_name, rates)
    errors: list[str] = []

    async def main() -> tuple[int, int]:
        limiter = AsyncLimiter.from_url(
            url, key_prefix=key_prefix, timeout=STORE_TIMEOUT, connect_timeout=STORE_TIMEOUT
        )
        try:
            # Concurrent peeks open one connection per task without consuming anything.
            await asyncio.gather(*(limiter.peek(policy, identity) for _ in range(tasks)))
            barrier.wait(BARRIER_TIMEOUT)  # blocks the loop, which has nothing else to do yet

            async def run() -> tuple[int, int]:
                admitted = denied = 0
                for _ in range(hits_per_task):
                    if (await limiter.hit(policy, identity)).allowed:
                        admitted += 1
                    else:
                        denied += 1
                return admitted, denied

            results = await asyncio.gather(*(run() for _ in range(tasks)), return_exceptions=True)
        finally:
            await limiter.close()
        admitted = denied = 0
        for result in results:
            if isinstance(result, BaseException):
                errors.append(repr(result))
            else:
                admitted += result[0]
                denied += result[1]
        return admitted, denied

    try:
        admitted, denied = asyncio.run(main())
    except Exception as exc:
        errors.append(repr(exc))
        admitted = denied = 0
    queue.put(_result(admitted, denied, errors))


def sequential_hits(
    *,
    url: str,
    key_prefix: str,
    policy_name: str,
    rates: str,
    identity: str,
    hits: int,
    queue: Any,
) -> None:
    """One caller, ``hits`` hits in a row (for the fork test: no threads in the child)."""
    policy = Policy(policy_name, rates)
    admitted = denied = 0
    errors: list[str] = []
    try:
        with Limiter.from_url(
            url, key_prefix=key_prefix, timeout=STORE_TIMEOUT, connect_timeout=STORE_TIMEOUT
        ) as limiter:
            for _ in range(hits):
                if limiter.hit(policy, identity).allowed:
                    admitted += 1
                else:
                    denied += 1
    except Exception as exc:
        errors.append(repr(exc))
    queue.put(_result(admitted, denied, errors))
