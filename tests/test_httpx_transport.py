"""``ratekeeper.httpx``: transports that limit outbound calls, against a real local HTTP server
that counts the requests it received."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import httpx
import pytest

from ratekeeper import AsyncLimiter, ConfigError, Limiter, Policy, RateLimited
from ratekeeper._wait import JITTER
from ratekeeper.httpx import AsyncRateLimitedTransport, RateLimitedTransport

from .http_servers import Upstream


def _opts(url: str) -> dict[str, Any]:
    return {} if url == "memory://" else {"timeout": 5, "connect_timeout": 5}


def _tenant(request: httpx.Request) -> str:
    return request.headers["x-tenant"]


def test_sync_transport_stops_requests_beyond_the_limit(
    upstream: Upstream, backend: str, key_prefix: str
) -> None:
    policy = Policy("outbound", "3/minute")
    with Limiter.from_url(backend, key_prefix=key_prefix, **_opts(backend)) as limiter:
        transport = RateLimitedTransport(limiter, policy, key=_tenant, wait=False)
        with httpx.Client(transport=transport) as client:
            for _ in range(3):
                response = client.get(upstream.url, headers={"x-tenant": "a"})
                assert response.status_code == 200
                assert response.text == "ok"
            with pytest.raises(RateLimited) as caught:
                client.get(upstream.url, headers={"x-tenant": "a"})
            assert caught.value.decision.retry_after == pytest.approx(60, abs=1)
            assert client.get(upstream.url, headers={"x-tenant": "b"}).status_code == 200
        assert limiter.peek(policy, "a").remaining == 0
    assert upstream.received == {"a": 3, "b": 1}  # the denied request was never sent


def test_sync_transport_waits_by_default(upstream: Upstream, backend: str, key_prefix: str) -> None:
    policy = Policy("outbound", "1/second")
    with Limiter.from_url(backend, key_prefix=key_prefix, **_opts(backend)) as limiter:
        inner = httpx.HTTPTransport(retries=1)
        transport = RateLimitedTransport(limiter, policy, key=_tenant, transport=inner)
        assert transport.transport is inner
        with httpx.Client(transport=transport) as client:
            sent = []
            for _ in range(3):
                assert client.get(upstream.url, headers={"x-tenant": "w"}).status_code == 200
                sent.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert all(0.98 <= gap <= 1.0 * (1 + JITTER) + 0.5 for gap in gaps), gaps
    assert upstream.received == {"w": 3}


def test_the_default_key_is_the_host(upstream: Upstream) -> None:
    policy = Policy("outbound", "1/minute")
    limiter = Limiter.from_url("memory://")
    with httpx.Client(transport=RateLimitedTransport(limiter, policy, wait=0)) as client:
        assert client.get(upstream.url).status_code == 200
        with pytest.raises(RateLimited):
            client.get(upstream.url)
    assert limiter.peek(policy, "127.0.0.1").remaining == 0
    assert limiter.peek(policy, "elsewhere.example").remaining == 1
    assert upstream.received == {"": 1}


def test_async_transport_stops_and_waits(upstream: Upstream, backend: str, key_prefix: str) -> None:
    async def main() -> tuple[list[Any], float]:
        async with AsyncLimiter.from_url(
            backend, key_prefix=key_prefix, **_opts(backend)
        ) as limiter:
            strict = AsyncRateLimitedTransport(
                limiter, Policy("outbound", "3/minute"), key=_tenant, wait=False
            )
            async with httpx.AsyncClient(transport=strict) as client:
                results = await asyncio.gather(
                    *(client.get(upstream.url, headers={"x-tenant": "s"}) for _ in range(5)),
                    return_exceptions=True,
                )
            patient = AsyncRateLimitedTransport(
                limiter, Policy("paced", "2/second"), key=_tenant, wait=10
            )
            async with httpx.AsyncClient(transport=patient) as client:
                started = time.monotonic()
                paced = await asyncio.gather(
                    *(client.get(upstream.url, headers={"x-tenant": "p"}) for _ in range(4))
                )
                elapsed = time.monotonic() - started
            assert [r.status_code for r in paced] == [200] * 4
            return results, elapsed

    results, elapsed = asyncio.run(main())
    assert sum(isinstance(r, httpx.Response) and r.status_code == 200 for r in results) == 3
    assert sum(isinstance(r, RateLimited) for r in results) == 2
    assert 0.98 <= elapsed <= 1.0 * (1 + JITTER) + 1.0  # 2 at once, 2 a second later
    assert upstream.received == {"s": 3, "p": 4}


def test_transports_refuse_bad_configuration() -> None:
    policy = Policy("p", "1/second")
    sync, asyncio_limiter = Limiter.from_url("memory://"), AsyncLimiter.from_url("memory://")
    with pytest.raises(ConfigError, match="RateLimitedTransport takes a Limiter"):
        RateLimitedTransport(asyncio_limiter, policy)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="AsyncRateLimitedTransport takes an AsyncLimiter"):
        AsyncRateLimitedTransport(sync, policy)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="wait must be"):
        RateLimitedTransport(sync, policy, wait=-2)
    with pytest.raises(ConfigError, match="key must be a callable"):
        RateLimitedTransport(sync, policy, key="host")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cost"):
        AsyncRateLimitedTransport(asyncio_limiter, policy, cost=0)
    with pytest.raises(ConfigError, match="policy must be"):
        RateLimitedTransport(sync, "p")  # type: ignore[arg-type]
