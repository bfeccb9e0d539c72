"""The storage interface: run a script call, delete keys, close."""

from __future__ import annotations

from typing import Protocol

from .._scripts import Script

__all__ = ["AsyncStorage", "SyncStorage"]


class SyncStorage(Protocol):
    """A store that runs the limiter's scripts, blocking."""

    def run(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> list[int]:
        """Run ``script`` atomically with KEYS and ARGV; return its reply."""
        ...

    def delete(self, keys: tuple[str, ...]) -> None:
        """Delete keys (all in one cluster slot)."""
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

    async def delete(self, keys: tuple[str, ...]) -> None:
        """Delete keys (all in one cluster slot)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
