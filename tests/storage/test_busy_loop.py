"""A busy event loop is not a slow store: ``AsyncLimiter`` judges the store by the store's time.

Each test blocks the event loop itself (CPU work, as a handler's parsing or rendering does) for
far longer than the store's timeout, at the moment that matters: while replies are on their
way, while a connection is being made. The store answers at once; the replies wait, unread, for
the loop. They are replies: decided by the store, the breaker closed, ``store_call`` given the
store's time and ``loop_lag`` the wait. A reply that really is late (a delay proxy holds it past
the deadline) is a timeout, however late the loop reads it. The timeouts here are generous
(250 ms and more) so that a loaded machine's scheduling cannot decide these tests; the figures
under load, at the default 20 ms, are ``benchmarks/busy_loop.py``'s.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from ratekeeper import AsyncLimiter, Decision, Policy
from ratekeeper._storage.redis._protocol import Links
from ratekeeper.metrics import Metrics

from ..support.delay_proxy import DelayProxy
from ..support.servers import RedisServer

#: How long the loop is blocked: four times the timeout.
BLOCK = 1.0
TIMEOUT = 0.25


class Recorder(Metrics):
    def __init__(self) -> None:
        self.store: list[tuple[float, bool]] = []
        self.lags: list[float] = []

    def store_call(self, seconds: float, ok: bool) -> None:
        self.store.append((seconds, ok))

    def loop_lag(self, seconds: float) -> None:
        self.lags.append(seconds)


def _links(limiter: AsyncLimiter) -> Links:
    links = limiter.storage._links  # type: ignore[attr-defined]
    assert isinstance(links, Links)
    return links


def _block(seconds: float) -> None:
    """CPU work on the event loop's thread: nothing else on the loop runs meanwhile."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _block_once_written(limiter: AsyncLimiter) -> None:
    """Block the loop as soon as a round is on the wire (its replies then wait, unread)."""
    links = _links(limiter)
    while not any(link.rounds for link in links.every):
        await asyncio.sleep(0)
    _block(BLOCK)


def _limiter(url: str, key_prefix: str, metrics: Metrics, **options: Any) -> AsyncLimiter:
    return AsyncLimiter.from_url(
        url,
        key_prefix=key_prefix,
        timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        metrics=metrics,
        top_offenders=0,
        **options,
    )


@pytest.mark.parametrize("batching", [True, False])
def test_replies_that_wait_for_a_busy_loop_are_replies(
    server: RedisServer, key_prefix: str, batching: bool
) -> None:
    """64 hits on the wire, then the loop blocked for 4 timeouts: all 64 decided by the store,
    the breaker closed, each store call's time under the timeout and the wait in loop_lag."""
    policy = Policy("busy", "100/minute")
    metrics = Recorder()

    async def main() -> tuple[list[Decision], str]:
        async with _limiter(server.url, key_prefix, metrics, batching=batching) as limiter:
            await limiter.hit(policy, "warm-up")  # connected: the test is about replies
            metrics.store.clear()
            metrics.lags.clear()
            hits = asyncio.gather(*(limiter.hit(policy, f"u{i}") for i in range(64)))
            await _block_once_written(limiter)
            return await hits, str(limiter.breaker.state)

    decisions, state = asyncio.run(main())
    assert [d.reason for d in decisions if d.degraded] == []
    assert [d.remaining for d in decisions] == [99] * 64
    assert state == "closed"
    assert len(metrics.store) == 64
    assert all(ok and seconds < TIMEOUT for seconds, ok in metrics.store)
    # The replies of the round written before the block waited for it.
    assert max(metrics.lags) > BLOCK / 2


def test_a_reply_late_from_the_store_is_late_however_late_the_loop_reads_it(
    server: RedisServer, key_prefix: str
) -> None:
    """The replies are held 3 timeouts by a delay proxy, and the loop is blocked longer still:
    the replies are there when the loop looks, but they arrived after the deadline, which is
    the store's fault: a timeout, as it would be on an idle loop."""
    policy = Policy("late", "100/minute")
    metrics = Recorder()

    async def main(proxy: DelayProxy) -> list[Decision]:
        async with _limiter(proxy.url, key_prefix, metrics, failure_mode="open") as limiter:
            await limiter.hit(policy, "warm-up")
            proxy.delay = 3 * TIMEOUT
            hits = asyncio.gather(*(limiter.hit(policy, f"u{i}") for i in range(8)))
            await _block_once_written(limiter)
            decisions = await hits
            proxy.delay = 0.0
            return decisions

    with DelayProxy(server.port) as proxy:
        decisions = asyncio.run(main(proxy))
    assert [d.reason for d in decisions] == ["timeout/open"] * 8
    late = [seconds for seconds, ok in metrics.store if not ok]
    assert len(late) == 8
    # Judged by when the replies arrived (the proxy's delay; or the deadline, for a round
    # written after the block), never by when the loop read them.
    assert all(TIMEOUT <= seconds < BLOCK for seconds in late), late
    assert max(late) > 2 * TIMEOUT


def test_a_connection_made_while_the_loop_is_busy_is_made(
    server: RedisServer, key_prefix: str
) -> None:
    """A cold limiter: the first hit's connection is under way when the loop is blocked for 4
    connect timeouts. The kernel made the connection in time: the hit is decided by the store
    (before: 'Timeout connecting to server', and the failure mode decided)."""
    policy = Policy("cold", "100/minute")
    metrics = Recorder()

    async def block_once_connecting(limiter: AsyncLimiter) -> None:
        links = _links(limiter)
        while links.loop is None:  # the first hit's batch has asked for a connection
            await asyncio.sleep(0)
        _block(BLOCK)

    async def main() -> list[Decision]:
        async with _limiter(server.url, key_prefix, metrics) as limiter:
            hits = asyncio.gather(*(limiter.hit(policy, f"u{i}") for i in range(32)))
            await block_once_connecting(limiter)
            return await hits

    decisions = asyncio.run(main())
    assert [d.reason for d in decisions if d.degraded] == []
    assert [d.remaining for d in decisions] == [99] * 32


def test_a_cluster_s_replies_that_wait_for_a_busy_loop_are_replies(
    cluster: Any, key_prefix: str
) -> None:
    """The same on a cluster opened from a URL: each node's batch on links of its own, 64
    hits spread over the three primaries, the loop blocked once they are written: all decided
    by the store, every node's breaker closed."""
    policy = Policy("busy", "100/minute")
    metrics = Recorder()

    async def block_once_written(limiter: AsyncLimiter) -> None:
        nodes = limiter.storage._node_links  # type: ignore[attr-defined]
        while not any(
            links and any(link.rounds for link in links.every) for links in nodes.values()
        ):
            await asyncio.sleep(0)
        _block(BLOCK)

    async def main() -> tuple[list[Decision], list[str]]:
        async with _limiter(cluster.url, key_prefix, metrics) as limiter:
            await asyncio.gather(*(limiter.hit(policy, f"warm-{i}") for i in range(64)))
            hits = asyncio.gather(*(limiter.hit(policy, f"u{i}") for i in range(64)))
            await block_once_written(limiter)
            states = [str(b.state) for b in limiter.breakers.values()]
            return await hits, states

    decisions, states = asyncio.run(main())
    assert [d.reason for d in decisions if d.degraded] == []
    assert [d.remaining for d in decisions] == [99] * 64
    assert len(states) == 3  # a breaker for each primary: the hits reached all three
    assert set(states) == {"closed"}
