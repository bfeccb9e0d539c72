"""Redis and Valkey through redis-py: scripts run by SHA, errors translated at the boundary.

Each decision is one EVALSHA. On NOSCRIPT (a restart, ``SCRIPT FLUSH``, a failover to a replica
with a cold cache) the script is loaded and the call retried once. A timeout is never retried:
the script may already have run. A broken connection is retried once on a fresh connection by
redis-py (``Retry`` below), which at worst counts a hit twice and never admits one too many.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from .._errors import (
    ConfigError,
    RequestRejected,
    StorageError,
    StorageResponseError,
    StorageTimeout,
    StorageUnavailable,
)
from .._scripts import Script
from ._batch import Batcher, Pending
from .base import redact

try:
    import redis
    import redis._parsers.hiredis
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.asyncio.retry
    import redis.asyncio.sentinel
    import redis.cluster
    import redis.sentinel
    from hiredis import pack_command as _hiredis_pack
    from redis.backoff import NoBackoff
    from redis.exceptions import (
        AskError,
        ClusterDownError,
        NoScriptError,
        OutOfMemoryError,
        ReadOnlyError,
        RedisClusterException,
        SlotNotCoveredError,
        TryAgainError,
    )
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigError(
        "Redis support needs the 'redis' extra: pip install 'ratekeeper[redis]'"
    ) from exc

#: hiredis's RESP encoder, several times faster than redis-py's asyncio one (its stub types the
#: argument as a 1-tuple).
pack_command = cast(Callable[[tuple[Any, ...]], bytes], _hiredis_pack)

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:  # redis-py depends on async-timeout there
    from async_timeout import timeout as _deadline  # type: ignore[import-not-found]

__all__ = [
    "AsyncRedisStorage",
    "RedisStorage",
    "client_options",
    "eviction_warning",
    "parse_multi_host",
]

log = logging.getLogger("ratekeeper")

#: Default seconds to wait for a reply, and for a new connection: a limiter answers fast or not
#: at all, and the failure mode decides then. Raise both for a distant or TLS store.
DEFAULT_TIMEOUT = 0.020
DEFAULT_CONNECT_TIMEOUT = 0.020

_OWN_OPTIONS = frozenset({"timeout", "connect_timeout", "max_connections", "redis_options"})


def client_options(options: dict[str, Any]) -> dict[str, Any]:
    """redis-py keyword arguments from limiter options; unknown options are a ConfigError."""
    unknown = set(options) - _OWN_OPTIONS
    if unknown:
        raise ConfigError(
            f"unknown option(s) for a Redis URL: {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(_OWN_OPTIONS))}, key_prefix, clock"
        )
    timeout = options.get("timeout", DEFAULT_TIMEOUT)
    connect_timeout = options.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
    for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": connect_timeout,
        "decode_responses": False,
    }
    if "max_connections" in options:
        kwargs["max_connections"] = options["max_connections"]
    extra = options.get("redis_options") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"redis_options must be a dict, got {type(extra).__name__}")
    kwargs.update(extra)
    return kwargs


#: Error replies about the store's state (it is full, read-only, loading, busy, resharding):
#: the failure mode applies. Any other error reply is about the request and is raised.
_STORE_STATE_ERRORS = (
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


# redis-py's cluster clients retry every command, timeouts included, after refreshing their slot
# table. A timed-out script may have run, so ours retry only what cannot have run.
_CLUSTER_RETRY = (redis.ConnectionError, ClusterDownError, SlotNotCoveredError)


class _Cluster(redis.cluster.RedisCluster):
    ERRORS_ALLOW_RETRY = _CLUSTER_RETRY  # type: ignore[assignment]


class _AsyncCluster(redis.asyncio.cluster.RedisCluster):
    ERRORS_ALLOW_RETRY = _CLUSTER_RETRY  # type: ignore[assignment]


def parse_multi_host(url: str) -> tuple[str, list[tuple[str, int]], dict[str, Any], str]:
    """Split ``scheme://[user[:password]@]host:port[,host:port...][/path][?query]``.

    Returns (scheme, [(host, port), ...], credentials and query options, path without '/').
    """
    from urllib.parse import parse_qsl, unquote, urlsplit

    scheme, rest = url.split("://", 1)
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:
        netloc, _, query = netloc.partition("?")
    options: dict[str, Any] = {}
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if password:
            options["password"] = unquote(password)
    hosts: list[tuple[str, int]] = []
    for item in netloc.split(","):
        parsed = urlsplit(f"//{item.strip()}")
        try:
            port = parsed.port
        except ValueError:
            port = None
        if not parsed.hostname or port is None:
            raise ConfigError(f"each host in {url!r} needs host:port, got {item!r}")
        hosts.append((parsed.hostname, port))
    for name, value in parse_qsl(query):
        options[name] = value
    return scheme.lower(), hosts, options, unquote(path)


def _cluster_kwargs(
    url: str, kwargs: dict[str, Any]
) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    scheme, hosts, options, path = parse_multi_host(url)
    if path:
        raise ConfigError(f"a cluster URL has no database or path: {url!r}")
    merged = {**kwargs, **options}
    if scheme.startswith(("rediss", "valkeys")):
        merged["ssl"] = True
    return hosts, merged


def _sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, dict[str, Any]]:
    scheme, hosts, options, path = parse_multi_host(url)
    service, _, db = path.partition("/")
    if not service:
        raise ConfigError(
            f"a sentinel URL names the service: redis+sentinel://host:port/name ({url!r})"
        )
    if db:
        options["db"] = int(db)
    if scheme.startswith(("rediss", "valkeys")):
        options["ssl"] = True
    return hosts, service, options


#: A broken connection is retried once on a fresh one; a timeout never is.
_RECONNECT = (redis.ConnectionError,)


@dataclass(frozen=True)
class _Plan:
    """How to build a client for a URL, the same for the sync and the asyncio client."""

    kind: str  # "single", "cluster" or "sentinel"
    kwargs: dict[str, Any]
    hosts: list[tuple[str, int]] = field(default_factory=list)
    service: str = ""

    @property
    def sentinel_kwargs(self) -> dict[str, Any]:
        """The options that also apply to the connections to the sentinels themselves."""
        return {k: v for k, v in self.kwargs.items() if k in _SENTINEL_OPTIONS}


def _plan(url: str, options: dict[str, Any], retry: Any) -> _Plan:
    kwargs = client_options(options)
    scheme = url.split("://", 1)[0].lower()
    if scheme.endswith("+cluster"):
        # The cluster client retries a command after refreshing its slot table; once, and
        # without back-off, so a decision stays near its deadline.
        hosts, merged = _cluster_kwargs(url, kwargs)
        merged.setdefault("retry", retry)
        return _Plan("cluster", merged, hosts)
    kwargs.setdefault("retry", retry)
    if scheme.endswith("+sentinel"):
        hosts, service, extra = _sentinel_parts(url)
        return _Plan("sentinel", {**kwargs, **extra}, hosts, service)
    return _Plan("single", kwargs)


#: Options that also apply to the connections to the sentinels themselves.
_SENTINEL_OPTIONS = frozenset(
    {"socket_timeout", "socket_connect_timeout", "username", "password", "ssl", "retry"}
)


#: redis-py's classes for error replies about the store's state: it strips their error code
#: from the message, so they are told apart by class, the rest by the code in the message.
_STORE_STATE_CLASSES = (
    OutOfMemoryError,
    ReadOnlyError,
    NoScriptError,
    ClusterDownError,  # and MasterDownError
    TryAgainError,
    AskError,  # and MovedError
)

#: Errors of the store's client library that ratekeeper translates.
CLIENT_ERRORS = (redis.RedisError, RedisClusterException)


def _translate(exc: Exception) -> StorageError | RequestRejected:
    """Map a redis-py error to ratekeeper's tree, with ``exc`` as its ``__cause__`` (also when
    it is handed to a waiting caller rather than raised here)."""
    error: StorageError | RequestRejected
    if isinstance(exc, redis.TimeoutError):
        error = StorageTimeout(f"the store did not answer in time: {exc}")
    elif isinstance(exc, (redis.ConnectionError, RedisClusterException)):
        # RedisClusterException: no reachable node, or a slot no node serves.
        error = StorageUnavailable(f"cannot reach the store: {exc}")
    elif isinstance(exc, redis.ResponseError):
        if isinstance(exc, _STORE_STATE_CLASSES) or str(exc).startswith(_STORE_STATE_ERRORS):
            error = StorageResponseError(f"the store cannot serve the command: {exc}")
        else:
            error = RequestRejected(f"the store rejected the request: {exc}")
    else:
        error = StorageError(f"store error: {exc}")
    error.__cause__ = exc
    return error


def eviction_warning(info: dict[str, Any]) -> str | None:
    """A warning when the server may evict limiter keys (from ``INFO memory``), else None.

    Every limiter key has a TTL, so ``volatile-*`` policies can evict them too: an evicted key
    is a silently reset limit. Only ``noeviction`` (or no ``maxmemory``) keeps them.
    """
    maxmemory = int(info.get("maxmemory", 0) or 0)
    policy = str(info.get("maxmemory_policy", "noeviction"))
    if maxmemory > 0 and policy != "noeviction":
        return (
            f"ratekeeper: the store has maxmemory={maxmemory} with maxmemory-policy={policy}: "
            "under memory pressure it may evict limiter keys (all of them have TTLs, so "
            "volatile-* policies too), which silently resets limits. Use noeviction and let "
            "the failure mode decide when the store is full."
        )
    return None


#: Seconds between two checks of which server Sentinel calls the primary.
MASTER_CHECK_INTERVAL = 1.0


class _MasterWatch:
    """Asks Sentinel for the primary at most once per interval; when it changed, redis-py drops
    the idle connections to the old one. Without this, connections opened before a failover
    keep writing to the old primary until Sentinel demotes it (seconds later), and those
    writes, admissions included, are lost."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.next_check = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + MASTER_CHECK_INTERVAL
        return True

    def check(self) -> None:
        # If no sentinel answers, the next command finds out on its own.
        with contextlib.suppress(*CLIENT_ERRORS):
            self.pool.get_master_address()

    async def acheck(self) -> None:
        with contextlib.suppress(*CLIENT_ERRORS):
            await self.pool.get_master_address()


def _master_watch(client: Any) -> _MasterWatch | None:
    pool = getattr(client, "connection_pool", None)
    if isinstance(
        pool, (redis.sentinel.SentinelConnectionPool, redis.asyncio.sentinel.SentinelConnectionPool)
    ):
        return _MasterWatch(pool)
    return None


class RedisStorage:
    """Runs scripts on a ``redis.Redis`` (or cluster, or sentinel-managed) client.

    ``connect`` builds the client on first use instead: redis-py's blocking cluster client
    contacts the cluster when it is built, and a limiter must be constructible (and decide by
    its failure mode) while the store is down.
    """

    def __init__(
        self,
        client: Any = None,
        *,
        connect: Callable[[], Any] | None = None,
        also_close: tuple[Any, ...] = (),
    ) -> None:
        if client is None and connect is None:
            raise ValueError("RedisStorage needs a client or a way to connect")
        self._client = client
        self._connect = connect
        self._also_close = also_close  # the connections to the sentinels, if any
        self._checked_eviction = False
        self._watch = _master_watch(client)
        # A plain client (one server, no Sentinel) takes the lean path.
        self._lean = (
            _Lean(client.connection_pool)
            if type(client) is redis.Redis and type(client.connection_pool) is redis.ConnectionPool
            else None
        )

    @property
    def client(self) -> Any:
        """The redis-py client, built on first use if need be."""
        if self._client is None:
            assert self._connect is not None
            try:
                self._client = self._connect()
            except CLIENT_ERRORS as exc:
                raise _translate(exc) from exc
        return self._client

    def _check_eviction(self) -> None:
        self._checked_eviction = True
        try:
            if self._lean is not None:  # on its own connection, not a second one from the pool
                info: Any = _parse_info(self._lean.execute(("INFO", "memory")))
            else:
                info = self.client.info("memory")  # a dict; redis-py types vary by version
            warning = eviction_warning(info)
        except (*CLIENT_ERRORS, StorageError, RequestRejected):  # INFO may be forbidden
            return
        if warning:
            log.warning("%s", warning)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStorage:
        try:
            plan = _plan(url, options, Retry(NoBackoff(), 1, supported_errors=_RECONNECT))
            if plan.kind == "cluster":
                nodes = [
                    redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]
                    for host, port in plan.hosts
                ]
                return cls(connect=lambda: _Cluster(startup_nodes=nodes, **plan.kwargs))
            if plan.kind == "sentinel":
                sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
                    plan.hosts, sentinel_kwargs=plan.sentinel_kwargs, **plan.kwargs
                )
                client = sentinel.master_for(plan.service, **plan.kwargs)  # type: ignore[no-untyped-call]
                return cls(client, also_close=tuple(sentinel.sentinels))
            client = redis.Redis.from_url(url, **plan.kwargs)
        except (ValueError, TypeError, *CLIENT_ERRORS) as exc:
            raise ConfigError(f"invalid Redis URL or options {redact(url)!r}: {exc}") from exc
        return cls(client)

    def run(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> list[int]:
        if self._lean is not None:
            reply = self._lean.run(script, keys, args)
        else:
            if self._watch is not None and self._watch.due():
                self._watch.check()
            reply = self._run_one(script, keys, args)
        if not self._checked_eviction:
            self._check_eviction()
        return reply

    def _run_one(
        self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> list[int]:
        """One call through redis-py's own command path (redirections, retries)."""
        client = self.client
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            try:
                reply = client.execute_command(*command)  # type: ignore[no-untyped-call]
            except NoScriptError:
                client.script_load(script.source)
                try:
                    reply = client.execute_command(*command)  # type: ignore[no-untyped-call]
                except NoScriptError:  # flushed again between the load and the call
                    evaluate = ("EVAL", script.source, *command[2:])
                    reply = client.execute_command(*evaluate)  # type: ignore[no-untyped-call]
        except CLIENT_ERRORS as exc:
            raise _translate(exc) from exc
        return reply  # type: ignore[no-any-return]

    def delete(self, keys: tuple[str, ...]) -> None:
        try:
            self.client.delete(*keys)
        except CLIENT_ERRORS as exc:
            raise _translate(exc) from exc

    def close(self) -> None:
        if self._lean is not None:
            self._lean.close()
        if self._client is not None:
            self._client.close()
        for other in self._also_close:
            other.close()


class _Lean:
    """The blocking fast path to one server: EVALSHA packed by hiredis, written to a connection
    kept for this purpose and read back through redis-py's parser.

    It skips what redis-py does per command and a limiter does not need: checking a pooled
    connection out and in (a lock and a readiness poll each time), the retry wrapper, response
    callbacks. Connections come from the client's pool, once, and are kept on a stack; a
    thread pops one, so threads never share a connection. A connection whose exchange did not
    end cleanly is disconnected before it goes back (it reconnects on its next use), so no
    stale reply can be read as another call's.
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.idle: list[Any] = []
        _LEAN.add(self)

    def run(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> list[int]:
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        return self.execute(command, script)  # type: ignore[no-any-return]

    def execute(self, command: tuple[Any, ...], script: Script | None = None) -> Any:
        """Run one command and return its reply; with ``script``, load it on NOSCRIPT and
        send the command once more. Errors are translated."""
        try:
            connection = self.idle.pop()
        except IndexError:
            try:
                connection = self.pool.get_connection()
            except CLIENT_ERRORS as exc:
                raise _translate(exc) from exc
        packed = [pack_command(command)]
        clean = False
        try:
            try:
                reply = _exchange(connection, packed)
            except redis.ConnectionError:
                # Broken (a restart, an idle timeout): once more on a fresh connection.
                connection.disconnect()
                reply = _exchange(connection, packed)
            if script is not None and isinstance(reply, NoScriptError):
                _exchange(connection, [pack_command(("SCRIPT", "LOAD", script.source))])
                reply = _exchange(connection, packed)
                if isinstance(reply, NoScriptError):  # flushed again between load and call
                    evaluate = pack_command(("EVAL", script.source, *command[2:]))
                    reply = _exchange(connection, [evaluate])
            clean = True
        except CLIENT_ERRORS as exc:
            raise _translate(exc) from exc
        finally:
            if not clean:
                connection.disconnect()
            self.idle.append(connection)
        if isinstance(reply, redis.ResponseError):
            raise _translate(reply) from reply
        return reply

    def close(self) -> None:
        idle, self.idle = self.idle, []
        for connection in idle:
            connection.disconnect()

    def forget(self) -> None:
        """In a forked child: the parent's sockets are not this process's to use."""
        self.idle = []


def _exchange(connection: Any, packed: list[bytes]) -> Any:
    """The reply, or the error reply as an exception object (not raised)."""
    if _KERNEL_TIMEOUTS and not isinstance(connection, redis.SSLConnection):
        if connection._sock is None:
            connection.connect()  # redis-py's handshake, under its own timeouts
        reader = getattr(connection._parser, "_reader", None)
        if reader is not None:
            return _exchange_raw(connection, reader, packed)
    connection.send_packed_command(packed, False)
    try:
        return connection.read_response()
    except redis.ResponseError as exc:
        return exc


#: Linux sockets time out in the kernel (SO_SNDTIMEO, SO_RCVTIMEO), so a blocking call makes
#: one syscall per send and per receive. A Python socket with a timeout polls before each.
_KERNEL_TIMEOUTS = sys.platform.startswith("linux")
#: What hiredis's reader returns while a reply is incomplete (redis-py >= 6 sets it; before, False).
_INCOMPLETE = getattr(redis._parsers.hiredis, "NOT_ENOUGH_DATA", False)


def _exchange_raw(connection: Any, reader: Any, packed: list[bytes]) -> Any:
    """``_exchange`` straight on the socket, read by the hiredis reader of redis-py's parser.

    The socket is made blocking with the connection's timeout set in the kernel: one ``send``
    and one ``recv`` per call instead of a ``poll`` before each, and half the hand-offs of the
    GIL between threads. A timeout raises redis-py's TimeoutError (never retried), a broken
    connection its ConnectionError.
    """
    sock = connection._sock
    state = connection.__dict__.get("_ratekeeper")
    if state is None or state[0] is not sock:
        timeout = connection.socket_timeout
        sock.settimeout(None)
        if timeout is not None:
            # (0, 0) would mean no timeout at all: never less than a microsecond.
            seconds, micros = divmod(max(1, round(timeout * 1_000_000)), 1_000_000)
            timeval = struct.pack("ll", seconds, micros)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        state = connection._ratekeeper = (sock, bytearray(65536))
    buffer = state[1]
    try:
        sock.sendall(packed[0] if len(packed) == 1 else b"".join(packed))
        reply = reader.gets()
        while reply is _INCOMPLETE:
            n = sock.recv_into(buffer)
            if n == 0:
                raise redis.ConnectionError("Connection closed by server.")
            reader.feed(buffer, 0, n)
            reply = reader.gets()
    except BlockingIOError:  # the kernel's timeout ran out (EAGAIN)
        raise redis.TimeoutError(f"no reply within {connection.socket_timeout} s") from None
    except OSError as exc:
        raise redis.ConnectionError(f"Error talking to the server: {exc}") from exc
    if isinstance(reply, redis.ConnectionError):
        raise reply
    return reply


def _parse_info(raw: bytes) -> dict[str, str]:
    """``INFO``'s ``name:value`` lines."""
    fields = {}
    for line in raw.decode(errors="replace").splitlines():
        name, sep, value = line.partition(":")
        if sep and not name.startswith("#"):
            fields[name] = value
    return fields


_LEAN: weakref.WeakSet[_Lean] = weakref.WeakSet()


def _forget_after_fork() -> None:
    for lean in list(_LEAN):
        lean.forget()


os.register_at_fork(after_in_child=_forget_after_fork)


class AsyncRedisStorage:
    """Runs scripts on a ``redis.asyncio.Redis`` client (or cluster, or sentinel-managed).

    Calls are auto-batched (see ``_batch``): those made while a round trip is in flight go out
    together in the next one, as a pipeline on one connection (in a cluster, one per node).
    ``batching=False`` sends each call on its own.
    """

    def __init__(
        self, client: Any, *, also_close: tuple[Any, ...] = (), batching: bool = True
    ) -> None:
        self.client = client
        self._also_close = also_close  # the connections to the sentinels, if any
        self._checked_eviction = False
        self._cluster = isinstance(client, redis.asyncio.cluster.RedisCluster)
        # redis-py's asyncio cluster client breaks when many first calls race to discover the
        # cluster; the first call discovers it alone.
        self._ready = not self._cluster
        self._ready_lock = asyncio.Lock()
        self._watch = _master_watch(client)
        self._batcher: Batcher | None = None
        # Batches to a plain server keep their connections instead of checking them in and out
        # of the pool each time (a lock, a readiness poll, a deprecation wrapper): at most one
        # per lane. Sentinel-managed pools are left alone: a master switch disconnects only the
        # connections checked in.
        self._keep = type(client) is redis.asyncio.Redis and (
            type(client.connection_pool) is redis.asyncio.ConnectionPool
        )
        self._kept: list[Any] = []
        self._kept_loop: asyncio.AbstractEventLoop | None = None
        if batching:
            send = self._send_cluster if self._cluster else self._send_single
            self._batcher = Batcher(send, lanes=BATCH_LANES)

    async def _discover(self) -> None:
        """(Re)discover the cluster, one caller at a time."""
        async with self._ready_lock:
            if self.client._initialize:  # set until discovered, and again after a topology error
                try:
                    await self.client.initialize()
                except CLIENT_ERRORS as exc:
                    raise _translate(exc) from exc
            self._ready = True

    async def _check_eviction(self) -> None:
        self._checked_eviction = True
        try:
            if self._kept and self._kept_loop is asyncio.get_running_loop():
                info: Any = await self._info_on_kept()  # not a second connection from the pool
            else:
                info = await self.client.info("memory")
            warning = eviction_warning(info)
        except CLIENT_ERRORS:  # INFO may be forbidden on a managed server
            return
        if warning:
            log.warning("%s", warning)

    async def _info_on_kept(self) -> dict[str, str]:
        connection = self._kept.pop()
        try:
            await connection.send_command("INFO", "memory")
            return _parse_info(await connection.read_response())
        except BaseException:
            await connection.disconnect()  # its reply may still be on the way
            raise
        finally:
            self._kept.append(connection)

    @classmethod
    def from_url(cls, url: str, *, batching: bool = True, **options: Any) -> AsyncRedisStorage:
        try:
            retry = redis.asyncio.retry.Retry(NoBackoff(), 1, supported_errors=_RECONNECT)
            plan = _plan(url, options, retry)
            if plan.kind == "cluster":
                nodes = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in plan.hosts]
                client: Any = _AsyncCluster(startup_nodes=nodes, **plan.kwargs)
            elif plan.kind == "sentinel":
                sentinel = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
                    plan.hosts, sentinel_kwargs=plan.sentinel_kwargs, **plan.kwargs
                )
                client = sentinel.master_for(plan.service, **plan.kwargs)
                return cls(client, also_close=tuple(sentinel.sentinels), batching=batching)
            else:
                client = redis.asyncio.Redis.from_url(url, **plan.kwargs)
        except (ValueError, TypeError, *CLIENT_ERRORS) as exc:
            raise ConfigError(f"invalid Redis URL or options {redact(url)!r}: {exc}") from exc
        return cls(client, batching=batching)

    async def run(
        self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> list[int]:
        if not self._ready:
            await self._discover()
        if self._watch is not None and self._watch.due():
            await self._watch.acheck()
        if self._batcher is not None:
            reply: list[int] = await self._batcher.submit(script, keys, args)
        else:
            reply = await self._run_one(script, keys, args)
        if not self._checked_eviction:
            await self._check_eviction()
        return reply

    async def _run_one(
        self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> list[int]:
        """One call through redis-py's own command path (redirections, retries)."""
        client = self.client
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            try:
                reply = await client.execute_command(*command)  # type: ignore[no-untyped-call]
            except NoScriptError:
                await client.script_load(script.source)
                try:
                    reply = await client.execute_command(*command)  # type: ignore[no-untyped-call]
                except NoScriptError:  # flushed again between the load and the call
                    evaluate = ("EVAL", script.source, *command[2:])
                    reply = await client.execute_command(*evaluate)  # type: ignore[no-untyped-call]
        except CLIENT_ERRORS as exc:
            raise _translate(exc) from exc
        return reply  # type: ignore[no-any-return]

    async def _send_single(self, batch: list[Pending]) -> None:
        pool = self.client.connection_pool
        connection = None
        if self._keep:
            loop = asyncio.get_running_loop()
            if self._kept_loop is not loop:  # connections belong to the loop that opened them
                await self._give_back()
                self._kept_loop = loop
            if self._kept:
                connection = self._kept.pop()
        if connection is None:
            try:
                connection = await pool.get_connection()
            except CLIENT_ERRORS as exc:
                _fail_all(batch, exc)
                return
        try:
            # A connection that broke or timed out was disconnected; it reconnects when next used.
            await _pipeline(connection, batch, retries=1, reroute=False)
        finally:
            if self._keep:
                self._kept.append(connection)
            else:
                await pool.release(connection)

    async def _give_back(self) -> None:
        kept, self._kept = self._kept, []
        for connection in kept:
            await self.client.connection_pool.release(connection)

    async def _send_cluster(self, batch: list[Pending]) -> None:
        """Group the calls by the node that serves their slot, one pipeline per node. Calls the
        grouping cannot place, or that meet a redirection or a broken connection, go through
        redis-py's cluster client one by one, which follows the cluster as it changes."""
        client = self.client
        if client._initialize:  # reset by redis-py after a topology error: discover again
            try:
                await self._discover()
            except (StorageError, RequestRejected) as exc:
                for call in batch:
                    call.fail(exc)
                return
        groups: dict[str, tuple[Any, list[Pending]]] = {}
        alone: list[Pending] = []
        for call in batch:
            try:
                node = client.get_node_from_key(call.keys[0])
            except CLIENT_ERRORS:
                node = None
            if node is None:
                alone.append(call)
            else:
                groups.setdefault(node.name, (node, []))[1].append(call)
        await asyncio.gather(
            *(self._send_node(node, calls) for node, calls in groups.values()),
            *(self._send_alone(call) for call in alone),
        )

    async def _send_node(self, node: Any, calls: list[Pending]) -> None:
        try:
            connection = node.acquire_connection()
        except CLIENT_ERRORS:  # the node's connections are all busy
            await asyncio.gather(*(self._send_alone(call) for call in calls))
            return
        try:
            rerouted = await _pipeline(connection, calls, retries=0, reroute=True)
        finally:
            if self.client.nodes_manager.nodes_cache.get(node.name) is node:
                _release_node_connection(node, connection)
            else:  # redis-py replaced the node meanwhile; nothing would close this one
                await connection.disconnect()
        if rerouted:
            await asyncio.gather(*(self._send_alone(call) for call in rerouted))

    async def _send_alone(self, call: Pending) -> None:
        try:
            call.resolve(await self._run_one(call.script, call.keys, call.args))
        except (StorageError, RequestRejected) as exc:
            call.fail(exc)

    async def delete(self, keys: tuple[str, ...]) -> None:
        if not self._ready:
            await self._discover()
        try:
            await self.client.delete(*keys)
        except CLIENT_ERRORS as exc:
            raise _translate(exc) from exc

    async def close(self) -> None:
        await self._give_back()
        await self.client.aclose()
        for other in self._also_close:
            await other.aclose()


#: Lanes of one asyncio storage's batcher: round trips in flight at once, each on its own
#: connection. Two keep the client and the server busy together; more only add round trips.
BATCH_LANES = 2

#: Error replies after which a call in a cluster batch is sent again through redis-py's cluster
#: client, which follows redirections and refreshes its slot table.
_REROUTE = (AskError, ClusterDownError, TryAgainError)


def _fail_all(calls: list[Pending], exc: Exception) -> None:
    error = _translate(exc)
    for call in calls:
        call.fail(error)


def _release_node_connection(node: Any, connection: Any) -> None:
    release = getattr(node, "release", None)  # redis-py < 6 had only the free list
    if release is not None:
        release(connection)
    else:
        node._free.append(connection)


async def _pipeline(
    connection: Any, calls: list[Pending], *, retries: int, reroute: bool
) -> list[Pending]:
    """Send ``calls`` as one pipeline on ``connection`` and settle each from its own reply.

    NOSCRIPT: the scripts are loaded and those calls sent once more. A broken connection: the
    calls without a reply are sent again on a fresh connection, ``retries`` times (as redis-py
    retries one call; at worst a hit counts twice, never one too few). A timeout fails every
    call without a reply: those scripts may have run, so they are never sent again.

    With ``reroute`` (a cluster), the calls that were redirected, or whose connection broke, are
    returned unsettled, for redis-py's cluster client to send.
    """
    rerouted: list[Pending] = []
    missing: list[Pending] = []
    read = 0
    try:
        await connection.send_packed_command(
            b"".join(
                [
                    pack_command(("EVALSHA", c.script.sha, len(c.keys), *c.keys, *c.args))
                    for c in calls
                ]
            ),
            False,
        )
        # One deadline for the whole batch; the replies are read straight from redis-py's
        # parser, which returns error replies as exception objects.
        parser = connection._parser
        async with _deadline(connection.socket_timeout):
            for call in calls:
                reply = await parser.read_response()
                read += 1
                if not isinstance(reply, redis.ResponseError):
                    call.resolve(reply)
                elif isinstance(reply, NoScriptError):
                    missing.append(call)
                elif reroute and isinstance(reply, _REROUTE):
                    rerouted.append(call)
                else:
                    call.fail(_translate(reply))
    except asyncio.CancelledError:
        await connection.disconnect()  # replies may still be on their way
        raise
    except (TimeoutError, redis.TimeoutError) as exc:  # before OSError, its base class
        await connection.disconnect()
        if not isinstance(exc, redis.TimeoutError):
            exc = redis.TimeoutError(f"no reply within {connection.socket_timeout} s")
        _fail_all(calls[read:] + missing, exc)
        return rerouted
    except (redis.ConnectionError, OSError) as exc:
        await connection.disconnect()
        unsettled = [c for c in calls[read:] if not c.future.done()] + missing
        if reroute:
            return rerouted + unsettled
        if retries > 0:
            return await _pipeline(connection, unsettled, retries=retries - 1, reroute=False)
        _fail_all(unsettled, exc)
        return []
    except CLIENT_ERRORS as exc:
        await connection.disconnect()
        _fail_all(calls[read:] + missing, exc)
        return rerouted
    if missing:
        try:
            for source in {c.script.source for c in missing}:
                await connection.send_packed_command(
                    connection.pack_command("SCRIPT", "LOAD", source), False
                )
                await connection.read_response()
        except CLIENT_ERRORS as exc:
            await connection.disconnect()
            _fail_all(missing, exc)
            return rerouted
        rerouted += await _pipeline(connection, missing, retries=0, reroute=reroute)
    return rerouted
