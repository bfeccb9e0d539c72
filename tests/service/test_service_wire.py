"""``ratekeeper serve`` answers as envoyproxy/ratelimit does on the wire: through a real Envoy,
``x-ratelimit-reset`` is upstream's whole seconds (1 on a per-second rule, ``60 - now % 60`` on
a per-minute one); the health checks (gRPC ``""`` and ``"ratelimit"``, ``/healthcheck``) fail
until the store has answered and once SIGTERM arrives; malformed requests get
INVALID_ARGUMENT with a plain message; the upstream options reach the service from the
command line."""

from __future__ import annotations

import asyncio
import math
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ratekeeper.service import rls_pb2
from ratekeeper.service._server import RLS_METHOD, RLS_SERVICE

from ..support.servers import RedisServer, ServerBinary, free_port
from ..support.service_support import OURS, STORE_TIMEOUT, running, serve_process, write
from .test_service_envoy import envoy_in_front

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

EDGE = """\
domain: edge
descriptors:
  - key: generic_key
    value: envoy-test
    descriptors:
      - key: user
        value: per-second
        rate_limit: {unit: second, requests_per_unit: 1000}
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 1000}
"""


def limited(requests_per_hour: int) -> str:
    """A configuration: domain ``d``, key ``k`` limited per hour."""
    return (
        "domain: d\ndescriptors: [{key: k, rate_limit: "
        f"{{unit: hour, requests_per_unit: {requests_per_hour}}}}}]\n"
    )


@pytest.fixture
def redis_url(servers: dict[str, RedisServer]) -> str:
    return next(iter(servers.values())).url


def upstream_resets(before: float, after: float, unit: int) -> set[int]:
    """What upstream answers (``unit - now % unit``, ``now`` in whole seconds) at any moment
    between ``before`` and ``after``."""
    return {unit - second % unit for second in range(math.floor(before), math.floor(after) + 1)}


def test_envoy_reset_header_is_upstreams(tmp_path: Path, redis_url: str) -> None:
    """Envoy's ``x-ratelimit-reset`` (DRAFT_VERSION_03) is the status's whole seconds: 1 on a
    per-second rule (it was 0: the fraction, truncated), upstream's ``60 - now % 60`` on a
    per-minute rule."""
    with envoy_in_front(tmp_path, EDGE, redis_url, "wire") as (app, http, _):
        for _ in range(5):
            fast = http.get("/", headers={"x-user": "per-second"})
            assert fast.status_code == 200, fast.text
            assert fast.headers["x-ratelimit-limit"].startswith("1000, 1000;w=1")
            assert fast.headers["x-ratelimit-reset"] == "1"
        for user in ("alice", "bob", "carol"):
            before = time.time()
            slow = http.get("/", headers={"x-user": user})
            after = time.time()
            assert slow.status_code == 200, slow.text
            assert slow.headers["x-ratelimit-limit"].startswith("1000, 1000;w=60")
            reset = int(slow.headers["x-ratelimit-reset"])
            assert reset in upstream_resets(before, after, 60), (before, after, reset)
        assert app.received == {"": 8}


async def health_of(channel: grpc.aio.Channel, *names: str) -> list[int]:
    """What a ``grpc_health_probe``-style Check says for each name."""
    stub = health_pb2_grpc.HealthStub(channel)
    return [
        (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status for name in names
    ]


def test_health_fails_until_the_store_answers(tmp_path: Path, binaries: list[ServerBinary]) -> None:
    """Upstream pings Redis before it is healthy: NOT_SERVING for "", "ratelimit" and the RLS
    service and /healthcheck 500 while the store does not answer (calls meanwhile get the
    failure mode: UNAVAILABLE); SERVING and 200 once it does, seen by a Watch as it happens."""
    config = write(tmp_path / "conf.yaml", limited(5))
    store = RedisServer(binaries[0])  # its port is chosen; nothing listens on it yet
    names = ("", "ratelimit", RLS_SERVICE)

    async def main() -> None:
        async with (
            running(config, store.url, timeout=0.5) as service,
            grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as http,
        ):
            assert await health_of(channel, *names) == [NOT_SERVING] * 3
            answer = await http.get("/healthcheck")
            assert (answer.status_code, answer.text) == (500, "the store has not answered yet\n")
            call = OURS.caller(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(OURS.request("d", [("k", "v")]))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service="ratelimit")
            )
            assert (await watch.read()).status == NOT_SERVING
            await asyncio.to_thread(store.start)
            started = time.monotonic()
            update = await asyncio.wait_for(watch.read(), timeout=10)
            assert update.status == SERVING
            watch.cancel()
            # the probe backs off to once a second, behind a breaker open for at most 1 s
            assert time.monotonic() - started < 5
            assert await health_of(channel, *names) == [SERVING] * 3
            assert (await http.get("/healthcheck")).text == "OK"
            assert (await call(OURS.request("d", [("k", "v")]))).statuses[0].limit_remaining == 4

    try:
        asyncio.run(main())
    finally:
        store.stop()


def test_health_fails_when_sigterm_arrives(tmp_path: Path, redis_url: str) -> None:
    """SIGTERM: NOT_SERVING at once, while the server still runs (a Watch sees it before the
    stream ends), as upstream fails its health check for draining."""
    config = write(tmp_path / "conf.yaml", "domain: d\ndescriptors: [{key: k}]\n")
    grpc_port = free_port()
    with serve_process(
        "--config", str(config), "--storage", redis_url, "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port), "--http-port", str(free_port()),
    ) as service:  # fmt: skip
        service.wait_for("ready")

        async def main() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                assert await health_of(channel, "", "ratelimit") == [SERVING] * 2
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service="ratelimit")
                )
                assert (await watch.read()).status == SERVING
                service.signal(signal.SIGTERM)
                update = await asyncio.wait_for(watch.read(), timeout=10)
                assert update.status == NOT_SERVING
                watch.cancel()

        asyncio.run(main())
        assert service.proc.wait(20) == 0


def raw_caller(channel: grpc.aio.Channel) -> Any:
    """ShouldRateLimit with the request as bytes, whatever they are."""
    return channel.unary_unary(
        RLS_METHOD, response_deserializer=rls_pb2.RateLimitResponse.FromString
    )


def test_malformed_requests_are_invalid_argument(tmp_path: Path, redis_url: str) -> None:
    """Bytes that are not a request (a string that is not UTF-8, garbage) and override units
    the enum does not have (7, 99): INVALID_ARGUMENT with a plain message, not UNKNOWN
    "Unexpected error"; over HTTP, 400."""
    config = write(tmp_path / "conf.yaml", limited(5))
    good = rls_pb2.RateLimitRequest(domain="d")
    good.descriptors.add().entries.add(key="k", value="v")
    wire = good.SerializeToString()
    not_utf8 = wire.replace(b"\x01v", b"\x01\xff")  # the entry's value, one byte
    assert not_utf8 != wire

    async def main() -> None:
        async with (
            running(config, redis_url) as service,
            grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as http,
        ):
            call = raw_caller(channel)
            assert (await call(wire)).overall_code == rls_pb2.RateLimitResponse.OK
            for body in (not_utf8, b"\x0a\x01\xff", b"\xff\xff\xff\xff"):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(body)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, body
                assert (caught.value.details() or "").startswith(
                    "the request is not a RateLimitRequest"
                )
            for unit in (7, 99):
                request = rls_pb2.RateLimitRequest()
                request.CopyFrom(good)
                request.descriptors[0].limit.requests_per_unit = 3
                request.descriptors[0].limit.unit = unit  # type: ignore[assignment]
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(request.SerializeToString())
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = caught.value.details() or ""
                assert details.startswith(f"a descriptor's limit override has unit {unit},")
                assert "6 (YEAR)" in details
                answer = await http.post(
                    "/json",
                    json={
                        "domain": "d",
                        "descriptors": [
                            {
                                "entries": [{"key": "k", "value": "v"}],
                                "limit": {"requestsPerUnit": 3, "unit": unit},
                            }
                        ],
                    },
                )
                assert answer.status_code == 400
                assert f"has unit {unit}," in answer.text

    asyncio.run(main())


def test_upstream_options_from_the_command_line(tmp_path: Path, redis_url: str) -> None:
    """--shadow-mode, --response-dynamic-metadata, --charge-over-limit and --exact-durations
    (or their variables) reach the service: over the limit is OK overall (HTTP 200) with the
    status OVER_LIMIT, the metadata is in the answer, a denial is counted, and the duration has
    its fraction."""
    config = write(tmp_path / "conf.yaml", limited(2))
    http_port = free_port()
    with serve_process(
        "--config", str(config), "--storage", redis_url, "--host", "127.0.0.1",
        "--grpc-port", str(free_port()), "--http-port", str(http_port),
        "--key-prefix", f"opts{http_port}", "--timeout", str(STORE_TIMEOUT),
        "--shadow-mode", "--response-dynamic-metadata",
        env={"RATEKEEPER_SERVE_CHARGE_OVER_LIMIT": "1", "RATEKEEPER_SERVE_EXACT_DURATIONS": "1"},
    ) as service:  # fmt: skip
        service.wait_for("ready")

        def send(hits: int) -> httpx.Response:
            return httpx.post(
                f"http://127.0.0.1:{http_port}/json",
                json={
                    "domain": "d",
                    "descriptors": [{"entries": [{"key": "k", "value": "v"}], "hitsAddend": hits}],
                },
            )

        over = send(3)
        assert over.status_code == 200  # shadow mode: OK overall
        data = over.json()
        assert data["overallCode"] == "OK"
        assert data["statuses"][0]["code"] == "OVER_LIMIT"
        assert data["dynamicMetadata"]["domain"] == "d"
        assert data["dynamicMetadata"]["descriptors"] == [{"entries": ["k=v"], "hitsAddend": 3.0}]
        assert "." in data["statuses"][0]["durationUntilReset"]  # "3599.98...s": the fraction
        # the 3 refused hits were counted (--charge-over-limit): nothing fits now
        peek = send(0).json()
        assert peek["statuses"][0].get("limitRemaining", 0) == 0
        # counted as upstream's global_shadow_mode, under both names
        scrape = httpx.get(f"http://127.0.0.1:{http_port}/metrics").text
        assert "ratekeeper_service_global_shadow_mode_total 1.0" in scrape
        assert "ratelimit_service_global_shadow_mode 1.0" in scrape
