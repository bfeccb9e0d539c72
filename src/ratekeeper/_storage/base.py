"""The storage interface: run a script call, delete keys, close."""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import Protocol

from .._scripts import Script

__all__ = ["SENT", "AsyncStorage", "SyncStorage", "redact"]

#: When the current task's (or thread's) last store call began its last round trip
#: (``time.perf_counter()``), set by the storages where that differs from when the caller
#: asked, so that the limiter's breaker judges the store by its own time: not by a call's time
#: in a batching queue (a burst of thousands of calls from one ``asyncio.gather`` queues for as
#: long as the event loop takes to work through it), nor by a new connection's set-up
#: (connect, TLS, AUTH) or a script load before it.
SENT: ContextVar[float] = ContextVar("ratekeeper_store_sent", default=0.0)


class SyncStorage(Protocol):
    """A store that runs the limiter's scripts, blocking."""

    def run(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> list[int]:
        """Run ``script`` atomically with KEYS and ARGV; return its reply."""
        ...

    def delete(self, keys: tuple[str, ...]) -> int:
        """Delete keys (all in one cluster slot); how many of them existed."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class AsyncStorage(Protocol):
    """A store that runs the limiter's scripts on an asyncio event loop."""

    async def run(
        self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> list[int]:
        """Run ``script`` atomically with KEYS and ARGV; return its reply."""
        ...

    async def delete(self, keys: tuple[str, ...]) -> int:
        """Delete keys (all in one cluster slot); how many of them existed."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


_PASSWORD = re.compile(r"^([a-z0-9+.-]+://[^:@/]*):[^@/]*@", re.IGNORECASE)


def redact(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (for messages and logs)."""
    return _PASSWORD.sub(r"\1:***@", url)
