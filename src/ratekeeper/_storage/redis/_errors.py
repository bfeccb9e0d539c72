"""Error translation: every redis-py error and error reply, mapped once onto ratekeeper's tree.

Only a failed store reaches a failure mode (``StorageError``): no reply in time, a connection
that could not be made or broke, and error replies about the store's own state (it is full,
read-only, loading, busy, resharding). An error reply about the request (CROSSSLOT, WRONGTYPE, a
script error) and an error of the client library about our own call are ``RequestRejected``:
raised whatever the failure mode, never turned into an allowed request. Any other exception (a
``TypeError``, an ``AttributeError`` after a redis-py upgrade, a bug of ours) is not translated
at all: it reaches the caller as it is.

redis-py internals: none; its public exception classes only (the same in every supported
version, see ``_compat``).
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import asyncio

import redis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)

from ..._model.errors import (
    RequestRejected,
    StorageError,
    StorageFull,
    StorageResponseError,
    StorageTimeout,
    StorageUnavailable,
)

__all__ = [
    "CLIENT_ERRORS",
    "IO_ERRORS",
    "REROUTE",
    "TIMEOUTS",
    "as_broken",
    "as_timeout",
    "translate",
]

#: Exceptions of the store's client library. What a transport catches around redis-py's calls
#: (a connect, a check-out), and nothing else.
CLIENT_ERRORS = (redis.RedisError, RedisClusterException)

#: A write or a read that ran out of time: redis-py's timeout, the socket's (``TimeoutError``,
#: also the kernel's ETIMEDOUT, as redis-py counts it), a blocking socket's whose timeout is in
#: the kernel (``BlockingIOError``: EAGAIN), asyncio's (a class of its own before Python 3.11).
TIMEOUTS = (redis.TimeoutError, TimeoutError, BlockingIOError, asyncio.TimeoutError)

#: What a transport catches around its own writes and reads, and hands to the exchange
#: (``Exchange.failed``): timeouts, client errors, and socket errors (``OSError``).
IO_ERRORS = (*TIMEOUTS, *CLIENT_ERRORS, OSError)

#: Error replies about the store's state, by the code that starts their message. redis-py strips
#: the code from the message of the replies it has a class for, so those are told by class.
_STORE_STATE_CODES = (
    "OOM",
    "READONLY",
    "LOADING",
    "BUSY",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "MOVED",
    "ASK",
    "NOREPLICAS",
    "NOSCRIPT",
)
_STORE_STATE_CLASSES = (
    OutOfMemoryError,
    ReadOnlyError,
    NoScriptError,
    ClusterDownError,  # and MasterDownError
    TryAgainError,
    AskError,  # and MovedError
)

#: Error replies after which a call in a cluster batch goes through redis-py's cluster client,
#: which follows redirections and refreshes its slot table. None of them ran the script.
#: CLUSTERDOWN is not one: the node is up and says the cluster cannot serve, an answer for this
#: call (a store error); redis-py would reinitialize the cluster, closing every node's
#: connections, in-flight calls included, when its first node does not answer.
REROUTE = (AskError, TryAgainError)


def translate(exc: Exception) -> StorageError | RequestRejected:
    """``exc`` (a redis-py error, raised or returned as an error reply) in ratekeeper's tree,
    with ``exc`` as its ``__cause__`` (also when it is handed to a waiting caller instead of
    being raised here)."""
    error: StorageError | RequestRejected
    if isinstance(exc, redis.AuthenticationError):
        # Credentials the store refuses (a wrong password, a password to a server without
        # one): the configuration's error, raised rather than failed open.
        error = RequestRejected(f"the store refused the credentials: {exc}")
    elif isinstance(exc, redis.TimeoutError):
        error = StorageTimeout(f"the store did not answer in time: {exc}")
    elif isinstance(exc, (redis.ConnectionError, RedisClusterException)):
        # RedisClusterException: no reachable node, or a slot no node serves.
        error = StorageUnavailable(f"cannot reach the store: {exc}")
    elif isinstance(exc, redis.ResponseError):
        if isinstance(exc, OutOfMemoryError) or str(exc).startswith("OOM"):
            error = StorageFull(f"the store refused the write: {exc}")
        elif isinstance(exc, _STORE_STATE_CLASSES) or str(exc).startswith(_STORE_STATE_CODES):
            error = StorageResponseError(f"the store cannot serve the command: {exc}")
        else:
            error = RequestRejected(f"the store rejected the request: {exc}")
    elif isinstance(exc, redis.exceptions.InvalidResponse):
        # Not RESP: a proxy in the way, or a connection out of step. The store is unusable.
        error = StorageUnavailable(f"the store's reply could not be read: {exc}")
    else:
        # DataError and the like: redis-py refused our own call before sending it.
        error = RequestRejected(f"the store client refused the request: {exc!r}")
    error.__cause__ = exc
    return error


def as_timeout(exc: BaseException, seconds: float | None) -> redis.TimeoutError:
    """A socket-level timeout as redis-py's (a transport's own reads and writes)."""
    if isinstance(exc, redis.TimeoutError):
        return exc
    return redis.TimeoutError(f"no reply within {seconds} s")


def as_broken(exc: BaseException) -> redis.RedisError:
    """A socket error as redis-py's ConnectionError (a transport's own reads and writes)."""
    if isinstance(exc, redis.RedisError):
        return exc
    return redis.ConnectionError(f"Error talking to the server: {exc}")
