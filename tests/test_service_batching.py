"""The service decides through ``AsyncLimiter`` with batching: the descriptors of one request,
and RPCs in flight together, share round trips to the store (counted on the wire, as in
tests/test_batching.py).

Batching has no timer: a call goes out at the event loop's next turn, and calls that come while
a round trip is on the wire go together in the next one. On loopback, Redis answers faster than
grpc.aio hands over the next RPC, so RPCs mostly go one by one (nothing to share, no latency
added); with a store 50 ms away (a delaying proxy), RPCs that overlap share round trips."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio.connection

from .delay_proxy import DelayProxy
from .servers import RedisServer
from .service_support import OURS, running, write

EVALSHA = b"$7\r\nEVALSHA\r\n"

CONFIG = """\
domain: batch
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000}
"""


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The EVALSHA commands in each write to the store."""
    seen: list[int] = []
    original = redis.asyncio.connection.AbstractConnection.send_packed_command

    async def spy(self: Any, command: Any, check_health: bool = True) -> None:
        data = command if isinstance(command, bytes) else b"".join(command)
        if EVALSHA in data:
            seen.append(data.count(EVALSHA))
        await original(self, command, check_health)

    monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", spy)
    return seen


def test_round_trips_are_shared(
    tmp_path: Path, servers: dict[str, RedisServer], sends: list[int]
) -> None:
    config = write(tmp_path / "batch.yaml", CONFIG)
    server = next(iter(servers.values()))

    async def main(url: str) -> None:
        async with (
            running(config, url) as service,
            grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel,
        ):
            call = OURS.caller(channel)
            await call(OURS.request("batch", [("user", "warm")]))  # connections, scripts
            sends.clear()
            eight = OURS.request("batch", *[[("user", f"d{i}")] for i in range(8)])
            response = await call(eight)
            assert [s.limit_remaining for s in response.statuses] == [999] * 8
            # 8 descriptors of one request: one write per lane (two lanes), not eight
            assert sum(sends) == 8
            assert len(sends) <= 2
            sends.clear()
            answers = await asyncio.gather(
                *(call(OURS.request("batch", [("user", f"r{i}")])) for i in range(64))
            )
            assert all(a.overall_code == OURS.code("OK") for a in answers)
            assert sum(sends) == 64
            assert len(sends) <= 8  # overlapping RPCs shared writes (4 measured)

    with DelayProxy(server.port, delay=0.05) as proxy:
        asyncio.run(main(proxy.url))
