"""What ``from_url`` settles before a limiter exists: which URL (the argument, then
``$RATEKEEPER_STORAGE_URL``, then ``memory://`` with a warning), which store options were given,
and the default breaker for a given ``timeout``."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, TypedDict

from .._engine.breaker import CircuitBreaker
from .._engine.metrics import Metrics
from .._model.clock import Clock
from .._model.options import FailureMode, LocalShare

__all__ = [
    "STORAGE_URL_VARIABLE",
    "LimiterOptions",
    "UrlOptions",
    "check_options",
    "default_breaker",
    "opening",
    "storage_url",
]


class LimiterOptions(TypedDict, total=False):
    """The options every limiter takes, by keyword (``Limiter(storage, **options)``,
    ``from_url``, ``from_client``, and the same on ``AsyncLimiter``); described in
    :meth:`ratekeeper.Limiter.from_url`. A wrapper of your own can pass them on typed::

        def my_limiter(**options: Unpack[LimiterOptions]) -> Limiter: ...
    """

    key_prefix: str
    clock: Clock | None
    failure_mode: FailureMode
    local_share: LocalShare
    breaker: CircuitBreaker | None
    deny_cache: int
    deny_cache_max_age: float
    metrics: Metrics | None
    top_offenders: int
    top_hash_key: bytes | str | None


class UrlOptions(LimiterOptions, total=False):
    """``from_url``'s options: the limiter's, and those of a Redis or Valkey store
    (``memory://`` refuses these); described in :meth:`ratekeeper.Limiter.from_url`."""

    timeout: float | None
    connect_timeout: float | None
    max_connections: int | None
    redis_options: dict[str, Any] | None


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


#: The options of a Redis or Valkey store, as ``from_url`` takes them.
_STORE_OPTIONS = ("timeout", "connect_timeout", "max_connections", "redis_options")


def opening(
    where: str, url: str | None, options: UrlOptions
) -> tuple[str, dict[str, Any], LimiterOptions]:
    """What ``from_url`` (named ``where``) opens, split from what it builds: the URL, the
    store's options (the ones given, and the clock) and the limiter's options (the default
    breaker following a given ``timeout``). An unknown option is a TypeError, raised before
    anything is opened; a bad value is left to the storage's or the limiter's check."""
    check_options(where, options, _STORE_OPTIONS)
    given: dict[str, Any] = dict(options)
    store = {name: given.pop(name) for name in _STORE_OPTIONS if given.get(name) is not None}
    for name in _STORE_OPTIONS:
        given.pop(name, None)
    store["clock"] = given.get("clock")
    given["breaker"] = default_breaker(given.get("breaker"), store.get("timeout"))
    limiter: LimiterOptions = given  # type: ignore[assignment]  # only its keys are left
    return storage_url(url), store, limiter


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


def check_options(where: str, options: Mapping[str, object], more: tuple[str, ...] = ()) -> None:
    """A TypeError naming the first unknown option given to ``where`` (as Python names an
    unknown keyword argument): a limiter option, or one of ``more``."""
    for name in options:
        if name not in LimiterOptions.__optional_keys__ and name not in more:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
