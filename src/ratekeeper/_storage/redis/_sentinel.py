"""Following a Sentinel failover promptly: ask Sentinel for the primary at most once a second.

When the primary changed, redis-py drops the idle connections to the old one. Without this,
connections opened before a failover keep writing to the old primary until Sentinel demotes it
(seconds later), and those writes, admissions included, are lost.

redis-py internals: ``SentinelConnectionPool.get_master_address`` (sync and asyncio), which
disconnects the pool's idle connections when the address changed, in every supported version.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis.asyncio.sentinel
import redis.sentinel

from ._errors import CLIENT_ERRORS

__all__ = ["MASTER_CHECK_INTERVAL", "MasterWatch", "master_watch"]

#: Seconds between two checks of which server Sentinel calls the primary.
MASTER_CHECK_INTERVAL = 1.0


class MasterWatch:
    """Asks Sentinel for the primary at most once per interval."""

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


def master_watch(client: Any) -> MasterWatch | None:
    """A watch for a Sentinel-managed client, else None."""
    pool = getattr(client, "connection_pool", None)
    if isinstance(
        pool, (redis.sentinel.SentinelConnectionPool, redis.asyncio.sentinel.SentinelConnectionPool)
    ):
        return MasterWatch(pool)
    return None
