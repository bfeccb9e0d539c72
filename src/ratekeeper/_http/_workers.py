"""A warning when ``memory://`` runs under several worker processes (each would admit the
whole limit)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence

from .._limiters.limiter import AsyncLimiter, Limiter

# --- memory:// under several workers -----------------------------------------------------------

log = logging.getLogger("ratekeeper")

_SERVERS = ("gunicorn", "uvicorn", "hypercorn", "granian")
_WORKER_FLAGS = ("-w", "--workers")
_warned = False
_warned_lock = threading.Lock()


def _server(argv: Sequence[str]) -> str | None:
    """The server a command line runs (``gunicorn ...``, ``python -m uvicorn ...``, gunicorn's
    retitled ``gunicorn: master [app]``), or None."""
    for word in argv[:3]:
        name = os.path.basename(word)
        for server in _SERVERS:
            if name.startswith(server) or word.endswith(f"/{server}/__main__.py"):
                return server
    return None


def _workers_flag(argv: Sequence[str]) -> int | None:
    """The worker count a command line gives with ``-w``/``--workers``, or None."""
    for i, word in enumerate(argv):
        value = None
        if word in _WORKER_FLAGS and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith("--workers="):
            value = word.partition("=")[2]
        elif word.startswith("-w") and word[2:].isdigit():
            value = word[2:]
        if value is not None and value.isdigit():
            return int(value)
    return None


def several_workers(
    environ: Mapping[str, str],
    parent_argv: Sequence[str],
    own_argv: Sequence[str] = (),
    parent_children: int = 0,
) -> str | None:
    """Why this process is evidently one of several workers, or None.

    Evident means: ``WEB_CONCURRENCY`` above 1 (gunicorn and uvicorn take it for their worker
    count); or this process is gunicorn, uvicorn, hypercorn or granian started with
    ``-w``/``--workers`` above 1 (a supervisor that loads the app before forking its workers,
    as ``gunicorn --preload`` does); or its parent is one of them, started with more than one
    worker, or (a count from a config file, a retitled ``gunicorn: master``) with
    ``parent_children`` of 2 or more."""
    concurrency = environ.get("WEB_CONCURRENCY", "").strip()
    if concurrency.isdigit() and int(concurrency) > 1:
        return f"WEB_CONCURRENCY={concurrency}"
    for argv, children in ((own_argv, 0), (parent_argv, parent_children)):
        server = _server(argv)
        if server is None:
            continue
        workers = _workers_flag(argv)
        if workers is not None and workers > 1:
            return f"{server} with {workers} workers"
        if workers is None and children > 1:
            return f"{server} with {children} worker processes"
    return None


def _argv(pid: int | str) -> list[str]:
    """A process's command line (Linux ``/proc``; elsewhere: none)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _children(pid: int) -> int:
    """How many child processes ``pid`` has (Linux ``/proc``; elsewhere: 0)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return len(f.read().split())
    except OSError:
        return 0


def warn_memory_under_workers(limiter: Limiter | AsyncLimiter, where: str) -> bool:
    """Log a warning, once a process, when ``limiter`` is on ``memory://`` and this process is
    evidently one of several workers: each worker would admit the whole limit. Whether it
    warned."""
    global _warned
    from .._storage.memory import AsyncMemoryStorage, MemoryStorage

    if _warned or not isinstance(limiter.storage, (MemoryStorage, AsyncMemoryStorage)):
        return False
    parent = os.getppid()
    why = several_workers(os.environ, _argv(parent), _argv("self"), _children(parent))
    if why is None:
        return False
    with _warned_lock:
        warn, _warned = not _warned, True
    if warn:
        log.warning(
            "ratekeeper: %s is on memory:// in a process that is one of several workers "
            "(%s): each worker keeps its own counts and admits the whole limit; use a Redis "
            "or Valkey URL",
            where,
            why,
        )
    return warn
