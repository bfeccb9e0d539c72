"""The exceptions ratekeeper raises.

Every error is a :class:`RatekeeperError`::

    RatekeeperError
    ├── ConfigError (also a ValueError)     bad rates, policies, costs, identities, URLs, options
    ├── RateLimited                         denied, and not waiting (any longer): ``.decision``
    │                                       is the last denial, with its ``retry_after``
    ├── RequestRejected                     the store refused this request itself: CROSSSLOT, a
    │                                       script error, WRONGTYPE. A bug or bad input, so it is
    │                                       always raised, never failed open
    └── StorageError                        the store failed; the policy's failure mode applies
        ├── StorageTimeout                  no reply within the deadline; the call may have run,
        │                                   so it is never retried
        ├── StorageUnavailable              could not connect, or the connection broke
        └── StorageResponseError            the store answered that it cannot serve: READONLY
            │                               after a failover, LOADING, BUSY, CLUSTERDOWN, ...;
            │                               it is up and answering, so the breaker counts it as
            │                               up, and what it can still deny stays denied
            └── StorageFull                 the store refused this call's write (OOM)

Errors of the store's client library never escape: they are translated where they enter, in
``ratekeeper._storage``. The original exception is kept as ``__cause__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .decision import Decision

__all__ = [
    "ConfigError",
    "RateLimited",
    "RatekeeperError",
    "RequestRejected",
    "ReservationError",
    "StorageError",
    "StorageFull",
    "StorageResponseError",
    "StorageTimeout",
    "StorageUnavailable",
]


class RatekeeperError(Exception):
    """Base class of every error raised by ratekeeper."""


class ConfigError(RatekeeperError, ValueError):
    """A rate, policy, cost, identity, URL or option is invalid."""


class RateLimited(RatekeeperError):
    """A request was denied and the caller does not wait (any longer) for it to pass.

    Raised by ``wait`` when the timeout would pass before the next try, or at once when the
    cost can never pass (``retry_after == math.inf``); by the ``limit`` decorator and the httpx
    transports when they do not wait. ``decision`` is the last denial.
    """

    def __init__(self, decision: Decision) -> None:
        retry = decision.retry_after
        if retry is None:
            wait = "no retry_after"
        elif retry == float("inf"):
            wait = "the cost can never pass"
        else:
            wait = f"retry in {retry:.3f} s"
        super().__init__(f"rate limited by policy {decision.policy!r} ({wait})")
        self.decision = decision

    def __reduce__(self) -> tuple[type[RateLimited], tuple[Decision]]:
        return (type(self), (self.decision,))


class ReservationError(RatekeeperError, RuntimeError):
    """A reservation was settled twice, settled after it was cancelled, or settled although
    it was denied (it holds nothing)."""


class RequestRejected(RatekeeperError):
    """The store rejected the request itself (CROSSSLOT, a script error, WRONGTYPE).

    Not a StorageError: failing open on it would let crafted input bypass the limit.
    """


class StorageError(RatekeeperError):
    """The store could not make a decision."""


class StorageTimeout(StorageError):
    """The store did not answer within the deadline. The command may have run."""


class StorageUnavailable(StorageError):
    """The store could not be reached, or the connection broke."""


class StorageResponseError(StorageError):
    """The store answered with an error about its own state (OOM, READONLY, LOADING,
    CLUSTERDOWN, ...). It answered: the failure mode decides this call only, and the breaker
    counts an answer (it guards against a store that is slow or gone, not one that says no
    quickly), so the next calls ask again and are decided by the store as soon as it can."""


class StorageFull(StorageResponseError):
    """The store refused this call's write for want of memory (OOM with ``maxmemory`` and
    ``noeviction``). Identities the store can still deny (a denial writes nothing) stay
    denied."""
