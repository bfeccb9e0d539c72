"""The storage interface: run a script call, delete keys, close."""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import Protocol

from .._algorithms.scripts import Script

__all__ = ["ROUND_TRIP", "AsyncStorage", "RoundTrip", "SyncStorage", "redact"]


class RoundTrip(Protocol):
    """The store's own time for a call: its last round trip (``time.perf_counter()``)."""

    #: When the last round trip began: the write (0.0 if the storage did not say).
    sent: float
    #: When its reply reached this process: the kernel's receive time where the transport
    #: reads it, else when it was read (0.0 if the storage did not say).
    answered: float


#: The current task's (or thread's) last store call, as the storages that can tell set it, so
#: that the limiter's breaker and metrics judge the store by its own time: not by a call's time
#: in a batching queue (a burst of thousands of calls from one ``asyncio.gather`` queues for as
#: long as the event loop takes to work through it), nor by a new connection's set-up
#: (connect, TLS, AUTH) or a script load before it, nor by the time its reply waited for a busy
#: event loop to read it and resume the caller. The guard reads it only for a call that took
#: longer than the breaker's ``slow_call`` (or failed), and only a round trip that began after
#: the call did (an older one is another call's).
ROUND_TRIP: ContextVar[RoundTrip | None] = ContextVar("ratekeeper_round_trip", default=None)


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
