"""The redis-py and hiredis versions ratekeeper supports, and every switch between them.

``check_versions`` refuses an unsupported combination in one line that names the versions; it
runs when a Redis storage is opened. The switches below are the only places where the code
depends on which supported version is installed.

redis-py internals: ``ConnectionPool.get_connection`` (sync and asyncio; the command name it
required before 5.3 is deprecated after), ``ClusterNode.release`` (asyncio; before 6 only the
free list ``_free``), ``redis._parsers.hiredis.NOT_ENOUGH_DATA``. Tested against the floor
below and the newest release (CI runs both).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import hiredis
import redis
import redis._parsers.hiredis
import redis.asyncio

from ..._errors import ConfigError

__all__ = [
    "INCOMPLETE",
    "MIN_HIREDIS",
    "MIN_REDIS",
    "aget_connection",
    "check_versions",
    "get_connection",
    "release_node_connection",
]

#: The oldest releases that pass the contract, recovery and exactness suites (CI runs them).
MIN_REDIS = (5, 0, 1)
MIN_HIREDIS = (2, 3, 0)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def check_versions() -> None:
    """Raise a one-line ConfigError when redis-py or hiredis is older than supported."""
    found = (redis.__version__, getattr(hiredis, "__version__", "0"))
    if _version(found[0]) < MIN_REDIS or _version(found[1]) < MIN_HIREDIS:
        raise ConfigError(
            f"ratekeeper needs redis>={'.'.join(map(str, MIN_REDIS))} and "
            f"hiredis>={'.'.join(map(str, MIN_HIREDIS))}; found redis {found[0]} and "
            f"hiredis {found[1]}: pip install -U 'ratekeeper[redis]'"
        )


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
    """Give a connection back to an asyncio cluster node."""
    release = getattr(node, "release", None)
    if release is not None:
        release(connection)
    else:
        node._free.append(connection)


#: What hiredis's reader returns while a reply is incomplete: redis-py >= 6 asks for a sentinel
#: object, older releases get False.
INCOMPLETE: Any = getattr(redis._parsers.hiredis, "NOT_ENOUGH_DATA", False)
