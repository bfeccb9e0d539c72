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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import (
    ConfigError,
    RequestRejected,
    StorageError,
    StorageResponseError,
    StorageTimeout,
    StorageUnavailable,
)
from .._scripts import Script

try:
    import redis
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.asyncio.retry
    import redis.asyncio.sentinel
    import redis.cluster
    import redis.sentinel
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
    """Map a redis-py error to ratekeeper's tree; the caller raises it ``from exc``."""
    if isinstance(exc, redis.TimeoutError):
        return StorageTimeout(f"the store did not answer in time: {exc}")
    if isinstance(exc, (redis.ConnectionError, RedisClusterException)):
        # RedisClusterException: no reachable node, or a slot no node serves.
        return StorageUnavailable(f"cannot reach the store: {exc}")
    if isinstance(exc, redis.ResponseError):
        if isinstance(exc, _STORE_STATE_CLASSES) or str(exc).startswith(_STORE_STATE_ERRORS):
            return StorageResponseError(f"the store cannot serve the command: {exc}")
        return RequestRejected(f"the store rejected the request: {exc}")
    return StorageError(f"store error: {exc}")


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
            info: Any = self.client.info("memory")  # a dict; redis-py types vary by version
            warning = eviction_warning(info)
        except CLIENT_ERRORS:  # INFO may be forbidden on a managed server
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
            raise ConfigError(f"invalid Redis URL or options {url!r}: {exc}") from exc
        return cls(client)

    def run(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> list[int]:
        if self._watch is not None and self._watch.due():
            self._watch.check()
        client = self.client
        try:
            try:
                reply = client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
            except NoScriptError:
                client.script_load(script.source)
                reply = client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
        except CLIENT_ERRORS as exc:
            raise _translate(exc) from exc
        if not self._checked_eviction:
            self._check_eviction()
        return reply  # type: ignore[no-any-return]

    def delete(self, keys: tuple[str, ...]) -> None:
        try:
            self.client.delete(*keys)
        except CLIENT_ERRORS as exc:
            raise _translate(exc) from exc

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        for other in self._also_close:
            other.close()


class AsyncRedisStorage:
    """Runs scripts on a ``redis.asyncio.Redis`` client."""

    def __init__(self, client: Any, *, also_close: tuple[Any, ...] = ()) -> None:
        self.client = client
        self._also_close = also_close  # the connections to the sentinels, if any
        self._checked_eviction = False
        # redis-py's asyncio cluster client breaks when many first calls race to discover the
        # cluster; the first call discovers it alone.
        self._ready = not isinstance(client, redis.asyncio.cluster.RedisCluster)
        self._ready_lock = asyncio.Lock()
        self._watch = _master_watch(client)

    async def _discover(self) -> None:
        async with self._ready_lock:
            if not self._ready:
                try:
                    await self.client.initialize()
                except CLIENT_ERRORS as exc:
                    raise _translate(exc) from exc
                self._ready = True

    async def _check_eviction(self) -> None:
        self._checked_eviction = True
        try:
            warning = eviction_warning(await self.client.info("memory"))
        except CLIENT_ERRORS:  # INFO may be forbidden on a managed server
            return
        if warning:
            log.warning("%s", warning)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> AsyncRedisStorage:
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
                return cls(client, also_close=tuple(sentinel.sentinels))
            else:
                client = redis.asyncio.Redis.from_url(url, **plan.kwargs)
        except (ValueError, TypeError, *CLIENT_ERRORS) as exc:
            raise ConfigError(f"invalid Redis URL or options {url!r}: {exc}") from exc
        return cls(client)

    async def run(
        self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> list[int]:
        if not self._ready:
            await self._discover()
        if self._watch is not None and self._watch.due():
            await self._watch.acheck()
        client = self.client
        try:
            try:
                reply = await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
            except NoScriptError:
                await client.script_load(script.source)
                reply = await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
        except CLIENT_ERRORS as exc:
            raise _translate(exc) from exc
        if not self._checked_eviction:
            await self._check_eviction()
        return reply  # type: ignore[no-any-return]

    async def delete(self, keys: tuple[str, ...]) -> None:
        if not self._ready:
            await self._discover()
        try:
            await self.client.delete(*keys)
        except CLIENT_ERRORS as exc:
            raise _translate(exc) from exc

    async def close(self) -> None:
        await self.client.aclose()
        for other in self._also_close:
            await other.aclose()
