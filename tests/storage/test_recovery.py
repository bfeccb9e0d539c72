"""Recovery from a cold script cache, a restarted or dead server, and a frozen one.

These tests flush, kill, restart and SIGSTOP servers, so they run on the module's own servers
(``own_server``: one per flavor, running again after each test), never on the shared session
servers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis

from ratekeeper import (
    AsyncLimiter,
    Decision,
    Limiter,
    Policy,
    StorageError,
    StorageTimeout,
    StorageUnavailable,
)
from ratekeeper._algorithms import get_algorithm
from ratekeeper._algorithms.scripts import load_script
from ratekeeper._storage.redis._compat import get_connection

from ..support.seams import flush_after_every_load
from ..support.servers import RedisServer, command_calls

#: Short deadlines so that failures surface quickly.
FAST = {"timeout": 0.2, "connect_timeout": 0.2, "failure_mode": "raise"}
#: The asyncio tests run with batching on (the default) and off.
BATCHING = pytest.mark.parametrize("batching", [True, False], ids=["batching", "no-batching"])
#: Generous reply timeout for steps that must succeed even on a loaded machine.
PATIENT = {"timeout": 5, "connect_timeout": 5, "failure_mode": "raise"}


def _sha(policy: Policy) -> str:
    return load_script(get_algorithm(policy.algorithm).script).sha


def _script_loaded(client: redis.Redis, policy: Policy) -> bool:
    return bool(client.script_exists(_sha(policy))[0])


# --- SCRIPT FLUSH --------------------------------------------------------------------------------


def test_script_flush_between_hits_sync(own_server: RedisServer, key_prefix: str):
    policy = Policy("flush", "5/minute")
    with (
        own_server.client() as admin,
        Limiter.from_url(own_server.url, key_prefix=key_prefix, **PATIENT) as limiter,
    ):
        assert [limiter.hit(policy, "a").remaining for _ in range(2)] == [4, 3]
        loads = command_calls(admin, "script|load")
        admin.script_flush()
        assert not _script_loaded(admin, policy)

        decision = limiter.hit(policy, "a")
        assert decision.allowed
        assert decision.remaining == 2  # the flush dropped the script, not the log
        assert _script_loaded(admin, policy)
        assert command_calls(admin, "script|load") == loads + 1
        assert [limiter.hit(policy, "a").allowed for _ in range(3)] == [True, True, False]
        (key,) = limiter.keys(policy, "a")
        assert admin.llen(key) == 5


@BATCHING
def test_script_flush_between_hits_async(own_server: RedisServer, key_prefix: str, batching: bool):
    policy = Policy("flush", "5/minute")

    async def main(admin: redis.Redis) -> None:
        limiter = AsyncLimiter.from_url(
            own_server.url, key_prefix=key_prefix, batching=batching, **PATIENT
        )
        try:
            assert [(await limiter.hit(policy, "a")).remaining for _ in range(2)] == [4, 3]
            loads = command_calls(admin, "script|load")
            admin.script_flush()
            assert not _script_loaded(admin, policy)

            decision = await limiter.hit(policy, "a")
            assert decision.allowed
            assert decision.remaining == 2
            assert _script_loaded(admin, policy)
            assert command_calls(admin, "script|load") == loads + 1
            assert [(await limiter.hit(policy, "a")).allowed for _ in range(3)] == [
                True,
                True,
                False,
            ]
            (key,) = limiter.keys(policy, "a")
            assert admin.llen(key) == 5
        finally:
            await limiter.close()

    with own_server.client() as admin:
        asyncio.run(main(admin))


@pytest.fixture
def flush_after_load(monkeypatch: pytest.MonkeyPatch) -> Callable[[redis.Redis], None]:
    """Arms ``seams.flush_after_every_load`` with a client of the test's."""
    return lambda admin: flush_after_every_load(monkeypatch, admin)


def test_script_flush_between_the_load_and_the_call_sync(
    own_server: RedisServer, key_prefix: str, flush_after_load: Callable[[redis.Redis], None]
):
    """The race on the blocking transport: the call is sent with EVAL, which carries the
    script, and no NOSCRIPT reaches the caller."""
    policy = Policy("flush-race", "5/minute")
    with (
        own_server.client() as admin,
        Limiter.from_url(own_server.url, key_prefix=key_prefix, **PATIENT) as limiter,
    ):
        assert limiter.hit(policy, "a").remaining == 4
        flush_after_load(admin)
        admin.script_flush()
        evals = command_calls(admin, "eval")
        assert limiter.hit(policy, "a").remaining == 3
        assert command_calls(admin, "eval") == evals + 1
        assert [limiter.hit(policy, "a").allowed for _ in range(4)] == [True, True, True, False]


@pytest.mark.parametrize("batching", [True, False], ids=["batching", "no-batching"])
def test_script_flush_between_the_load_and_the_call_async(
    own_server: RedisServer,
    key_prefix: str,
    flush_after_load: Callable[[redis.Redis], None],
    batching: bool,
):
    """The same race on asyncio, with batching on (the pipeline: 8 concurrent calls share one
    SCRIPT LOAD, meet NOSCRIPT again, and each is sent once with EVAL) and off."""
    policy = Policy("flush-race", "20/minute")

    async def main(admin: redis.Redis) -> list[int]:
        options = {**PATIENT, "batching": batching}
        async with AsyncLimiter.from_url(
            own_server.url, key_prefix=key_prefix, **options
        ) as limiter:
            first = (await limiter.hit(policy, "a")).remaining
            flush_after_load(admin)
            admin.script_flush()
            evals = command_calls(admin, "eval")
            loads = command_calls(admin, "script|load")
            decisions = await asyncio.gather(*(limiter.hit(policy, "a") for _ in range(8)))
            assert all(not d.degraded for d in decisions)
            if batching:  # one round trip: one SCRIPT LOAD for the batch, then 8 EVALs
                assert command_calls(admin, "script|load") - loads == 1
                assert command_calls(admin, "eval") - evals == 8
            else:  # 8 connections racing: at least one met the flush after its load
                assert command_calls(admin, "eval") - evals >= 1
            return [first, *sorted((d.remaining for d in decisions), reverse=True)]

    with own_server.client() as admin:
        assert asyncio.run(main(admin)) == [19, *range(18, 10, -1)]


def test_script_flush_before_a_peek_reloads_too(own_server: RedisServer, key_prefix: str):
    policy = Policy("flush-peek", "5/minute")
    with (
        own_server.client() as admin,
        Limiter.from_url(own_server.url, key_prefix=key_prefix, **PATIENT) as limiter,
    ):
        assert limiter.hit(policy, "a").allowed
        admin.script_flush()
        decision = limiter.peek(policy, "a")
        assert decision.allowed
        assert decision.remaining == 4
        assert _script_loaded(admin, policy)


# --- restart -------------------------------------------------------------------------------------


def test_restart_between_hits_sync(own_server: RedisServer, key_prefix: str):
    policy = Policy("restart", "5/minute")
    with Limiter.from_url(own_server.url, key_prefix=key_prefix, **PATIENT) as limiter:
        assert [limiter.hit(policy, "a").remaining for _ in range(2)] == [4, 3]
        own_server.restart()  # kill -9, then an empty server with a cold script cache

        decision = limiter.hit(policy, "a")
        assert isinstance(decision, Decision)
        assert decision.allowed
        assert decision.remaining == 4  # the new server starts empty
        with own_server.client() as admin:
            assert _script_loaded(admin, policy)
            assert command_calls(admin, "script|load") == 1
            assert command_calls(admin, "evalsha") >= 1
        assert [limiter.hit(policy, "a").allowed for _ in range(5)] == [True] * 4 + [False]


@BATCHING
def test_restart_between_hits_async(own_server: RedisServer, key_prefix: str, batching: bool):
    policy = Policy("restart", "5/minute")

    async def main() -> None:
        limiter = AsyncLimiter.from_url(
            own_server.url, key_prefix=key_prefix, batching=batching, **PATIENT
        )
        try:
            assert [(await limiter.hit(policy, "a")).remaining for _ in range(2)] == [4, 3]
            own_server.restart()

            decision = await limiter.hit(policy, "a")
            assert isinstance(decision, Decision)
            assert decision.allowed
            assert decision.remaining == 4
            with own_server.client() as admin:
                assert _script_loaded(admin, policy)
                assert command_calls(admin, "script|load") == 1
                assert command_calls(admin, "evalsha") >= 1
            allowed = [(await limiter.hit(policy, "a")).allowed for _ in range(5)]
            assert allowed == [True] * 4 + [False]
        finally:
            await limiter.close()

    asyncio.run(main())


def test_restart_with_several_pooled_connections_sync(own_server: RedisServer, key_prefix: str):
    """Every stale pooled connection is replaced, not only the first one used."""
    policy = Policy("restart-pool", "100/minute")
    with Limiter.from_url(own_server.url, key_prefix=key_prefix, **PATIENT) as limiter:
        client = limiter.storage.client  # type: ignore[attr-defined]
        pool = client.connection_pool
        held = [get_connection(pool) for _ in range(4)]  # any redis-py version
        for connection in held:
            connection.send_command("PING")
            assert connection.read_response() in (b"PONG", "PONG")
            pool.release(connection)
        own_server.restart()
        decisions = [limiter.hit(policy, "a") for _ in range(8)]
        assert [d.remaining for d in decisions] == list(range(99, 91, -1))


@BATCHING
def test_restart_with_several_pooled_connections_async(
    own_server: RedisServer, key_prefix: str, batching: bool
):
    policy = Policy("restart-pool", "100/minute")

    async def main() -> None:
        limiter = AsyncLimiter.from_url(
            own_server.url, key_prefix=key_prefix, batching=batching, **PATIENT
        )
        try:
            # Concurrent peeks leave several open connections in the pool.
            await asyncio.gather(*(limiter.peek(policy, "a") for _ in range(4)))
            own_server.restart()
            decisions = await asyncio.gather(*(limiter.hit(policy, "a") for _ in range(8)))
            assert all(d.allowed for d in decisions)
            assert sorted(d.remaining for d in decisions) == list(range(92, 100))
        finally:
            await limiter.close()

    asyncio.run(main())


# --- server down ---------------------------------------------------------------------------------


def _assert_unavailable(excinfo: pytest.ExceptionInfo[StorageUnavailable], elapsed: float) -> None:
    exc = excinfo.value
    assert isinstance(exc, StorageError)
    assert not isinstance(exc, redis.RedisError)  # translated, not leaked
    assert isinstance(exc.__cause__, redis.RedisError)
    assert elapsed < 2.0


def test_server_down_raises_storage_unavailable_sync(own_server: RedisServer, key_prefix: str):
    policy = Policy("down", "5/minute")
    warm = Limiter.from_url(own_server.url, key_prefix=key_prefix, **FAST)
    try:
        assert warm.hit(policy, "a").allowed  # a pooled connection to the soon-dead server
        own_server.kill()
        cold = Limiter.from_url(own_server.url, key_prefix=key_prefix, **FAST)
        try:
            for limiter in (warm, cold):
                for call in (limiter.hit, limiter.peek, limiter.reset):
                    started = time.monotonic()
                    with pytest.raises(StorageUnavailable) as excinfo:
                        call(policy, "a")
                    _assert_unavailable(excinfo, time.monotonic() - started)
        finally:
            cold.close()
        own_server.start()
        decision = warm.hit(policy, "a")  # the same limiter works once the server is back
        assert decision.allowed
        assert decision.remaining == 4
    finally:
        warm.close()


@BATCHING
def test_server_down_raises_storage_unavailable_async(
    own_server: RedisServer, key_prefix: str, batching: bool
):
    policy = Policy("down", "5/minute")

    async def main() -> None:
        warm = AsyncLimiter.from_url(
            own_server.url, key_prefix=key_prefix, batching=batching, **FAST
        )
        try:
            assert (await warm.hit(policy, "a")).allowed
            own_server.kill()
            cold = AsyncLimiter.from_url(
                own_server.url, key_prefix=key_prefix, batching=batching, **FAST
            )
            try:
                for limiter in (warm, cold):
                    for call in (limiter.hit, limiter.peek, limiter.reset):
                        started = time.monotonic()
                        with pytest.raises(StorageUnavailable) as excinfo:
                            await call(policy, "a")
                        _assert_unavailable(excinfo, time.monotonic() - started)
            finally:
                await cold.close()
            own_server.start()
            decision = await warm.hit(policy, "a")
            assert decision.allowed
            assert decision.remaining == 4
        finally:
            await warm.close()

    asyncio.run(main())


# --- a frozen server: timeouts are not retried ---------------------------------------------------


def _stats(admin: redis.Redis) -> tuple[int, int]:
    """(EVALSHA calls, connections ever accepted)."""
    return command_calls(admin, "evalsha"), int(admin.info("stats")["total_connections_received"])


def _assert_ran_once(admin: redis.Redis, before: tuple[int, int]) -> None:
    """The timed-out EVALSHA, still queued in the thawed server's socket, runs exactly once.

    A retry would have sent a second EVALSHA (on a new connection, as redis-py reconnects
    before retrying), so it would show as a second call or at least a new connection.
    """
    deadline = time.monotonic() + 10
    while _stats(admin)[0] < before[0] + 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the server's counters, not synchronising threads
    for _ in range(3):  # let the server drain anything else that was queued
        admin.ping()
    evalsha, connections = _stats(admin)
    assert evalsha == before[0] + 1
    assert connections == before[1]


def test_timeout_is_not_retried_sync(own_server: RedisServer, key_prefix: str):
    policy = Policy("frozen", "5/minute")
    with (
        own_server.client() as admin,
        Limiter.from_url(own_server.url, key_prefix=key_prefix, **FAST) as limiter,
    ):
        assert limiter.hit(policy, "a").allowed  # warm: connection open, script loaded
        before = _stats(admin)
        with own_server.frozen():
            started = time.monotonic()
            with pytest.raises(StorageTimeout) as excinfo:
                limiter.hit(policy, "a")
            elapsed = time.monotonic() - started
        assert 0.195 <= elapsed < 1.0  # the configured timeout (0.2 s), not none or zero
        assert isinstance(excinfo.value.__cause__, redis.TimeoutError)
        _assert_ran_once(admin, before)
        # The call ran after all: the log holds both hits, and the limiter still works.
        (key,) = limiter.keys(policy, "a")
        assert admin.llen(key) == 2
        assert limiter.hit(policy, "a").remaining == 2


@BATCHING
def test_timeout_is_not_retried_async(own_server: RedisServer, key_prefix: str, batching: bool):
    policy = Policy("frozen", "5/minute")

    async def main(admin: redis.Redis) -> None:
        limiter = AsyncLimiter.from_url(
            own_server.url, key_prefix=key_prefix, batching=batching, **FAST
        )
        try:
            assert (await limiter.hit(policy, "a")).allowed
            before = _stats(admin)
            with own_server.frozen():
                started = time.monotonic()
                with pytest.raises(StorageTimeout) as excinfo:
                    await limiter.hit(policy, "a")
                elapsed = time.monotonic() - started
            assert elapsed < 1.0
            assert isinstance(excinfo.value.__cause__, redis.TimeoutError)
            _assert_ran_once(admin, before)
            (key,) = limiter.keys(policy, "a")
            assert admin.llen(key) == 2
            assert (await limiter.hit(policy, "a")).remaining == 2
        finally:
            await limiter.close()

    with own_server.client() as admin:
        asyncio.run(main(admin))


@BATCHING
def test_a_frozen_server_times_out_a_new_connection_too(
    own_server: RedisServer, key_prefix: str, batching: bool
):
    """A fresh limiter against a frozen server: the TCP connect succeeds (the kernel accepts
    it), the handshake gets no answer, and the caller gets StorageTimeout, promptly."""
    policy = Policy("frozen-new", "5/minute")

    async def hit_async() -> None:
        limiter = AsyncLimiter.from_url(
            own_server.url, key_prefix=key_prefix, batching=batching, **FAST
        )
        try:
            await limiter.hit(policy, "a")
        finally:
            await limiter.close()

    with own_server.frozen():
        started = time.monotonic()
        with (
            Limiter.from_url(own_server.url, key_prefix=key_prefix, **FAST) as limiter,
            pytest.raises(StorageTimeout),
        ):
            limiter.hit(policy, "a")
        assert time.monotonic() - started < 1.0
        started = time.monotonic()
        with pytest.raises(StorageTimeout):
            asyncio.run(hit_async())
        assert time.monotonic() - started < 1.0


@BATCHING
def test_a_cancelled_async_hit_leaves_no_stale_reply(
    own_server: RedisServer, key_prefix: str, batching: bool
):
    """A hit cancelled while waiting for its reply must not leave that reply on a pooled
    connection, where the next call would read it as its own answer."""
    policy = Policy("cancelled", "5/minute")

    async def main() -> None:
        limiter = AsyncLimiter.from_url(
            own_server.url, key_prefix=key_prefix, batching=batching, **PATIENT
        )
        try:
            assert (await limiter.hit(policy, "a")).remaining == 4
            with own_server.frozen(), pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(limiter.hit(policy, "a"), 0.1)
            # A different identity: its fresh log must not get identity a's late reply.
            other = await limiter.hit(policy, "b")
            assert other.allowed
            assert other.remaining == 4
            # The cancelled hit may or may not have run; either way the count is consistent.
            again = await limiter.hit(policy, "a")
            (key,) = limiter.keys(policy, "a")
            with own_server.client() as admin:
                assert again.remaining == 5 - admin.llen(key)
        finally:
            await limiter.close()

    asyncio.run(main())
