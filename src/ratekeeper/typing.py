"""The names ratekeeper's options accept, as types a type checker holds a call to.

>>> from ratekeeper.typing import FailureMode
>>> mode: FailureMode = "closed"

``Limiter.from_url(..., failure_mode=...)`` and ``Policy(..., algorithm=...)`` take these, so
``mypy`` or an IDE flags ``failure_mode="opne"`` where it is written; the same values are still
checked when the call runs (a ConfigError naming the bad one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypedDict

from ._fleet import AutoShare

if TYPE_CHECKING:
    from ._breaker import CircuitBreaker
    from ._clock import Clock
    from .metrics import Metrics

__all__ = ["Algorithm", "FailureMode", "LimiterOptions", "LocalShare", "UrlOptions"]

#: What a limiter does when the store cannot decide: allow (``open``), deny (``closed``),
#: decide with an in-process limiter at a share of each limit (``local``), or raise the
#: StorageError to the caller (``raise``).
FailureMode: TypeAlias = Literal["open", "closed", "local", "raise"]

#: The algorithms a Policy can use (``token_bucket`` is an alias of ``gcra``).
Algorithm: TypeAlias = Literal[
    "sliding_log", "sliding_window", "fixed_window", "gcra", "token_bucket", "concurrency"
]

#: The share of each limit one process may grant in the ``local`` failure mode: a number in
#: (0, 1], or ``"auto"`` (an ``AutoShare`` for its timing) for a share that follows the number
#: of live instances.
LocalShare: TypeAlias = float | Literal["auto"] | AutoShare


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
