"""Conformance of ShouldRateLimit, field by field, with requests built by the official Envoy
stubs (xds-protos, test-only: CI runs this file in a venv of its own, with
RATEKEEPER_REQUIRE_XDS=1 so that the official stubs cannot go missing unnoticed) and by the
project's own messages. Every test runs against a real server on the shared Redis/Valkey."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ratekeeper.service import rls_pb2 as ours
from ratekeeper.service._decide import UNLIMITED_REMAINING
from ratekeeper.service._server import RLS_SERVICE

from ..support.servers import RedisServer
from ..support.service_support import OFFICIAL, OURS, Stubs, running, write

if os.environ.get("RATEKEEPER_REQUIRE_XDS") and OFFICIAL is None:
    raise RuntimeError("RATEKEEPER_REQUIRE_XDS is set and xds-protos is not importable")

STUBS = [OURS, *([OFFICIAL] if OFFICIAL is not None else [])]

CONFIG = """\
domain: conf
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 5, name: per-user}
  - key: path
    value: /unlimited
    rate_limit: {unlimited: true}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: day, requests_per_unit: 1}
  - key: zero
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: log
    rate_limit: {unit: day, requests_per_unit: 3, algorithm: sliding_log}
"""

Call = Callable[[Any], Awaitable[Any]]


@pytest.fixture(params=STUBS, ids=lambda stubs: stubs.name)
def stubs(request: pytest.FixtureRequest) -> Stubs:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def redis_url(servers: dict[str, RedisServer]) -> str:
    return next(iter(servers.values())).url


def serve(
    tmp_path: Path,
    redis_url: str,
    stubs: Stubs,
    test: Callable[[Call, Any], Awaitable[None]],
    **options: Any,
) -> None:
    config = write(tmp_path / "conf.yaml", CONFIG)

    async def main() -> None:
        async with (
            running(config, redis_url, **options) as service,
            grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel,
        ):
            await test(stubs.caller(channel), service)

    asyncio.run(main())


def test_one_descriptor_every_field(tmp_path: Path, redis_url: str, stubs: Stubs) -> None:
    async def test(call: Call, service: Any) -> None:
        request = stubs.request("conf", [("user", "alice")])
        for remaining in (4, 3, 2, 1, 0):
            response = await call(request)
            assert response.overall_code == stubs.code("OK")
            (status,) = response.statuses
            assert status.code == stubs.code("OK")
            assert status.limit_remaining == remaining
            assert status.current_limit.name == "per-user"
            assert status.current_limit.requests_per_unit == 5
            assert status.current_limit.unit == stubs.unit("HOUR")
            assert 0 < status.duration_until_reset.ToNanoseconds() <= 3600 * 10**9
        denied = await call(request)
        assert denied.overall_code == stubs.code("OVER_LIMIT")
        (status,) = denied.statuses
        assert status.code == stubs.code("OVER_LIMIT")
        assert status.limit_remaining == 0
        assert status.current_limit.requests_per_unit == 5
        assert 0 < status.duration_until_reset.ToNanoseconds() <= 3600 * 10**9
        assert not denied.response_headers_to_add  # off unless asked

    serve(tmp_path, redis_url, stubs, test)


def test_every_descriptor_in_order_and_counted(
    tmp_path: Path, redis_url: str, stubs: Stubs
) -> None:
    """Statuses come in the request's order; as upstream, a descriptor within its limit is
    charged although another one is over its limit."""

    async def test(call: Call, service: Any) -> None:
        mixed = stubs.request(
            "conf",
            [("nothing", "here")],
            [("user", "a")],
            [("path", "/unlimited")],
            [("user", "b")],
        )
        response = await call(mixed)
        unmatched, a, unlimited, b = response.statuses
        assert response.overall_code == stubs.code("OK")
        assert unmatched.code == stubs.code("OK")
        assert not unmatched.HasField("current_limit")
        assert unmatched.limit_remaining == 0
        assert not unmatched.HasField("duration_until_reset")
        assert (a.limit_remaining, b.limit_remaining) == (4, 4)
        assert unlimited.code == stubs.code("OK")
        assert unlimited.limit_remaining == UNLIMITED_REMAINING
        assert not unlimited.HasField("current_limit")
        for _ in range(4):
            await call(stubs.request("conf", [("user", "a")]))
        both = await call(stubs.request("conf", [("user", "a")], [("user", "b")]))
        assert both.overall_code == stubs.code("OVER_LIMIT")
        assert [s.code for s in both.statuses] == [stubs.code("OVER_LIMIT"), stubs.code("OK")]
        assert both.statuses[1].limit_remaining == 3  # b was charged
        assert (await call(stubs.request("conf", [("user", "b")]))).statuses[0].limit_remaining == 2

    serve(tmp_path, redis_url, stubs, test)


def test_hits_addend(tmp_path: Path, redis_url: str, stubs: Stubs) -> None:
    """Per request (0 means 1), per descriptor (wins, 0 is a peek)."""

    async def test(call: Call, service: Any) -> None:
        one = await call(stubs.request("conf", [("user", "h")], hits_addend=0))
        assert one.statuses[0].limit_remaining == 4
        three = await call(stubs.request("conf", [("user", "h")], hits_addend=3))
        assert three.statuses[0].limit_remaining == 1
        # the descriptor's hits_addend wins over the request's
        wins = await call(
            stubs.request("conf", {"entries": [("user", "h")], "hits_addend": 1}, hits_addend=3)
        )
        assert wins.statuses[0].limit_remaining == 0
        # a peek consumes nothing and, as upstream's 0 hits, is never over the limit
        for _ in range(2):
            peek = await call(stubs.request("conf", {"entries": [("user", "h")], "hits_addend": 0}))
            assert peek.overall_code == stubs.code("OK")
            assert peek.statuses[0].limit_remaining == 0
            assert peek.statuses[0].current_limit.requests_per_unit == 5
        fresh = await call(stubs.request("conf", {"entries": [("user", "p")], "hits_addend": 0}))
        assert fresh.statuses[0].limit_remaining == 5
        too_many = await call(stubs.request("conf", {"entries": [("user", "q")], "hits_addend": 6}))
        assert too_many.overall_code == stubs.code("OVER_LIMIT")
        after = await call(stubs.request("conf", {"entries": [("user", "q")], "hits_addend": 0}))
        assert after.statuses[0].limit_remaining == 5  # a denial charged nothing

    serve(tmp_path, redis_url, stubs, test)


def test_limit_override(tmp_path: Path, redis_url: str, stubs: Stubs) -> None:
    async def test(call: Call, service: Any) -> None:
        spec = {"entries": [("user", "o")], "limit": (2, "HOUR")}
        first = await call(stubs.request("conf", spec))
        (status,) = first.statuses
        assert status.current_limit.requests_per_unit == 2
        assert status.current_limit.unit == stubs.unit("HOUR")
        assert status.current_limit.name == ""  # an override has no name, as upstream
        assert status.limit_remaining == 1
        assert 0 < status.duration_until_reset.ToNanoseconds() <= 3600 * 10**9
        await call(stubs.request("conf", spec))
        assert (await call(stubs.request("conf", spec))).overall_code == stubs.code("OVER_LIMIT")
        # a descriptor the configuration does not know is limited by its override too
        other = {"entries": [("other", "x")], "limit": (1, "MINUTE")}
        assert (await call(stubs.request("conf", other))).statuses[0].limit_remaining == 0
        assert (await call(stubs.request("conf", other))).overall_code == stubs.code("OVER_LIMIT")

    serve(tmp_path, redis_url, stubs, test)


def test_unknown_domain_shadow_mode_and_zero(tmp_path: Path, redis_url: str, stubs: Stubs) -> None:
    async def test(call: Call, service: Any) -> None:
        unknown = await call(stubs.request("nowhere", [("user", "alice")]))
        assert unknown.overall_code == stubs.code("OK")
        assert not unknown.statuses[0].HasField("current_limit")
        shadow = stubs.request("conf", [("shadow", "s")])
        assert (await call(shadow)).statuses[0].limit_remaining == 0
        over = await call(shadow)  # over its limit, answered OK in shadow mode
        assert over.overall_code == stubs.code("OK")
        assert over.statuses[0].code == stubs.code("OK")
        assert over.statuses[0].current_limit.requests_per_unit == 1
        text, _ = service.metrics.render()
        assert b'descriptor="conf.shadow",domain="conf",outcome="shadow_mode"' in text
        zero = await call(stubs.request("conf", [("zero", "z")]))
        assert zero.overall_code == stubs.code("OVER_LIMIT")
        assert zero.statuses[0].current_limit.requests_per_unit == 0
        assert zero.statuses[0].current_limit.unit == stubs.unit("SECOND")

    serve(tmp_path, redis_url, stubs, test)


def test_sliding_log_extension(tmp_path: Path, redis_url: str, stubs: Stubs) -> None:
    async def test(call: Call, service: Any) -> None:
        request = stubs.request("conf", [("log", "l")])
        remaining = [(await call(request)).statuses[0].limit_remaining for _ in range(3)]
        assert remaining == [2, 1, 0]
        denied = await call(request)
        assert denied.overall_code == stubs.code("OVER_LIMIT")
        assert denied.statuses[0].current_limit.unit == stubs.unit("DAY")

    serve(tmp_path, redis_url, stubs, test)


def test_response_headers(tmp_path: Path, redis_url: str, stubs: Stubs) -> None:
    """IETF RateLimit / RateLimit-Policy (and Retry-After on a denial), rendered by the same
    function as the web middleware's."""

    async def test(call: Call, service: Any) -> None:
        request = stubs.request("conf", [("user", "hdr")], [("nothing", "x")])
        first = await call(request)
        headers = {h.key: h.value for h in first.response_headers_to_add}
        assert set(headers) == {"RateLimit-Policy", "RateLimit"}
        assert headers["RateLimit-Policy"].endswith(";q=5;w=3600")
        assert ";r=4;t=" in headers["RateLimit"]
        for _ in range(4):
            await call(request)
        denied = await call(request)
        headers = {h.key: h.value for h in denied.response_headers_to_add}
        assert ";r=0;" in headers["RateLimit"]
        assert 1 <= int(headers["Retry-After"]) <= 3600

    serve(tmp_path, redis_url, stubs, test, response_headers=True)


def test_bad_requests_answer_as_upstream(tmp_path: Path, redis_url: str, stubs: Stubs) -> None:
    """No domain or no descriptors: upstream's UNKNOWN and message; a descriptor without
    entries: OK, no limit, as upstream; other malformed requests: INVALID_ARGUMENT."""

    async def test(call: Call, service: Any) -> None:
        upstream = [
            (stubs.request_type(domain="conf"), "rate limit descriptor list must not be empty"),
            (stubs.request("", [("user", "x")]), "rate limit domain must not be empty"),
        ]
        for request, message in upstream:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(request)
            assert caught.value.code() == grpc.StatusCode.UNKNOWN
            assert caught.value.details() == message
        empty = await call(stubs.request("conf", [], [("user", "empty")]))
        assert empty.overall_code == stubs.code("OK")
        assert not empty.statuses[0].HasField("current_limit")
        assert empty.statuses[1].current_limit.requests_per_unit == 5
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(stubs.request("conf", [("", "x")]))  # an empty key
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        no_unit = stubs.request("conf", {"entries": [("user", "x")], "limit": (3, "UNKNOWN")})
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(no_unit)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unit" in (caught.value.details() or "")

    serve(tmp_path, redis_url, stubs, test)


def test_health_service(tmp_path: Path, redis_url: str) -> None:
    config = write(tmp_path / "conf.yaml", CONFIG)

    async def main() -> None:
        async with (
            running(config, redis_url) as service,
            grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel,
        ):
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", RLS_SERVICE, "ratelimit"):  # upstream's probes ask "ratelimit"
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await service.stop()
            # after stop the port is closed: the health service said NOT_SERVING first
            for name in (RLS_SERVICE, "ratelimit"):
                assert service._health._server_status[name] == (
                    health_pb2.HealthCheckResponse.NOT_SERVING
                )

    asyncio.run(main())


def _same_bytes_as_the_official_messages() -> None:
    """Our messages and the official ones encode every field we use the same way."""
    assert OFFICIAL is not None
    request = OFFICIAL.request(
        "d",
        {"entries": [("k", "v"), ("k2", "v2")], "hits_addend": 0, "limit": (7, "YEAR")},
        [("a", "b")],
        hits_addend=4,
    )
    wire = request.SerializeToString()
    mine = ours.RateLimitRequest.FromString(wire)
    assert mine.SerializeToString() == wire
    assert mine.descriptors[0].hits_addend.value == 0
    assert mine.descriptors[0].HasField("hits_addend")
    assert mine.descriptors[0].limit.unit == ours.RateLimitDescriptor.YEAR
    response = ours.RateLimitResponse(overall_code=ours.RateLimitResponse.OVER_LIMIT)
    status = response.statuses.add(code=ours.RateLimitResponse.OVER_LIMIT, limit_remaining=3)
    status.current_limit.name = "n"
    status.current_limit.requests_per_unit = 9
    status.current_limit.unit = ours.RateLimitResponse.RateLimit.WEEK
    status.duration_until_reset.FromNanoseconds(1_500_000_000)
    response.response_headers_to_add.add(key="RateLimit", value='"p";r=3;t=2')
    theirs = OFFICIAL.response_type.FromString(response.SerializeToString())
    assert theirs.statuses[0].current_limit.unit == OFFICIAL.unit("WEEK")
    assert theirs.statuses[0].current_limit.name == "n"
    assert theirs.statuses[0].duration_until_reset.ToNanoseconds() == 1_500_000_000
    assert theirs.response_headers_to_add[0].value == '"p";r=3;t=2'
    assert theirs.SerializeToString() == response.SerializeToString()


if OFFICIAL is not None:  # only where xds-protos is installed (CI's conformance venv)
    test_same_bytes_as_the_official_messages = _same_bytes_as_the_official_messages
