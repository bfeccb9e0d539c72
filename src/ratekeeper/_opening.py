"""What ``from_url`` settles before a limiter exists: which URL (the argument, then
``$RATEKEEPER_STORAGE_URL``, then ``memory://`` with a warning), which store options were given,
and the default breaker for a given ``timeout``."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ._breaker import CircuitBreaker

__all__ = ["STORAGE_URL_VARIABLE", "default_breaker", "storage_url", "store_options"]

log = logging.getLogger("ratekeeper")

#: Where ``from_url()`` without a URL finds one.
STORAGE_URL_VARIABLE = "RATEKEEPER_STORAGE_URL"

_fallback_lock = threading.Lock()
_fallback_warned = False


def storage_url(url: str | None) -> str:
    """``url``; without one, ``$RATEKEEPER_STORAGE_URL`` (unset or empty: not given); without
    that, ``memory://``, with a warning the first time in a process."""
    global _fallback_warned
    if url is not None:
        return url
    from_env = os.environ.get(STORAGE_URL_VARIABLE, "")
    if from_env:
        return from_env
    with _fallback_lock:
        warn, _fallback_warned = not _fallback_warned, True
    if warn:
        log.warning(
            "ratekeeper: no storage URL given and %s is not set: using memory://, whose "
            "limits are per process (each process admits the whole limit)",
            STORAGE_URL_VARIABLE,
        )
    return "memory://"


def store_options(
    timeout: float | None,
    connect_timeout: float | None,
    max_connections: int | None,
    redis_options: dict[str, Any] | None,
) -> dict[str, Any]:
    """The store options given (None: not given), for the storage to check and apply:
    ``memory://`` refuses any, a Redis URL fills in its defaults."""
    given = {
        "timeout": timeout,
        "connect_timeout": connect_timeout,
        "max_connections": max_connections,
        "redis_options": redis_options,
    }
    return {name: value for name, value in given.items() if value is not None}


def default_breaker(breaker: CircuitBreaker | None, timeout: float | None) -> CircuitBreaker | None:
    """The user's breaker; else, when a store ``timeout`` is given, one whose slow calls are
    those past it: a patient limiter is not tripped by calls it waits for (None: the default
    breaker, slow past the default 20 ms timeout). A bad timeout is left to the storage's
    check."""
    if (
        breaker is None
        and isinstance(timeout, (int, float))
        and not isinstance(timeout, bool)
        and timeout > 0
    ):
        return CircuitBreaker(slow_call=float(timeout))
    return breaker
