"""Faults injected at the script-execution rule that every transport drives (``Exchange``), so
one seam reaches the blocking path, the asyncio pipeline and redis-py's command path alike."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from ratekeeper._storage.redis._exchange import Exchange


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
