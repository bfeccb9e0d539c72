"""The embedded in-memory backend: the algorithms' pure-Python references on a local keyspace.

One lock serialises every call, as Redis serialises scripts, so it is exact under threads. The
asyncio flavour shares the implementation: a call never awaits while holding the lock.
"""

from __future__ import annotations

import threading

from .._algorithms import ALGORITHMS, decode_args, fleet, top
from .._algorithms.keyspace import Keyspace
from .._algorithms.scripts import Script
from .._model.clock import Clock, system_clock

__all__ = ["AsyncMemoryStorage", "MemoryStorage"]

_BY_SCRIPT = {algorithm.script: algorithm.reference for algorithm in ALGORITHMS.values()}
_BY_SCRIPT[fleet.SCRIPT] = fleet.reference  # the local_share="auto" heartbeat


class MemoryStorage:
    """Limiter state in this process. Expired keys are purged as time moves on; with
    ``max_keys``, the least recently written key goes when a new one would pass it."""

    def __init__(self, *, clock: Clock = system_clock, max_keys: int | None = None) -> None:
        self._clock = clock
        self._keyspace = Keyspace(max_keys)
        self._lock = threading.Lock()

    def _now(self) -> int:
        return int(self._clock() * 1_000_000)

    def run(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> list[int]:
        if script.name == top.SCRIPT:  # identities among its numbers: it reads ARGV raw
            with self._lock:
                now = self._now()
                self._keyspace.purge(now)
                return top.reference(self._keyspace, keys, args, now)  # type: ignore[return-value]
        reference = _BY_SCRIPT[script.name]
        with self._lock:
            decoded = decode_args(args, self._now())
            self._keyspace.purge(decoded.now)
            return reference(self._keyspace, keys, decoded)

    def delete(self, keys: tuple[str, ...]) -> int:
        with self._lock:
            self._keyspace.purge(self._now())  # an expired key is not one that existed
            return self._keyspace.delete(keys)

    def pttl(self, key: str) -> int:
        """Milliseconds ``key`` has left, or -2 (for tests and debugging)."""
        with self._lock:
            return self._keyspace.pttl(key, self._now())

    def __len__(self) -> int:
        with self._lock:
            return len(self._keyspace)

    def close(self) -> None:
        with self._lock:
            self._keyspace.clear()


class AsyncMemoryStorage:
    """The asyncio face of :class:`MemoryStorage`."""

    def __init__(self, *, clock: Clock = system_clock) -> None:
        self.sync = MemoryStorage(clock=clock)

    async def run(
        self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> list[int]:
        return self.sync.run(script, keys, args)

    async def delete(self, keys: tuple[str, ...]) -> int:
        return self.sync.delete(keys)

    async def close(self) -> None:
        self.sync.close()
