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

import grpc

from .delay_proxy import DelayProxy
from .seams import Wire
from .servers import RedisServer
from .service_support import OURS, running, write

CONFIG = """\
domain: batch
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000}
"""


def test_round_trips_are_shared(
    tmp_path: Path, servers: dict[str, RedisServer], wire: Wire
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
            wire.clear()
            eight = OURS.request("batch", *[[("user", f"d{i}")] for i in range(8)])
            response = await call(eight)
            assert [s.limit_remaining for s in response.statuses] == [999] * 8
            # 8 descriptors of one request: one write per lane (two lanes), not eight
            assert wire.commands == 8
            assert len(wire.sends) <= 2
            wire.clear()
            answers = await asyncio.gather(
                *(call(OURS.request("batch", [("user", f"r{i}")])) for i in range(64))
            )
            assert all(a.overall_code == OURS.code("OK") for a in answers)
            assert wire.commands == 64
            assert len(wire.sends) <= 8  # overlapping RPCs shared writes (4 measured)

    with DelayProxy(server.port, delay=0.05) as proxy:
        asyncio.run(main(proxy.url))
