"""``ratekeeper.httpx``: transports that limit outbound calls, against a real local HTTP server
that counts the requests it received."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from ratekeeper import AsyncLimiter, ConfigError, Limiter, Policy, RateLimited
from ratekeeper._limiters.wait import JITTER
from ratekeeper.httpx import AsyncRateLimitedTransport, RateLimitedTransport

from ..support.http_servers import Upstream


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


# --- actual_cost: reserve an estimate, settle what the response says it cost -----------------

TOKENS = Policy("tokens", "1000/minute")
LLM = "https://llm.example/v1/chat"  # the default key: its host
HOST = "llm.example"


def _usage(response: httpx.Response) -> int | None:
    """An LLM API's cost: its JSON's ``usage.total_tokens``."""
    return int(response.json()["usage"]["total_tokens"])


def _llm(tokens: int = 700) -> httpx.MockTransport:
    """An upstream that answers every request with ``tokens`` used."""
    return httpx.MockTransport(
        lambda request: httpx.Response(200, json={"usage": {"total_tokens": tokens}})
    )


class _Chunks(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body sent in chunks (not read in advance, as a real transport's), sync or
    async, that says whether it was closed."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = chunks
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def _last_event_usage(response: httpx.Response) -> int | None:
    """A streamed (server-sent events) LLM answer's cost: the usage in its last event."""
    last = response.text.strip().splitlines()[-1].removeprefix("data: ")
    return int(json.loads(last)["usage"]["total_tokens"])


class _Outbound:
    """A client over ``RateLimitedTransport`` or ``AsyncRateLimitedTransport`` (``api``),
    driven as blocking calls: ``run`` awaits what the async one returns on its own loop."""

    def __init__(self, api: str, backend: str, key_prefix: str) -> None:
        self.loop = asyncio.new_event_loop() if api == "async" else None
        options = {"key_prefix": key_prefix, **_opts(backend)}
        self.limiter: Any = (
            Limiter.from_url(backend, **options)
            if self.loop is None
            else AsyncLimiter.from_url(backend, **options)
        )
        self.client: Any = None

    def run(self, value: Any) -> Any:
        return value if self.loop is None else self.loop.run_until_complete(value)

    def using(self, policy: Policy, upstream: Any, **options: Any) -> _Outbound:
        if self.loop is None:
            transport: Any = RateLimitedTransport(
                self.limiter, policy, transport=upstream, **options
            )
            self.client = httpx.Client(transport=transport)
        else:
            transport = AsyncRateLimitedTransport(
                self.limiter, policy, transport=upstream, **options
            )
            self.client = httpx.AsyncClient(transport=transport)
        return self

    def get(self, url: str, **options: Any) -> httpx.Response:
        return self.run(self.client.get(url, **options))  # type: ignore[no-any-return]

    def stream(self, url: str) -> httpx.Response:
        """The response of a ``client.stream(...)``, open (its body not read)."""
        request = self.client.build_request("GET", url)
        return self.run(self.client.send(request, stream=True))  # type: ignore[no-any-return]

    def lines(self, response: httpx.Response) -> Iterator[str]:
        """A streamed body, line by line as a client of server-sent events reads it (httpx
        closes the response once it is read to its end)."""
        if self.loop is None:
            yield from response.iter_lines()
            return
        lines = response.aiter_lines()
        while True:
            try:
                yield self.run(lines.__anext__())
            except StopAsyncIteration:
                return

    def close(self, response: httpx.Response) -> None:
        if self.loop is None:
            response.close()
        else:
            self.run(response.aclose())

    def left(self, policy: Policy = TOKENS, identity: str = HOST) -> int:
        return self.run(self.limiter.peek(policy, identity)).remaining  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        if self.client is not None:
            self.run(self.client.close() if self.loop is None else self.client.aclose())
        self.run(self.limiter.close())
        if self.loop is not None:
            self.loop.close()


@pytest.fixture(params=["sync", "async"])
def outbound(request: pytest.FixtureRequest, backend: str, key_prefix: str) -> Iterator[_Outbound]:
    """A client over each transport in turn, on each backend."""
    made = _Outbound(str(request.param), backend, key_prefix)
    yield made
    made.shutdown()


def test_actual_cost_settles_the_usage_an_llm_api_reports(outbound: _Outbound) -> None:
    sent = []

    def upstream(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={"usage": {"total_tokens": 700}})

    outbound.using(TOKENS, httpx.MockTransport(upstream), cost=200, actual_cost=_usage, wait=False)
    assert outbound.get(LLM).json()["usage"]["total_tokens"] == 700
    assert outbound.left() == 300  # charged 700, not the estimate of 200
    assert outbound.get(LLM).status_code == 200  # 200 fits in 300 ...
    assert outbound.left() == 0  # ... and it used 700: 1,400 counted, past the limit
    with pytest.raises(RateLimited) as caught:
        outbound.get(LLM)
    # The real wait: 200 fits again once the first 700 leave the window, a minute after (the
    # estimates alone, 400, would have let it through at once).
    assert caught.value.decision.retry_after == pytest.approx(60, abs=1)
    assert len(sent) == 2  # the denied request was never sent


def test_actual_cost_settles_after_a_real_transport_read_the_body(
    outbound: _Outbound, upstream: Upstream
) -> None:
    policy = Policy("bytes", "10/minute")
    inner = httpx.HTTPTransport() if outbound.loop is None else httpx.AsyncHTTPTransport()
    outbound.using(
        policy, inner, key=_tenant, cost=5, actual_cost=lambda r: len(r.content), wait=False
    )
    assert outbound.get(upstream.url, headers={"x-tenant": "r"}).text == "ok"
    assert outbound.left(policy, "r") == 8  # the 2 bytes of "ok", not the estimate of 5
    assert upstream.received == {"r": 1}


def test_a_streamed_response_settles_when_it_is_closed(outbound: _Outbound) -> None:
    bodies: list[_Chunks] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        bodies.append(
            _Chunks(
                b'data: {"delta": "Hel', b'lo"}\n\n', b'data: {"usage": {"total_tokens": 700}}\n'
            )
        )
        return httpx.Response(200, stream=bodies[-1])

    outbound.using(TOKENS, httpx.MockTransport(upstream), cost=200, actual_cost=_last_event_usage)
    response = outbound.stream(LLM)
    assert outbound.left() == 800  # the estimate, while the answer streams
    lines = outbound.lines(response)
    assert next(lines) == 'data: {"delta": "Hello"}'
    assert outbound.left() == 800
    assert list(lines)[-1] == 'data: {"usage": {"total_tokens": 700}}'
    assert response.is_closed  # read to its end: httpx closed it
    assert bodies[-1].closed
    assert outbound.left() == 300  # settled on close, from the body read
    outbound.close(response)  # closing again settles nothing more
    assert outbound.left() == 300

    unread = outbound.stream(LLM)
    next(outbound.lines(unread))
    outbound.close(unread)  # closed before its end: what it cost is unknown
    assert bodies[-1].closed
    assert outbound.left() == 100  # the estimate is kept


def test_actual_cost_none_keeps_the_estimate(outbound: _Outbound) -> None:
    outbound.using(TOKENS, _llm(), cost=200, actual_cost=lambda response: None)
    assert outbound.get(LLM).status_code == 200
    assert outbound.left() == 800


def test_a_failing_actual_cost_keeps_the_estimate_and_raises(outbound: _Outbound) -> None:
    failing = httpx.MockTransport(lambda request: httpx.Response(500, json={"error": "down"}))
    outbound.using(TOKENS, failing, cost=200, actual_cost=_usage)
    with pytest.raises(KeyError, match="usage"):  # the callable's own error, unchanged
        outbound.get(LLM)
    assert outbound.left() == 800

    def streamed(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, stream=_Chunks(b'{"error": "down"}'))

    outbound.using(TOKENS, httpx.MockTransport(streamed), cost=200, actual_cost=_usage)
    response = outbound.stream(LLM)
    with pytest.raises(KeyError, match="usage"):  # from the read that ends and closes it
        list(outbound.lines(response))
    outbound.close(response)
    assert outbound.left() == 600

    outbound.using(TOKENS, _llm(), cost=200, actual_cost=lambda response: -1)
    with pytest.raises(ConfigError, match=r"actual_cost must return None or an int.* -1"):
        outbound.get(LLM)
    assert outbound.left() == 400


def test_a_request_that_never_left_is_refunded(outbound: _Outbound) -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    outbound.using(TOKENS, httpx.MockTransport(refused), cost=200, actual_cost=_usage)
    with pytest.raises(httpx.ConnectError):
        outbound.get(LLM)
    assert outbound.left() == 1000  # nothing reached the server: cancelled

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer in time", request=request)

    outbound.using(TOKENS, httpx.MockTransport(slow), cost=200, actual_cost=_usage)
    with pytest.raises(httpx.ReadTimeout):
        outbound.get(LLM)
    assert outbound.left() == 800  # the server may have done the work: the estimate is kept


def test_a_denied_reservation_waits_like_a_hit(api: str, key_prefix: str) -> None:
    outbound = _Outbound(api, "memory://", key_prefix)
    try:
        policy = Policy("paced", "10/second")
        outbound.using(policy, _llm(10), cost=5, actual_cost=_usage, wait=5)
        sent = []
        for _ in range(2):
            assert outbound.get(LLM).status_code == 200
            sent.append(time.monotonic())
        assert 0.98 <= sent[1] - sent[0] <= 1.0 * (1 + JITTER) + 0.5  # the first cost 10
        assert outbound.left(policy) == 0
    finally:
        outbound.shutdown()


def test_without_actual_cost_requests_are_plain_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("reserved without actual_cost")

    monkeypatch.setattr(Limiter, "reserve", refuse)
    limiter = Limiter.from_url("memory://")
    with httpx.Client(transport=RateLimitedTransport(limiter, TOKENS, transport=_llm())) as c:
        assert c.get(LLM).status_code == 200
    assert limiter.peek(TOKENS, HOST).remaining == 999


def test_actual_cost_is_checked_when_the_transport_is_built() -> None:
    sync, asyncio_limiter = Limiter.from_url("memory://"), AsyncLimiter.from_url("memory://")
    with pytest.raises(ConfigError, match="actual_cost must be None or a callable"):
        RateLimitedTransport(sync, TOKENS, actual_cost=700)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="hands out leases"):
        AsyncRateLimitedTransport(
            asyncio_limiter,
            Policy("slots", "4/minute", algorithm="concurrency"),
            actual_cost=_usage,
        )
