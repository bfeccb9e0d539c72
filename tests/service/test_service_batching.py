"""The service decides through ``AsyncLimiter`` with batching: the descriptors of one request,
and RPCs in flight together, share round trips to the store (counted on the wire, as in
tests/storage/test_batching.py).

Batching has no timer: a call goes out at the event loop's next turn, and calls that come while
a round trip is on the wire go together in the next one. On loopback, Redis answers faster than
grpc.aio hands over the next RPC, so RPCs mostly go one by one (nothing to share, no latency
added); with a store 50 ms away (a delaying proxy), RPCs that overlap share round trips."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from ratekeeper import Decision

from ..support.delay_proxy import DelayProxy
from ..support.figures import record
from ..support.seams import Wire
from ..support.servers import RedisServer
from ..support.service_support import OURS, running, write

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


def test_one_huge_request_cannot_degrade_another_callers_decisions(
    tmp_path: Path, servers: dict[str, RedisServer], wire: Wire
) -> None:
    """One request of 3,000 descriptors while another client sends 50 small requests: the big
    request's descriptors go to the store in bounded rounds (no write carries more than
    64 calls, so none is a slow call the breaker would hold against the store at the
    default 20 ms timeout), and every one of the 50 is decided by the store (no UNAVAILABLE,
    no degraded decision, the breaker never left closed).

    The bound is checked on the wire, not by a 20 ms timeout here: on a loaded CI machine any
    store can miss 20 ms now and then (a CI run failed so), which is the breaker's business,
    not this request's."""
    config = write(tmp_path / "huge.yaml", CONFIG.replace("1000}", "100000}"))
    server = next(iter(servers.values()))

    async def main() -> None:
        async with running(config, server.url) as service:
            assert service.limiter is not None
            breaker = service.limiter.breaker
            moves: list[tuple[object, object]] = []
            breaker.add_listener(lambda old, new: moves.append((old, new)))
            degraded: list[Decision] = []
            observe = service.limiter._guard.metrics.decision

            def watch(decision: Decision) -> None:
                if decision.degraded:
                    degraded.append(decision)
                observe(decision)

            service.limiter._guard.metrics.decision = watch  # type: ignore[method-assign]
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as attacker,
                grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as other,
            ):
                call = OURS.caller(other)
                await call(OURS.request("batch", [("user", "warm")]))
                wire.clear()
                huge = OURS.request("batch", *[[("user", f"h{i}")] for i in range(3_000)])

                async def small() -> list[Any]:
                    requests = [OURS.request("batch", [("user", f"s{i}")]) for i in range(50)]
                    return [await call(request) for request in requests]

                answer, answers = await asyncio.gather(OURS.caller(attacker)(huge), small())
            assert len(answer.statuses) == 3_000
            assert {s.limit_remaining for s in answer.statuses} == {99_999}
            ok = sum(s.overall_code == OURS.code("OK") for s in answers)
            largest = max(count for _, count in wire.sends)
            record(
                "serve_huge_request",
                descriptors_in_one_request=3_000,
                small_requests_meanwhile=50,
                small_decided_by_the_store=ok,
                largest_write=largest,
                degraded_decisions=len(degraded),
                breaker_transitions=len(moves),
            )
            assert wire.commands == 3_050
            # a round's 64 calls at most (the batcher alone would send 256), and the small
            # request that came meanwhile
            assert largest <= 64 + 1
            assert [s.overall_code for s in answers] == [OURS.code("OK")] * 50
            assert [s.statuses[0].limit_remaining for s in answers] == [99_999] * 50
            assert degraded == []
            assert moves == []

    asyncio.run(main())
