"""Only store failures reach a failure mode: a bug reaches the caller, on every transport.

A ``TypeError`` is injected two ways: inside redis-py's connection (what an incompatible
redis-py release looks like), through ``redis_options={"connection_class": ...}``; and inside
the exchange every transport drives (what a bug of ours looks like). Either way the limiter,
with ``failure_mode="open"``, raises the ``TypeError`` itself: no request is allowed, or
denied, by a failure mode. Then the limiter works again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio

from ratekeeper import Decision, Policy
from ratekeeper._storage.redis._exchange import Exchange

from ..support.servers import RedisServer
from ..support.topologies import Driver


class Armed:
    """Whether the injected fault fires (one switch for every connection class below)."""

    on = False


class BrokenConnection(redis.Connection):
    def connect(self) -> None:
        if Armed.on:
            raise TypeError("injected: connect() takes 1 positional argument")
        super().connect()


class AsyncBrokenConnection(redis.asyncio.Connection):
    async def connect(self) -> None:
        if Armed.on:
            raise TypeError("injected: connect() takes 1 positional argument")
        await super().connect()


@pytest.fixture
def armed() -> Iterator[type[Armed]]:
    Armed.on = False
    yield Armed
    Armed.on = False


#: (api, limiter options) for one server, each transport: the blocking one, and the asyncio
#: pipeline with batching on and off.
SINGLE = {
    "sync": ("sync", {}),
    "async-batching": ("async", {"batching": True}),
    "async-no-batching": ("async", {"batching": False}),
}


def _options(api: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "key_prefix": f"bug-{uuid.uuid4().hex[:8]}",
        "failure_mode": "open",
        "timeout": 5.0,
        "connect_timeout": 5.0,
        **extra,
    }


@pytest.mark.parametrize("transport", list(SINGLE))
def test_a_type_error_in_redis_py_reaches_the_caller(
    server: RedisServer, transport: str, armed: type[Armed]
) -> None:
    api, extra = SINGLE[transport]
    connection_class = BrokenConnection if api == "sync" else AsyncBrokenConnection
    options = _options(api, {**extra, "redis_options": {"connection_class": connection_class}})
    policy = Policy("bug", "5/minute")
    with Driver(api, server.url, **options) as driver:
        armed.on = True
        for _ in range(3):
            with pytest.raises(TypeError, match="injected"):
                driver.hit(policy, "a")
        armed.on = False
        decision = driver.hit(policy, "a")
        assert isinstance(decision, Decision)
        assert not decision.degraded
        assert decision.remaining == 4  # nothing ran while the fault fired


def _arm_exchange(monkeypatch: pytest.MonkeyPatch, armed: type[Armed]) -> None:
    original = Exchange.replied

    def replied(self: Exchange, reply: Any) -> int:
        if armed.on:
            raise TypeError("injected: a bug in the exchange")
        return original(self, reply)

    monkeypatch.setattr(Exchange, "replied", replied)


def _a_bug_reaches_the_caller(
    url: str, api: str, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch, armed: type[Armed]
) -> None:
    _arm_exchange(monkeypatch, armed)
    policy = Policy("bug", "5/minute")
    with Driver(api, url, **_options(api, extra)) as driver:
        assert driver.hit(policy, "a").remaining == 4
        armed.on = True
        for _ in range(2):
            with pytest.raises(TypeError, match="injected"):
                driver.hit(policy, "a")
        armed.on = False
        decision = driver.hit(policy, "a")
        assert not decision.degraded
        # The two scripts ran before their replies met the bug: counted, and no reply of theirs
        # is read as this call's.
        assert decision.remaining == 1


@pytest.mark.parametrize("transport", list(SINGLE))
def test_a_bug_in_the_exchange_reaches_the_caller(
    server: RedisServer, transport: str, monkeypatch: pytest.MonkeyPatch, armed: type[Armed]
) -> None:
    api, extra = SINGLE[transport]
    _a_bug_reaches_the_caller(server.url, api, extra, monkeypatch, armed)


@pytest.mark.parametrize("transport", ["sync", "async-batching", "async-no-batching"])
def test_a_bug_in_the_exchange_reaches_the_caller_on_the_cluster(
    cluster: Any, transport: str, monkeypatch: pytest.MonkeyPatch, armed: type[Armed]
) -> None:
    """The cluster's transports: redis-py's command path, and per-node batches."""
    api, extra = SINGLE[transport]
    _a_bug_reaches_the_caller(cluster.url, api, extra, monkeypatch, armed)


@pytest.mark.parametrize("transport", ["sync", "async-batching"])
def test_a_bug_in_the_exchange_reaches_the_caller_through_sentinel(
    sentinel_group: Any, transport: str, monkeypatch: pytest.MonkeyPatch, armed: type[Armed]
) -> None:
    """Sentinel-managed pools: a connection checked out per call (or per batch)."""
    api, extra = SINGLE[transport]
    _a_bug_reaches_the_caller(sentinel_group.url, api, extra, monkeypatch, armed)
