"""Faults injected at the script-execution rule that every transport drives (``Exchange``), so
one seam reaches the blocking path, the asyncio pipeline and redis-py's command path alike."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import redis.asyncio.connection

from ratekeeper._storage.redis._exchange import Exchange
from ratekeeper._storage.redis._protocol import Link


def flush_after_every_load(monkeypatch: pytest.MonkeyPatch, client: redis.Redis) -> None:
    """SCRIPT FLUSH (with ``client``) right after each NOSCRIPT recovery's SCRIPT LOAD is
    answered, before the EVALSHA that follows it goes out: another process flushing in a loop,
    at the worst moment."""
    original = Exchange.replied

    def replied(self: Exchange, reply: Any) -> int:
        loaded = self.loading and not isinstance(reply, Exception)
        step = original(self, reply)
        if loaded:
            client.script_flush()
        return step

    monkeypatch.setattr(Exchange, "replied", replied)


EVALSHA = b"$7\r\nEVALSHA\r\n"


class Wire:
    """Counts what asyncio connections write: sends, and the EVALSHAs in them, per port (on
    ratekeeper's own links to one server, and on redis-py's connections to a cluster)."""

    def __init__(self) -> None:
        self.sends: list[tuple[int, int]] = []  # (port, EVALSHA commands in the send)

    def record(self, port: int, packed: Any) -> None:
        data = packed if isinstance(packed, bytes) else b"".join(packed)
        if EVALSHA in data:
            self.sends.append((port, data.count(EVALSHA)))

    def clear(self) -> None:
        self.sends.clear()

    @property
    def commands(self) -> int:
        return sum(count for _, count in self.sends)


def spy_on_the_wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    """Count the EVALSHAs in every asyncio write: ratekeeper's own links and redis-py's
    connections (clusters, Sentinel, from_client)."""
    seen = Wire()
    original = redis.asyncio.connection.AbstractConnection.send_packed_command

    async def spy(self: Any, command: Any, check_health: bool = True) -> None:
        seen.record(self.port, command)
        await original(self, command, check_health)

    monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", spy)
    send = Link.send

    def link_spy(self: Link, packed: bytes, *args: Any, **kwargs: Any) -> Any:
        seen.record(self.sock.getpeername()[1], packed)
        return send(self, packed, *args, **kwargs)

    monkeypatch.setattr(Link, "send", link_spy)
    return seen
