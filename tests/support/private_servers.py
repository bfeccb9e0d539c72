"""Private servers for tests that break them or need them quiet (not the shared session ones)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .servers import RedisServer, find_binaries


@contextlib.contextmanager
def private_servers() -> Iterator[dict[str, RedisServer]]:
    """One running private server per flavor found; all stopped on exit."""
    started: dict[str, RedisServer] = {}
    try:
        for binary in find_binaries():
            started[binary.flavor] = RedisServer(binary).start()
        yield started
    finally:
        for server in started.values():
            server.stop()
