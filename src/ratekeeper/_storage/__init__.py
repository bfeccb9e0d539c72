"""Storages, and opening one from a URL.

``memory://``                  the embedded in-process backend
``redis://[[user]:pass@]host[:port][/db]``, ``rediss://...`` (TLS), ``unix:///path[?db=N]``
                               Redis or Valkey through redis-py
``redis+cluster://[[user]:pass@]host:port[,host:port...]``   Redis Cluster (``rediss+`` for TLS)
``redis+sentinel://[[user]:pass@]host:port[,host:port...]/service[/db]``   Sentinel
                               (``valkey`` may replace ``redis`` in every scheme)
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from .._model.clock import Clock, system_clock
from .._model.errors import ConfigError
from .base import AsyncStorage, SyncStorage
from .memory import AsyncMemoryStorage, MemoryStorage

__all__ = [
    "AsyncStorage",
    "SyncStorage",
    "open_async",
    "open_client_async",
    "open_client_sync",
    "open_sync",
]

_REDIS_SCHEMES = frozenset(
    {
        *("redis", "rediss", "unix", "valkey", "valkeys"),
        *("redis+cluster", "rediss+cluster", "valkey+cluster", "valkeys+cluster"),
        *("redis+sentinel", "rediss+sentinel", "valkey+sentinel", "valkeys+sentinel"),
    }
)


def _scheme(url: str) -> str:
    if not isinstance(url, str):
        raise ConfigError(f"storage URL must be a string, got {type(url).__name__}")
    scheme = urlsplit(url).scheme.lower()
    if scheme == "memory" or scheme in _REDIS_SCHEMES:
        return scheme
    raise ConfigError(
        f"unsupported storage URL {url!r}: use memory://, redis://, rediss://, unix://, "
        "redis+cluster://host:port[,host:port...] or redis+sentinel://host:port[,...]/service"
    )


def _redis_url(url: str, scheme: str) -> str:
    # valkey:// and valkeys:// are spelled redis:// and rediss:// for redis-py.
    if scheme.startswith("valkey"):
        return "redis" + url[len("valkey") :]
    return url


def _memory_clock(url: str, options: dict[str, Any], clock: Clock | None) -> Clock:
    if options:
        raise ConfigError(f"unknown option(s) for memory://: {', '.join(sorted(options))}")
    if urlsplit(url).netloc or urlsplit(url).path not in ("", "/"):
        raise ConfigError(f"memory:// takes no host or path, got {url!r}")
    return clock or system_clock


def open_sync(url: str, *, clock: Clock | None = None, **options: Any) -> SyncStorage:
    """A blocking storage for ``url``."""
    scheme = _scheme(url)
    if scheme == "memory":
        return MemoryStorage(clock=_memory_clock(url, options, clock))
    from .redis import RedisStorage

    return RedisStorage.from_url(_redis_url(url, scheme), **options)


def open_async(
    url: str, *, clock: Clock | None = None, batching: bool = True, **options: Any
) -> AsyncStorage:
    """An asyncio storage for ``url``. ``batching`` (Redis only; memory makes no round trips)
    coalesces concurrent calls into pipelined round trips."""
    scheme = _scheme(url)
    if not isinstance(batching, bool):
        raise ConfigError(f"batching must be True or False, got {batching!r}")
    if scheme == "memory":
        return AsyncMemoryStorage(clock=_memory_clock(url, options, clock))
    from .redis import AsyncRedisStorage

    return AsyncRedisStorage.from_url(_redis_url(url, scheme), batching=batching, **options)


def open_client_sync(client: Any) -> SyncStorage:
    """A blocking storage on the user's own redis-py client (``redis.Redis``, Sentinel-managed
    or not, or ``redis.cluster.RedisCluster``). The client stays the user's: closing the
    storage gives its connections back and leaves the client open."""
    from .redis import RedisStorage

    return RedisStorage.from_client(client)


def open_client_async(client: Any, *, batching: bool = True) -> AsyncStorage:
    """An asyncio storage on the user's own ``redis.asyncio.Redis`` or
    ``redis.asyncio.cluster.RedisCluster`` (see ``open_client_sync``)."""
    if not isinstance(batching, bool):
        raise ConfigError(f"batching must be True or False, got {batching!r}")
    from .redis import AsyncRedisStorage

    return AsyncRedisStorage.from_client(client, batching=batching)
