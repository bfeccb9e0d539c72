"""An in-process keyspace with per-key TTLs: the memory backend's stand-in for a Redis server.

Not thread-safe on its own; the memory storage serialises access with a lock, as Redis
serialises scripts. Expired keys are dropped lazily on access and purged in bulk by ``purge``,
so memory stays bounded by the keys that are live; with ``max_keys``, also by a count: a new
key past it evicts the least recently written one (the ``local`` failure mode's bound).
"""

from __future__ import annotations

import heapq
from typing import Any

__all__ = ["Keyspace"]


class Keyspace:
    """A dict of key -> value where every key has an expiry time in microseconds."""

    __slots__ = ("_data", "_heap", "max_keys")

    def __init__(self, max_keys: int | None = None) -> None:
        self._data: dict[str, tuple[Any, int]] = {}
        self._heap: list[tuple[int, str]] = []
        self.max_keys = max_keys

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str, now_us: int) -> Any:
        """The value of ``key``, or None if it is missing or expired."""
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] <= now_us:
            del self._data[key]
            return None
        return item[0]

    def set(self, key: str, value: Any, ttl_ms: int, now_us: int) -> None:
        """Store ``value`` under ``key``, expiring ``ttl_ms`` milliseconds after ``now_us``."""
        expires = now_us + ttl_ms * 1000
        data = self._data
        # With max_keys, least recently written first: a write moves its key to the end.
        if self.max_keys is not None and data.pop(key, None) is None and len(data) >= self.max_keys:
            del data[next(iter(data))]
        data[key] = (value, expires)
        heapq.heappush(self._heap, (expires, key))
        if len(self._heap) > 2 * len(self._data) + 1024:
            self._heap = [(exp, k) for k, (_, exp) in self._data.items()]
            heapq.heapify(self._heap)

    def pttl(self, key: str, now_us: int) -> int:
        """Milliseconds ``key`` has left, -2 if it does not exist (as Redis PTTL)."""
        item = self._data.get(key)
        if item is None or item[1] <= now_us:
            return -2
        return -(-(item[1] - now_us) // 1000)

    def delete(self, keys: tuple[str, ...] | list[str]) -> int:
        """Delete keys; return how many existed."""
        return sum(self._data.pop(key, None) is not None for key in keys)

    def purge(self, now_us: int) -> None:
        """Drop every key that has expired by ``now_us``."""
        heap, data = self._heap, self._data
        while heap and heap[0][0] <= now_us:
            expires, key = heapq.heappop(heap)
            item = data.get(key)
            if item is not None and item[1] == expires:
                del data[key]

    def clear(self) -> None:
        self._data.clear()
        self._heap.clear()
