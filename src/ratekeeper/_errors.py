"""The exceptions ratekeeper raises.

Every error is a :class:`RatekeeperError`::

    RatekeeperError
    ├── ConfigError (also a ValueError)     bad rates, policies, costs, identities, URLs, options
    └── StorageError                        the store failed; redis-py errors are translated here
        ├── StorageTimeout                  no reply within the deadline; the call may have run,
        │                                   so it is never retried
        ├── StorageUnavailable              could not connect, or the connection broke
        └── StorageResponseError            the server refused the command (out of memory,
                                            READONLY, a script error, ...)

Errors of the store's client library never escape: they are translated where they enter, in
``ratekeeper._storage``. The original exception is kept as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "RatekeeperError",
    "StorageError",
    "StorageResponseError",
    "StorageTimeout",
    "StorageUnavailable",
]


class RatekeeperError(Exception):
    """Base class of every error raised by ratekeeper."""


class ConfigError(RatekeeperError, ValueError):
    """A rate, policy, cost, identity, URL or option is invalid."""


class StorageError(RatekeeperError):
    """The store could not make a decision."""


class StorageTimeout(StorageError):
    """The store did not answer within the deadline. The command may have run."""


class StorageUnavailable(StorageError):
    """The store could not be reached, or the connection broke."""


class StorageResponseError(StorageError):
    """The store answered with an error (OOM, READONLY, a script error, ...)."""
