"""The redis-py and hiredis versions ratekeeper supports, and every switch between them.

``check_versions`` refuses an unsupported combination in one line that names the versions; it
runs when a Redis storage is opened. The switches below are the only places where the code
depends on which supported version is installed.

redis-py internals: ``ConnectionPool.get_connection`` (sync and asyncio; the command name it
required before 5.3 is deprecated after), ``ClusterNode.release`` (asyncio; before 6.2 only
the free list ``_free``), ``redis.utils.HIREDIS_AVAILABLE`` (whether redis-py uses the
installed hiredis), the cluster clients' ``cluster_error_retry_attempts`` (before 6.0; after,
their ``retry``). Each switch is one "older than" threshold, so CI's two extra environments,
the floor below and the newest release, take every branch of every switch (the main one runs
the newest release the test tools allow). Tested from redis-py 5.0.1 to 8.1.0.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import hiredis
import redis
import redis.asyncio
import redis.utils

from ..._model.errors import ConfigError

__all__ = [
    "CLUSTER_OPTIONS",
    "MIN_HIREDIS",
    "MIN_REDIS",
    "aget_connection",
    "check_versions",
    "get_connection",
    "release_node_connection",
]

#: The oldest releases that pass the contract, recovery and exactness suites (CI runs them).
#: redis-py 5.0.0 has no ``aclose``; redis-py 6.2 and later ignore a hiredis older than 3.2.
MIN_REDIS = (5, 0, 1)
MIN_HIREDIS = (3, 2, 0)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


_REDIS = _version(redis.__version__)


def check_versions() -> None:
    """Raise a one-line ConfigError when redis-py or hiredis is older than supported, or when
    redis-py does not use the installed hiredis."""
    found = (redis.__version__, getattr(hiredis, "__version__", "0"))
    wanted = f"redis>={_dotted(MIN_REDIS)} and hiredis>={_dotted(MIN_HIREDIS)}"
    if _version(found[0]) < MIN_REDIS or _version(found[1]) < MIN_HIREDIS:
        raise ConfigError(
            f"ratekeeper needs {wanted}; found redis {found[0]} and hiredis {found[1]}: "
            "pip install -U 'ratekeeper[redis]'"
        )
    if not getattr(redis.utils, "HIREDIS_AVAILABLE", False):
        raise ConfigError(
            f"redis-py {found[0]} does not use hiredis {found[1]}; ratekeeper needs {wanted} "
            "with redis-py's hiredis parser: pip install -U 'ratekeeper[redis]'"
        )


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


#: Extra options for the cluster clients: before 6.0 redis-py retries a cluster error three
#: times (with sleeps) unless told otherwise; from 6.0 the ``retry`` we pass says once, and
#: that option is deprecated.
CLUSTER_OPTIONS: dict[str, Any] = {"cluster_error_retry_attempts": 1} if _REDIS < (6, 0) else {}


def _needs_name(method: Any) -> bool:
    parameter = inspect.signature(method).parameters.get("command_name")
    return parameter is not None and parameter.default is inspect.Parameter.empty


_SYNC_NEEDS_NAME = _needs_name(redis.ConnectionPool.get_connection)
_ASYNC_NEEDS_NAME = _needs_name(redis.asyncio.ConnectionPool.get_connection)


def get_connection(pool: Any) -> Any:
    """A connection checked out of a blocking pool, connected."""
    return pool.get_connection("EVALSHA") if _SYNC_NEEDS_NAME else pool.get_connection()


async def aget_connection(pool: Any) -> Any:
    """A connection checked out of an asyncio pool, connected."""
    if _ASYNC_NEEDS_NAME:
        return await pool.get_connection("EVALSHA")
    return await pool.get_connection()


def release_node_connection(node: Any, connection: Any) -> None:
    """Give a connection back to an asyncio cluster node (``release`` from redis-py 6.2)."""
    release = getattr(node, "release", None)
    if release is not None:
        release(connection)
    else:
        node._free.append(connection)
