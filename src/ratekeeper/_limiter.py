"""``Limiter`` (blocking) and ``AsyncLimiter`` (asyncio): thin drivers over the shared core.

Everything but I/O lives in ``_core`` (key building, argument encoding, reading the reply) and
``_guard`` (breaker, failure modes, deny cache, metrics); the two classes below only pass a call
to their storage and its reply or error back.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from ._breaker import CircuitBreaker
from ._clock import Clock
from ._core import Call, Core
from ._decision import Decision
from ._errors import RequestRejected, StorageError
from ._fleet import heartbeat_async, heartbeat_sync
from ._guard import DEFAULT_DENY_CACHE_SIZE, Guard
from ._keys import DEFAULT_KEY_PREFIX, Identity
from ._lease import Acquiring, AsyncLease, Lease
from ._policy import Policy
from ._storage import AsyncStorage, SyncStorage, open_async, open_sync
from .metrics import Metrics

__all__ = ["AsyncLimiter", "Limiter"]


class _Base:
    """What both limiters hold: the core, the guard, and the options that configure them."""

    def __init__(
        self,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
        failure_mode: str = "open",
        local_share: float = 1.0,
        breaker: CircuitBreaker | None = None,
        deny_cache: int = DEFAULT_DENY_CACHE_SIZE,
        metrics: Metrics | None = None,
    ) -> None:
        self._core = Core(key_prefix=key_prefix, clock=clock)
        self._guard = Guard(
            self._core,
            failure_mode=failure_mode,
            local_share=local_share,
            breaker=breaker,
            deny_cache=deny_cache,
            metrics=metrics,
            clock=clock,
        )

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker in front of the store (``breaker.state``)."""
        return self._guard.breaker

    def keys(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        """The store keys that hold ``identity``'s state under ``policy`` (for debugging)."""
        return self._core.reset_keys(policy, identity)


_LIMITER_OPTIONS = frozenset(
    {"key_prefix", "clock", "failure_mode", "local_share", "breaker", "deny_cache", "metrics"}
)


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(limiter options, storage options).

    A call is slow for the default breaker when it takes longer than the store ``timeout``
    the user chose (20 ms by default): a patient limiter is not tripped by calls it waits for.
    """
    mine = {k: v for k, v in options.items() if k in _LIMITER_OPTIONS}
    theirs = {k: v for k, v in options.items() if k not in _LIMITER_OPTIONS}
    timeout = theirs.get("timeout")
    if (
        "breaker" not in mine
        and isinstance(timeout, (int, float))
        and not isinstance(timeout, bool)
        and timeout > 0
    ):
        mine["breaker"] = CircuitBreaker(slow_call=float(timeout))
    return mine, theirs


class Limiter(_Base):
    """Decides whether an identity may spend ``cost`` under a policy, blocking.

    >>> limiter = Limiter.from_url("memory://")
    >>> policy = Policy("api", "2/second")
    >>> [limiter.hit(policy, "alice").allowed for _ in range(3)]
    [True, True, False]
    """

    def __init__(self, storage: SyncStorage, **options: Any) -> None:
        super().__init__(**options)
        self.storage = storage

    @classmethod
    def from_url(cls, url: str = "memory://", **options: Any) -> Limiter:
        """A limiter on ``memory://``, ``redis://``, ``rediss://`` or ``unix://``.

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
        * ``metrics``: a :class:`ratekeeper.metrics.Metrics` hook.
        * Redis URLs also take ``timeout`` (seconds per call, default 0.02),
          ``connect_timeout`` (default 0.02), ``max_connections`` and ``redis_options`` (a
          dict passed to redis-py).
        """
        mine, storage_options = _split(options)
        limiter = cls.__new__(cls)
        _Base.__init__(limiter, **mine)  # validate before connecting
        limiter.storage = open_sync(url, clock=mine.get("clock"), **storage_options)
        return limiter

    def _run(self, call: Call) -> Decision:
        guard = self._guard
        early = guard.before(call)
        if early is not None:
            return early
        started = guard.started()
        try:
            reply = self.storage.run(call.script, call.keys, call.args)
        except StorageError as exc:
            return guard.failed(call, exc, started)
        except RequestRejected:
            guard.rejected(started)
            raise
        decision = guard.succeeded(call, reply, started)
        if guard.fleet is not None:  # local_share="auto": a heartbeat when one is due
            heartbeat_sync(guard, self.storage)
        return decision

    def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Consume ``cost`` if every rate of ``policy`` admits it; otherwise change nothing."""
        if (
            cost == 1
            and type(cost) is int
            and type(policy) is Policy
            and self._guard.caches(policy)
        ):
            cached = self._guard.cached(self._core.first_key(policy, identity))
            if cached is not None:  # a flood on a denied key: no call is even built
                return cached
        return self._run(self._core.hit(policy, identity, cost))

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


class AsyncLimiter(_Base):
    """Decides whether an identity may spend ``cost`` under a policy, on asyncio.

    The same methods and options as :class:`Limiter`, as coroutines.
    """

    def __init__(self, storage: AsyncStorage, **options: Any) -> None:
        super().__init__(**options)
        self.storage = storage

    @classmethod
    def from_url(cls, url: str = "memory://", **options: Any) -> AsyncLimiter:
        """An asyncio limiter; the URLs and options are those of :meth:`Limiter.from_url`."""
        mine, storage_options = _split(options)
        limiter = cls.__new__(cls)
        _Base.__init__(limiter, **mine)
        limiter.storage = open_async(url, clock=mine.get("clock"), **storage_options)
        return limiter

    async def _run(self, call: Call) -> Decision:
        guard = self._guard
        early = guard.before(call)
        if early is not None:
            return early
        started = guard.started()
        try:
            reply = await self.storage.run(call.script, call.keys, call.args)
        except StorageError as exc:
            return guard.failed(call, exc, started)
        except RequestRejected:
            guard.rejected(started)
            raise
        if guard.fleet is not None:  # local_share="auto": a heartbeat task when one is due
            heartbeat_async(guard, self.storage)
        return guard.succeeded(call, reply, started)

    async def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Consume ``cost`` if every rate of ``policy`` admits it; otherwise change nothing."""
        if (
            cost == 1
            and type(cost) is int
            and type(policy) is Policy
            and self._guard.caches(policy)
        ):
            cached = self._guard.cached(self._core.first_key(policy, identity))
            if cached is not None:
                return cached
        return await self._run(self._core.hit(policy, identity, cost))

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
