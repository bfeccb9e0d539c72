"""Configuration: limiter options and storage URLs turned into redis-py clients, and a user's own
client checked before it is used (``adopt_client``).

``plan`` validates the options and parses the URL once, the same for the blocking and the
asyncio client; ``sync_client`` and ``async_client`` build the client it describes. Every
mistake is a ``ConfigError`` that names the option or the URL (its password hidden).

redis-py internals: none; public constructors only (one option differs by version: see
``_compat.CLUSTER_OPTIONS``). The cluster clients are subclassed to
narrow ``ERRORS_ALLOW_RETRY`` (a class attribute in every supported version): redis-py would
retry a timed-out or broken call, which may have run.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, SlotNotCoveredError
from redis.retry import Retry

from ..._model.errors import ConfigError
from ..base import redact
from ._compat import CLUSTER_OPTIONS
from ._errors import CLIENT_ERRORS
from ._sentinel import AsyncNewestSentinel, NewestSentinel

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "Plan",
    "adopt_client",
    "async_client",
    "client_options",
    "parse_multi_host",
    "plan",
    "sync_client",
]

#: Default seconds to wait for a reply, and for a new connection: a limiter answers fast or not
#: at all, and the failure mode decides then. Raise both for a distant or TLS store.
DEFAULT_TIMEOUT = 0.020
DEFAULT_CONNECT_TIMEOUT = 0.020

log = logging.getLogger("ratekeeper")

_OWN_OPTIONS = frozenset({"timeout", "connect_timeout", "max_connections", "redis_options"})

#: Options that also apply to the connections to the sentinels themselves.
_SENTINEL_OPTIONS = frozenset(
    {"socket_timeout", "socket_connect_timeout", "username", "password", "ssl", "retry"}
)

#: Errors after which redis-py's cluster client sends a command again, having refreshed its slot
#: table: only those that say the command did not run. Its default list has ConnectionError and
#: TimeoutError too, after which a script may have run.
_CLUSTER_RETRY = (ClusterDownError, SlotNotCoveredError)


#: redis-py's own retry, for what it sends itself: a connection it could not open, and a command
#: other than a script (a reset's DEL, safe to repeat) whose connection broke, are tried once
#: more at once. Never a timeout: a server that does not answer is not asked twice.
_RECONNECT = (redis.ConnectionError,)


class _Cluster(redis.cluster.RedisCluster):
    ERRORS_ALLOW_RETRY = _CLUSTER_RETRY  # type: ignore[assignment]


class _AsyncCluster(redis.asyncio.cluster.RedisCluster):
    ERRORS_ALLOW_RETRY = _CLUSTER_RETRY  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nodes_manager.__class__ = _KeepingNodes


#: Disconnections of nodes a new slot map no longer names, under way (kept from the collector).
_CLOSING: set[asyncio.Future[Any]] = set()


class _KeepingNodes(redis.asyncio.cluster.NodesManager):
    """redis-py's asyncio ``NodesManager`` keeping the node objects it has (and their
    connections, in-flight calls included) for the nodes a new slot map still names: redis-py
    < 7 replaces each with a new object and disconnects the old, so that learning where one dead
    primary's slots went broke every healthy primary's calls in flight. Nodes no longer named
    are dropped and disconnected, as redis-py does. Assigned as the class of our own clients'
    manager (no slot of its own: the layout is redis-py's)."""

    __slots__ = ()

    def set_nodes(self, old: Any, new: Any, remove_old: bool = False) -> None:
        if remove_old:
            for name in [name for name in old if name not in new]:
                task = asyncio.ensure_future(old.pop(name).disconnect())
                _CLOSING.add(task)
                task.add_done_callback(_CLOSING.discard)
        for name, node in new.items():
            old.setdefault(name, node)


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


def parse_multi_host(url: str) -> tuple[str, list[tuple[str, int]], dict[str, Any], str]:
    """Split ``scheme://[user[:password]@]host:port[,host:port...][/path][?query]``.

    Returns (scheme, [(host, port), ...], credentials and query options, path without '/').
    """
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


@dataclass(frozen=True)
class Plan:
    """How to build a client for a URL, the same for the sync and the asyncio client."""

    url: str
    kind: str  # "single", "cluster" or "sentinel"
    kwargs: dict[str, Any]
    hosts: list[tuple[str, int]] = field(default_factory=list)
    service: str = ""

    @property
    def sentinel_kwargs(self) -> dict[str, Any]:
        """The options that also apply to the connections to the sentinels themselves."""
        return {k: v for k, v in self.kwargs.items() if k in _SENTINEL_OPTIONS}


def plan(url: str, options: dict[str, Any]) -> Plan:
    """Parse ``url`` and check ``options``, without connecting."""
    kwargs = client_options(options)
    scheme = url.split("://", 1)[0].lower()
    if not scheme.endswith(("+cluster", "+sentinel")):
        return Plan(url, "single", kwargs)  # redis-py parses a one-server URL itself
    _, hosts, extra, path = parse_multi_host(url)
    if scheme.startswith(("rediss", "valkeys")):
        extra["ssl"] = True
    if scheme.endswith("+cluster"):
        if path:
            raise ConfigError(f"a cluster URL has no database or path: {redact(url)!r}")
        return Plan(url, "cluster", {**kwargs, **extra}, hosts)
    service, _, db = path.partition("/")
    if not service:
        raise ConfigError(
            f"a sentinel URL names the service: redis+sentinel://host:port/name ({redact(url)!r})"
        )
    if db:
        if not (db.isascii() and db.isdigit()):
            raise ConfigError(f"a sentinel URL's database is a number, got {db!r}")
        extra["db"] = int(db)
    return Plan(url, "sentinel", {**kwargs, **extra}, hosts, service)


def _invalid(url: str, exc: Exception) -> ConfigError:
    return ConfigError(f"invalid Redis URL or options {redact(url)!r}: {exc}")


def sync_client(built: Plan) -> tuple[Any, Callable[[], Any] | None, tuple[Any, ...]]:
    """(client, or None with a way to connect on first use, the sentinel clients to close).

    A cluster client is built on first use: redis-py's blocking one contacts the cluster when
    it is built, and a limiter must be constructible (and decide by its failure mode) while
    the store is down.
    """
    kwargs = dict(built.kwargs)
    kwargs.setdefault("retry", Retry(NoBackoff(), 1, supported_errors=_RECONNECT))
    try:
        if built.kind == "cluster":
            nodes = [
                redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]
                for host, port in built.hosts
            ]
            return None, lambda: _Cluster(startup_nodes=nodes, **{**CLUSTER_OPTIONS, **kwargs}), ()
        if built.kind == "sentinel":
            sentinel = NewestSentinel(  # type: ignore[no-untyped-call]
                built.hosts, sentinel_kwargs=built.sentinel_kwargs, **kwargs
            )
            client = sentinel.master_for(built.service, **kwargs)  # type: ignore[no-untyped-call]
            return client, None, tuple(sentinel.sentinels)
        return redis.Redis.from_url(built.url, **kwargs), None, ()
    except (ValueError, TypeError, *CLIENT_ERRORS) as exc:
        raise _invalid(built.url, exc) from exc


def async_client(built: Plan) -> tuple[Any, tuple[Any, ...]]:
    """(client, the sentinel clients to close). Nothing connects before first use."""
    kwargs = dict(built.kwargs)
    kwargs.setdefault(
        "retry", redis.asyncio.retry.Retry(NoBackoff(), 1, supported_errors=_RECONNECT)
    )
    try:
        if built.kind == "cluster":
            nodes = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in built.hosts]
            return _AsyncCluster(startup_nodes=nodes, **{**CLUSTER_OPTIONS, **kwargs}), ()
        if built.kind == "sentinel":
            sentinel = AsyncNewestSentinel(  # type: ignore[no-untyped-call]
                built.hosts, sentinel_kwargs=built.sentinel_kwargs, **kwargs
            )
            return sentinel.master_for(built.service, **kwargs), tuple(sentinel.sentinels)
        return redis.asyncio.Redis.from_url(built.url, **kwargs), ()
    except (ValueError, TypeError, *CLIENT_ERRORS) as exc:
        raise _invalid(built.url, exc) from exc


_SYNC_CLIENTS = (redis.Redis, redis.cluster.RedisCluster)
_ASYNC_CLIENTS = (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster)


def adopt_client(client: Any, *, asyncio: bool) -> list[str]:
    """Check a client the user built: the right kind (a ConfigError otherwise), and which of
    ratekeeper's guarantees its configuration gives up. Each of those is logged once, as a
    warning, and returned; the client is used as it is, never reconfigured."""
    wanted, other = (_ASYNC_CLIENTS, _SYNC_CLIENTS) if asyncio else (_SYNC_CLIENTS, _ASYNC_CLIENTS)
    api = "AsyncLimiter" if asyncio else "Limiter"
    if not isinstance(client, wanted):
        if isinstance(client, other):
            kind = "a blocking" if asyncio else "an asyncio"
            raise ConfigError(f"{api}.from_client needs {_kinds(wanted)}, got {kind} client")
        module = type(client).__module__.split(".")[0]
        hint = (
            "; ratekeeper speaks to Valkey through redis-py: redis.Redis works with Valkey"
            if module == "valkey"
            else ""
        )
        raise ConfigError(
            f"{api}.from_client needs {_kinds(wanted)}, got {type(client).__qualname__}{hint}"
        )
    given_up = []
    kwargs = _connection_kwargs(client)
    for name, what in (
        ("socket_timeout", "a decision can wait as long as the store takes to answer"),
        ("socket_connect_timeout", "a decision can wait as long as a connection takes to open"),
    ):
        if kwargs.get(name) is None:
            given_up.append(f"the client has no {name}: {what}")
    if isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster)):
        resent = {redis.TimeoutError, redis.ConnectionError} & set(type(client).ERRORS_ALLOW_RETRY)
        if resent:
            names = ", ".join(sorted(error.__name__ for error in resent))
            given_up.append(
                f"redis-py's cluster client sends a command again after {names}, when the "
                "script may have run: a hit can count twice (a ratekeeper redis+cluster:// URL "
                "does not)"
            )
    for warning in given_up:
        log.warning("ratekeeper: %s.from_client: %s", api, warning)
    return given_up


def _kinds(classes: tuple[type, ...]) -> str:
    return " or ".join(f"{c.__module__}.{c.__qualname__}" for c in classes)


def _connection_kwargs(client: Any) -> dict[str, Any]:
    """The options the client's connections are made with (a pool's, or a cluster's)."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return dict(pool.connection_kwargs)
    manager = getattr(client, "nodes_manager", None)
    if manager is not None and isinstance(getattr(manager, "connection_kwargs", None), dict):
        return dict(manager.connection_kwargs)
    return dict(getattr(client, "connection_kwargs", {}))
