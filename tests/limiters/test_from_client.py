"""``Limiter.from_client`` / ``AsyncLimiter.from_client``: the user's own redis-py client.

Every client kind (one server, Sentinel-managed, cluster; blocking and asyncio, batched or not)
admits exactly the limit under concurrency and recovers from a flushed script cache; the
client's own configuration is used as it is, what it gives up is said once, and closing the
limiter leaves the client (the user's) open.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
import redis.sentinel

from ratekeeper import AsyncLimiter, CircuitBreaker, ConfigError, Limiter, Policy

from ..support.servers import RedisServer

LIMIT = 50
TIMEOUTS = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}


def _options() -> dict[str, Any]:
    return {
        "key_prefix": f"own-{uuid.uuid4().hex[:8]}",
        "failure_mode": "raise",
        "deny_cache": 0,
        "breaker": CircuitBreaker(slow_call=5.0),
    }


def _threads_admit_exactly(limiter: Limiter, policy: Policy, threads: int = 8) -> int:
    admitted = [0] * threads
    barrier = threading.Barrier(threads)

    def run(i: int) -> None:
        barrier.wait(30)
        for _ in range(20):
            admitted[i] += limiter.hit(policy, "shared").allowed

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    return sum(admitted)


def _sync_case(limiter: Limiter, flush: Any) -> None:
    policy = Policy("own", f"{LIMIT}/minute")
    assert limiter.hit(policy, "warm").remaining == LIMIT - 1
    flush()  # a cold script cache: reloaded, nothing surfaces
    assert _threads_admit_exactly(limiter, policy) == LIMIT
    assert not limiter.peek(policy, "shared").allowed


async def _async_case(limiter: AsyncLimiter, flush: Any) -> None:
    policy = Policy("own", f"{LIMIT}/minute")
    assert (await limiter.hit(policy, "warm")).remaining == LIMIT - 1
    flush()

    async def run() -> int:
        return sum([(await limiter.hit(policy, "shared")).allowed for _ in range(4)])

    assert sum(await asyncio.gather(*(run() for _ in range(64)))) == LIMIT
    assert not (await limiter.peek(policy, "shared")).allowed


def test_a_blocking_client(server: RedisServer) -> None:
    client = redis.Redis(host="127.0.0.1", port=server.port, **TIMEOUTS)
    try:
        limiter = Limiter.from_client(client, **_options())
        with server.client() as admin:
            _sync_case(limiter, admin.script_flush)
        limiter.close()
        assert client.ping()  # the user's client is still theirs, and open
        pool = client.connection_pool
        assert not pool._in_use_connections  # the limiter's connections went back
    finally:
        client.close()


def test_a_client_that_decodes_responses(server: RedisServer) -> None:
    client = redis.Redis(host="127.0.0.1", port=server.port, decode_responses=True, **TIMEOUTS)
    try:
        with Limiter.from_client(client, **_options()) as limiter, server.client() as admin:
            _sync_case(limiter, admin.script_flush)
    finally:
        client.close()


@pytest.mark.parametrize("batching", [True, False], ids=["batching", "no-batching"])
def test_an_asyncio_client(server: RedisServer, batching: bool) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis(host="127.0.0.1", port=server.port, **TIMEOUTS)
        try:
            limiter = AsyncLimiter.from_client(client, batching=batching, **_options())
            with server.client() as admin:
                await _async_case(limiter, admin.script_flush)
            await limiter.close()
            assert await client.ping()
        finally:
            await client.aclose()

    asyncio.run(main())


def test_a_sentinel_managed_client(sentinel_group: Any) -> None:
    sentinel = redis.sentinel.Sentinel(
        [("127.0.0.1", s.port) for s in sentinel_group.sentinels], **TIMEOUTS
    )
    client = sentinel.master_for("mymaster", **TIMEOUTS)
    try:
        with Limiter.from_client(client, **_options()) as limiter:
            _sync_case(limiter, client.script_flush)
    finally:
        client.close()
        for connection in sentinel.sentinels:
            connection.close()


def test_a_cluster_client(cluster: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ratekeeper")
    host, port = cluster.url.split("://", 1)[1].split(",")[0].split(":")
    client = redis.cluster.RedisCluster(host=host, port=int(port), **TIMEOUTS)
    try:
        with Limiter.from_client(client, **_options()) as limiter:
            _sync_case(limiter, cluster.flush_scripts)
        assert client.ping()
    finally:
        client.close()
    # redis-py's own cluster client resends after a timeout: said, once.
    (said,) = [r.getMessage() for r in caplog.records if "sends a command again" in r.getMessage()]
    assert "TimeoutError" in said


@pytest.mark.parametrize("batching", [True, False], ids=["batching", "no-batching"])
def test_an_asyncio_cluster_client(cluster: Any, batching: bool) -> None:
    host, port = cluster.url.split("://", 1)[1].split(",")[0].split(":")

    async def main() -> None:
        client = redis.asyncio.cluster.RedisCluster(host=host, port=int(port), **TIMEOUTS)
        try:
            async with AsyncLimiter.from_client(client, batching=batching, **_options()) as limiter:
                await _async_case(limiter, cluster.flush_scripts)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_what_a_client_gives_up_is_said(server: RedisServer, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="ratekeeper")
    client = redis.Redis(host="127.0.0.1", port=server.port)  # redis-py's defaults: no timeouts
    try:
        with Limiter.from_client(client, **_options()) as limiter:
            assert limiter.hit(Policy("own", "2/minute"), "a").allowed
    finally:
        client.close()
    said = [r.getMessage() for r in caplog.records]
    assert any("no socket_timeout" in m for m in said)
    assert any("no socket_connect_timeout" in m for m in said)


def test_the_wrong_kind_of_client_is_refused() -> None:
    blocking = redis.Redis(host="127.0.0.1", port=1)
    with pytest.raises(ConfigError, match=r"needs redis\.asyncio"):
        AsyncLimiter.from_client(blocking)
    with pytest.raises(ConfigError, match="got an asyncio client"):
        Limiter.from_client(redis.asyncio.Redis(host="127.0.0.1", port=1))
    with pytest.raises(ConfigError, match="got dict"):
        Limiter.from_client({"host": "127.0.0.1"})
    blocking.close()
