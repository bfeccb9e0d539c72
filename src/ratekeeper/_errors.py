"""The exceptions ratekeeper raises.

Every error is a :class:`RatekeeperError`::

    RatekeeperError
    ├── ConfigError (also a ValueError)     bad rates, policies, costs, identities, URLs, options
    ├── RequestRejected                     the store refused this request itself: CROSSSLOT, a
    │                                       script error, WRONGTYPE. A bug or bad input, so it is
    │                                       always raised, never failed open
    └── StorageError                        the store failed; the policy's failure mode applies
        ├── StorageTimeout                  no reply within the deadline; the call may have run,
        │                                   so it is never retried
        ├── StorageUnavailable              could not connect, or the connection broke
        └── StorageResponseError            the store is unwell: out of memory, READONLY after a
                                            failover, LOADING, BUSY, CLUSTERDOWN, TRYAGAIN, ...

Errors of the store's client library never escape: they are translated where they enter, in
``ratekeeper._storage``. The original exception is kept as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "RatekeeperError",
    "RequestRejected",
    "StorageError",
    "StorageResponseError",
    "StorageTimeout",
    "StorageUnavailable",
]


class RatekeeperError(Exception):
    """Base class of every error raised by ratekeeper."""


class ConfigError(RatekeeperError, ValueError):
    """A rate, policy, cost, identity, URL or option is invalid."""


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
    """The store answered with an error about its own state (OOM, READONLY, LOADING, ...)."""
