"""Redis and Valkey through redis-py: every script call is one ``Exchange``, whatever carries it.

One job per module:

=================  =============================================================================
``_config``        options and URLs turned into redis-py clients (one server, Sentinel, Cluster)
``_compat``        the supported redis-py and hiredis versions, and every switch between them
``_errors``        redis-py's errors and error replies mapped onto ratekeeper's tree
``_exchange``      running one script call, without I/O: EVALSHA, NOSCRIPT, resend, classify
``_wire``          what the transports share: rounds packed, replies read, idle sockets checked
``_blocking``      the blocking transport to one server
``_pipeline``      the asyncio pipeline: many exchanges over one redis-py connection
``_link``          one of ratekeeper's own asyncio connections, its replies stamped on arrival
``_connect``       opening one by a deadline that the kernel's view decides, not the loop's
``_protocol``      the pool of those links to one server, and the exchanges driven over them
``_batch``         auto-batching of asyncio calls into pipelines
``_command``       redis-py's command path (clusters)
``_sentinel``      following a Sentinel failover
``_eviction``      the check of the server's eviction policy
``_sync``          ``RedisStorage``, the blocking storage
``_async``         ``AsyncRedisStorage``, the asyncio storage
=================  =============================================================================

Each module's opening comment says which redis-py internals it touches; ``_compat`` holds every
switch between versions. CI runs the storage suites on redis-py 5.0.1 with hiredis 3.2 (the
floor), on the newest release (8.1.0 when this was written) and on the newest the test tools
allow (7.4.1).
"""

from __future__ import annotations

try:
    import hiredis  # noqa: F401
    import redis  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from ..._model.errors import ConfigError

    raise ConfigError(
        "Redis support needs the 'redis' extra: pip install 'ratekeeper[redis]'"
    ) from exc

from ._async import BATCH_LANES, AsyncRedisStorage
from ._config import client_options, parse_multi_host
from ._eviction import eviction_warning
from ._sync import RedisStorage

__all__ = [
    "BATCH_LANES",
    "AsyncRedisStorage",
    "RedisStorage",
    "client_options",
    "eviction_warning",
    "parse_multi_host",
]
