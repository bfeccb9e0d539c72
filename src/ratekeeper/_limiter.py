"""``Limiter`` (blocking) and ``AsyncLimiter`` (asyncio): thin drivers over the shared core.

Everything but I/O lives in ``_core`` (key building, argument encoding, reading the reply) and
``_guard`` (breaker, failure modes, deny cache, metrics); the two classes below only pass a call
to their storage and its reply or error back.
"""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter
from types import TracebackType
from typing import Any, Generic, TypeVar

from ._breaker import CircuitBreaker
from ._clock import Clock
from ._core import Call, Core
from ._decision import Decision
from ._errors import RequestRejected, StorageError
from ._fleet import heartbeat_async, heartbeat_sync
from ._guard import DEFAULT_DENY_CACHE_MAX_AGE, DEFAULT_DENY_CACHE_SIZE, Guard
from ._keys import DEFAULT_KEY_PREFIX, Identity
from ._lease import Acquiring, AsyncLease, Lease
from ._opening import STORAGE_URL_VARIABLE, default_breaker, storage_url, store_options
from ._policy import Policy
from ._storage import (
    AsyncStorage,
    SyncStorage,
    open_async,
    open_client_async,
    open_client_sync,
    open_sync,
)
from .metrics import Metrics
from .typing import FailureMode, LocalShare

__all__ = ["STORAGE_URL_VARIABLE", "AsyncLimiter", "Limiter"]

log = logging.getLogger("ratekeeper")


_S = TypeVar("_S", SyncStorage, AsyncStorage)


class _Base(Generic[_S]):
    """What both limiters hold: the storage, the core, the guard, and the options that
    configure them (described in :meth:`Limiter.from_url`)."""

    def __init__(
        self,
        storage: _S,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
        failure_mode: FailureMode = "open",
        local_share: LocalShare = 1.0,
        breaker: CircuitBreaker | None = None,
        deny_cache: int = DEFAULT_DENY_CACHE_SIZE,
        deny_cache_max_age: float = DEFAULT_DENY_CACHE_MAX_AGE,
        metrics: Metrics | None = None,
    ) -> None:
        self._core = Core(key_prefix=key_prefix, clock=clock)
        self._guard = Guard(
            self._core,
            failure_mode=failure_mode,
            local_share=local_share,
            breaker=breaker,
            deny_cache=deny_cache,
            deny_cache_max_age=deny_cache_max_age,
            metrics=metrics,
            clock=clock,
            node_of=getattr(storage, "node_of", None),
        )
        self.storage: _S = storage

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker in front of the store (``breaker.state``): on a cluster or
        Sentinel, the one in front of calls not yet placed on a node (see ``breakers``)."""
        return self._guard.breaker

    @property
    def breakers(self) -> dict[str, CircuitBreaker]:
        """On a cluster or Sentinel, the breaker of each primary seen so far, by
        ``host:port``: each is made like ``breaker``, and a slow or dead node opens only its
        own, so the keys of the other nodes are still decided by the store. Empty on a single
        server and ``memory://``."""
        return self._guard.nodes

    def keys(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        """The store keys that hold ``identity``'s state under ``policy`` (for debugging)."""
        return self._core.reset_keys(policy, identity)


class Limiter(_Base[SyncStorage]):
    """Decides whether an identity may spend ``cost`` under a policy, blocking.

    >>> limiter = Limiter.from_url("memory://")
    >>> policy = Policy("api", "2/second")
    >>> [limiter.hit(policy, "alice").allowed for _ in range(3)]
    [True, True, False]

    ``Limiter(storage, **options)`` takes a storage already opened; :meth:`from_url` and
    :meth:`from_client` open one, and describe the options.
    """

    @classmethod
    def from_url(
        cls,
        url: str | None = None,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
        failure_mode: FailureMode = "open",
        local_share: LocalShare = 1.0,
        breaker: CircuitBreaker | None = None,
        deny_cache: int = DEFAULT_DENY_CACHE_SIZE,
        deny_cache_max_age: float = DEFAULT_DENY_CACHE_MAX_AGE,
        metrics: Metrics | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        max_connections: int | None = None,
        redis_options: dict[str, Any] | None = None,
    ) -> Limiter:
        """A limiter on ``memory://``, ``redis://``, ``rediss://``, ``unix://``,
        ``redis+cluster://`` or ``redis+sentinel://`` (``valkey`` may replace ``redis``).

        Without a URL, the one in the ``RATEKEEPER_STORAGE_URL`` environment variable; without
        that, ``memory://``, and a warning (once per process) that its limits are per process.

        Options, all keyword-only:

        * ``key_prefix``: the first part of every key (default ``"ratekeeper"``).
        * ``clock``: client time instead of the store's (a callable returning epoch seconds).
        * ``failure_mode``: what decides when the store cannot: ``"open"`` (allow, the
          default), ``"closed"`` (deny), ``"local"`` (an in-process limiter at ``local_share``
          of each limit) or ``"raise"`` (the StorageError reaches the caller). A policy's own
          ``failure_mode`` overrides it.
        * ``local_share``: the share of each limit a process may grant in ``local`` mode, e.g.
          ``1 / number_of_instances`` (default 1.0).
        * ``breaker``: a configured :class:`CircuitBreaker` (default: one with its defaults,
          whose ``slow_call`` is the ``timeout`` below when one is given).
        * ``deny_cache``: entries in the local cache of exact denials (default 10,000; 0 = off).
        * ``deny_cache_max_age``: seconds a cached denial answers before the store is asked
          again (default 1.0), so a reset or a changed limit made by another process is seen
          within it. While the store cannot answer, a cached denial still answers until its
          wait ends: a denial the store made stays a denial through a fault.
        * ``metrics``: a :class:`ratekeeper.metrics.Metrics` hook.

        Redis and Valkey URLs also take (``memory://`` refuses them; None: the default):

        * ``timeout``: seconds to wait for each reply (default 0.02).
        * ``connect_timeout``: seconds to wait for a new connection (default 0.02).
        * ``max_connections``: the size of the connection pool (default: redis-py's).
        * ``redis_options``: a dict of further keyword arguments for the redis-py client.

        A bad value is a ConfigError naming it; an unknown option a TypeError naming it.
        """
        storage = open_sync(
            storage_url(url),
            clock=clock,
            **store_options(timeout, connect_timeout, max_connections, redis_options),
        )
        try:
            return cls(
                storage,
                key_prefix=key_prefix,
                clock=clock,
                failure_mode=failure_mode,
                local_share=local_share,
                breaker=default_breaker(breaker, timeout),
                deny_cache=deny_cache,
                deny_cache_max_age=deny_cache_max_age,
                metrics=metrics,
            )
        except BaseException:
            storage.close()  # connects on first use: nothing was sent
            raise

    @classmethod
    def from_client(
        cls,
        client: Any,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
        failure_mode: FailureMode = "open",
        local_share: LocalShare = 1.0,
        breaker: CircuitBreaker | None = None,
        deny_cache: int = DEFAULT_DENY_CACHE_SIZE,
        deny_cache_max_age: float = DEFAULT_DENY_CACHE_MAX_AGE,
        metrics: Metrics | None = None,
    ) -> Limiter:
        """A limiter on your own redis-py client: ``redis.Redis`` (Sentinel-managed or not:
        ``Sentinel.master_for(...)``) or ``redis.cluster.RedisCluster``. valkey-py clients are
        not accepted; ``redis.Redis`` speaks to Valkey.

        The client is used as you configured it: its connection pool, timeouts, retries, TLS
        and credentials; ratekeeper changes nothing on it, and :meth:`close` leaves it open
        (closing it is yours). A configuration that gives up one of ratekeeper's guarantees
        (no ``socket_timeout``, redis-py's cluster client resending a timed-out script) is
        logged once as a warning. The wrong kind of client is a ConfigError.

        The options are those of :meth:`from_url`, without the store options (your client has
        them). The default breaker counts a call slow past 20 ms; pass
        ``breaker=CircuitBreaker(slow_call=...)`` to match a longer ``socket_timeout``.
        """
        storage = open_client_sync(client)
        try:
            return cls(
                storage,
                key_prefix=key_prefix,
                clock=clock,
                failure_mode=failure_mode,
                local_share=local_share,
                breaker=breaker,
                deny_cache=deny_cache,
                deny_cache_max_age=deny_cache_max_age,
                metrics=metrics,
            )
        except BaseException:
            storage.close()  # gives nothing back: the client stays as it was
            raise

    def _run(self, call: Call, cache_asked: bool = False) -> Decision:
        guard = self._guard
        breaker = guard.breaker if guard.one_breaker else guard.breaker_of(call.keys[0])
        early = guard.before(call, breaker, cache_asked)
        if early is not None:
            return early
        started = perf_counter()  # guard.started(), without the call
        try:
            reply = self.storage.run(call.script, call.keys, call.args)
        except StorageError as exc:
            return guard.failed(call, exc, started, breaker)
        except RequestRejected:
            guard.rejected(started, breaker)
            raise
        decision = guard.succeeded(call, reply, started, breaker)
        if guard.fleet is not None:  # local_share="auto": a heartbeat when one is due
            heartbeat_sync(guard, self.storage)
        return decision

    def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Consume ``cost`` if every rate of ``policy`` admits it; otherwise change nothing."""
        core = self._core
        if (
            cost == 1
            and type(cost) is int
            and type(policy) is Policy
            and self._guard.caches(policy)
        ):
            keys = core.keys_of(policy, identity)
            cached = self._guard.cached(keys[0])
            if cached is not None:  # a flood on a denied key: no call is even built
                return cached
            return self._run(core.hit(policy, identity, 1, keys), True)  # keys built once
        return self._run(core.hit(policy, identity, cost))

    def peek(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Whether a hit of ``cost`` would pass now, without consuming anything."""
        return self._run(self._core.peek(policy, identity, cost))

    def acquire(self, policy: Policy, identity: Identity, cost: int = 1) -> Lease:
        """Take a lease of ``cost`` units under a ``concurrency`` policy.

        The lease is granted only if ``lease.allowed``; release it with ``lease.release()`` or
        by using it as a context manager.
        """
        call = self._core.acquire(policy, identity, cost)
        return Lease(
            call, self._run(call), lambda c: self._run(self._core.release(c, identity)).allowed
        )

    def reset(self, policy: Policy, identity: Identity) -> None:
        """Forget everything ``identity`` has consumed under ``policy``. Raises StorageError
        if the store cannot be reached: a reset is never silently skipped."""
        keys = self._core.reset_keys(policy, identity)
        self._guard.forget(keys)
        self.storage.delete(keys)

    def close(self) -> None:
        """Release the storage's connections."""
        self.storage.close()

    def __enter__(self) -> Limiter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def wait(
        self, policy: Policy, identity: Identity, cost: int = 1, *, timeout: float | None = None
    ) -> Decision:
        """Hit until admitted and return the admitting decision, sleeping the exact
        ``retry_after`` of each denial plus jitter (up to 10%, at most 1 s).

        Raises :class:`RateLimited` (``.decision``: the last denial) as soon as the next try
        would come after ``timeout`` seconds (None: wait as long as it takes), and at once when
        the cost can never pass. See ``ratekeeper._wait`` for the rule.
        """
        from ._wait import wait_sync

        return wait_sync(self, policy, identity, cost, timeout)


class AsyncLimiter(_Base[AsyncStorage]):
    """Decides whether an identity may spend ``cost`` under a policy, on asyncio.

    The same methods and options as :class:`Limiter`, as coroutines.
    ``AsyncLimiter(storage, **options)`` takes a storage already opened.
    """

    @classmethod
    def from_url(
        cls,
        url: str | None = None,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
        failure_mode: FailureMode = "open",
        local_share: LocalShare = 1.0,
        breaker: CircuitBreaker | None = None,
        deny_cache: int = DEFAULT_DENY_CACHE_SIZE,
        deny_cache_max_age: float = DEFAULT_DENY_CACHE_MAX_AGE,
        metrics: Metrics | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        max_connections: int | None = None,
        redis_options: dict[str, Any] | None = None,
        batching: bool = True,
    ) -> AsyncLimiter:
        """An asyncio limiter; the URLs (and ``RATEKEEPER_STORAGE_URL``) and options are those
        of :meth:`Limiter.from_url`, and ``batching`` (default True; Redis and Valkey only)
        coalesces concurrent calls into pipelined round trips."""
        # An asyncio storage opens no connection before its first call: if an option below is
        # refused, there is nothing to close.
        storage = open_async(
            storage_url(url),
            clock=clock,
            batching=batching,
            **store_options(timeout, connect_timeout, max_connections, redis_options),
        )
        return cls(
            storage,
            key_prefix=key_prefix,
            clock=clock,
            failure_mode=failure_mode,
            local_share=local_share,
            breaker=default_breaker(breaker, timeout),
            deny_cache=deny_cache,
            deny_cache_max_age=deny_cache_max_age,
            metrics=metrics,
        )

    @classmethod
    def from_client(
        cls,
        client: Any,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
        failure_mode: FailureMode = "open",
        local_share: LocalShare = 1.0,
        breaker: CircuitBreaker | None = None,
        deny_cache: int = DEFAULT_DENY_CACHE_SIZE,
        deny_cache_max_age: float = DEFAULT_DENY_CACHE_MAX_AGE,
        metrics: Metrics | None = None,
        batching: bool = True,
    ) -> AsyncLimiter:
        """An asyncio limiter on your own ``redis.asyncio.Redis`` (Sentinel-managed or not) or
        ``redis.asyncio.cluster.RedisCluster``: what :meth:`Limiter.from_client` says of the
        client holds here too (used as configured, never changed or closed), and ``batching``
        is that of :meth:`from_url`."""
        return cls(
            open_client_async(client, batching=batching),
            key_prefix=key_prefix,
            clock=clock,
            failure_mode=failure_mode,
            local_share=local_share,
            breaker=breaker,
            deny_cache=deny_cache,
            deny_cache_max_age=deny_cache_max_age,
            metrics=metrics,
        )

    async def _run(self, call: Call, cache_asked: bool = False) -> Decision:
        guard = self._guard
        breaker = guard.breaker if guard.one_breaker else guard.breaker_of(call.keys[0])
        early = guard.before(call, breaker, cache_asked)
        if early is not None:
            await asyncio.sleep(0)  # answered here: still let other tasks run, as I/O would
            return early
        started = perf_counter()  # guard.started(), without the call
        try:
            reply = await self.storage.run(call.script, call.keys, call.args)
        except StorageError as exc:
            return guard.failed(call, exc, started, breaker)
        except RequestRejected:
            guard.rejected(started, breaker)
            raise
        if guard.fleet is not None:  # local_share="auto": a heartbeat task when one is due
            heartbeat_async(guard, self.storage)
        return guard.succeeded(call, reply, started, breaker)

    async def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Consume ``cost`` if every rate of ``policy`` admits it; otherwise change nothing."""
        core = self._core
        if (
            cost == 1
            and type(cost) is int
            and type(policy) is Policy
            and self._guard.caches(policy)
        ):
            keys = core.keys_of(policy, identity)
            cached = self._guard.cached(keys[0])
            if cached is not None:
                await asyncio.sleep(0)  # a flood of cached denials must not hold the loop
                return cached
            return await self._run(core.hit(policy, identity, 1, keys), True)  # keys built once
        return await self._run(core.hit(policy, identity, cost))

    async def peek(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Whether a hit of ``cost`` would pass now, without consuming anything."""
        return await self._run(self._core.peek(policy, identity, cost))

    def acquire(self, policy: Policy, identity: Identity, cost: int = 1) -> Acquiring:
        """Take a lease under a ``concurrency`` policy: ``lease = await limiter.acquire(...)``
        or ``async with limiter.acquire(...) as lease:`` (released on exit)."""
        call = self._core.acquire(policy, identity, cost)

        async def release(acquired: Call) -> bool:
            return (await self._run(self._core.release(acquired, identity))).allowed

        async def take() -> AsyncLease:
            return AsyncLease(call, await self._run(call), release)

        return Acquiring(take)

    async def reset(self, policy: Policy, identity: Identity) -> None:
        """Forget everything ``identity`` has consumed under ``policy``. Raises StorageError
        if the store cannot be reached: a reset is never silently skipped."""
        keys = self._core.reset_keys(policy, identity)
        self._guard.forget(keys)
        await self.storage.delete(keys)

    async def close(self) -> None:
        """Release the storage's connections."""
        await self.storage.close()

    async def __aenter__(self) -> AsyncLimiter:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def wait(
        self, policy: Policy, identity: Identity, cost: int = 1, *, timeout: float | None = None
    ) -> Decision:
        """:meth:`Limiter.wait` on asyncio: ``await limiter.wait(policy, identity)``."""
        from ._wait import wait_async

        return await wait_async(self, policy, identity, cost, timeout)
