"""``Limiter`` (blocking) and ``AsyncLimiter`` (asyncio): the two drivers of the decision path.

Everything but I/O lives in the engine: ``path`` (the order of every step: deny cache, breaker,
store call, decision, heartbeat), ``core`` (keys, arguments, replies) and ``guard`` (breakers,
failure modes, deny cache, metrics). ``LimiterBase`` holds what both limiters hold alike (the
storage, the core, the guard, the top offenders' summary and the path over them, built from the
options) and answers what needs no I/O; each class below only runs the steps on its storage
(``_drive``) and hands the replies back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._algorithms.policy import Policy
from .._engine.breaker import CircuitBreaker
from .._engine.core import Call, Core
from .._engine.guard import DEFAULT_DENY_CACHE_MAX_AGE, DEFAULT_DENY_CACHE_SIZE, Guard
from .._engine.keys import DEFAULT_KEY_PREFIX, Identity
from .._engine.metrics import Metrics
from .._engine.path import Later, Path, Run, Steps
from .._engine.top import FLUSH_EVERY, Offenders, TopOffenders
from .._model.clock import Clock
from .._model.decision import Decision
from .._model.errors import ConfigError, RequestRejected, StorageError
from .._model.options import FailureMode, LocalShare
from .._storage import (
    AsyncStorage,
    SyncStorage,
    open_async,
    open_client_async,
    open_client_sync,
    open_sync,
)
from .lease import AsyncLease, Lease, Pending
from .options import STORAGE_URL_VARIABLE, LimiterOptions, UrlOptions, check_options, opening
from .reservation import AsyncReservation, Reservation

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["STORAGE_URL_VARIABLE", "AsyncLimiter", "Limiter"]

log = logging.getLogger("ratekeeper")


_S = TypeVar("_S", SyncStorage, AsyncStorage)

#: Every limiter's top offenders: a forked child drops what its parent counted (the parent
#: merges it).
_TOPS: weakref.WeakSet[TopOffenders] = weakref.WeakSet()


def _forget_tops() -> None:
    for top in list(_TOPS):
        top.forget()


os.register_at_fork(after_in_child=_forget_tops)


class LimiterBase(Generic[_S]):
    """What both limiters hold: the storage, the core, the guard and the path over them, and
    the options (:class:`ratekeeper.typing.LimiterOptions`, described in
    :meth:`Limiter.from_url`)."""

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
        top_offenders: int = 64,
        top_hash_key: bytes | str | None = None,
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
        self._top: TopOffenders | None = None
        if isinstance(top_hash_key, str):
            top_hash_key = top_hash_key.encode()
        if top_offenders != 0:
            self._top = TopOffenders(key_prefix, top_offenders, top_hash_key, clock or time.time)
            self._top.wake = self._wake_top
            _TOPS.add(self._top)
        elif top_hash_key is not None:
            raise ConfigError("top_hash_key needs top_offenders")
        self._path = Path(self._core, self._guard, self._top)
        self._closing = threading.Event()
        self._merging: set[asyncio.Task[None]] = set()
        self._merge_timer: asyncio.TimerHandle | None = None
        self.storage: _S = storage

    def _wake_top(self) -> None:
        """Merge the top offenders' summary into the store in ``FLUSH_EVERY`` seconds."""
        raise NotImplementedError

    def _top_read(self, policy: Policy | str, since: float, limit: int) -> tuple[Any, ...]:
        if self._top is None:
            raise ConfigError("this limiter counts no top offenders (top_offenders=0)")
        name = policy.name if isinstance(policy, Policy) else policy
        if not isinstance(name, str):
            raise ConfigError(f"policy must be a Policy or its name, got {policy!r}")
        return name, self._top.read_call(name, since, limit)

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

    def cached(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision | None:
        """The denial this process's deny cache holds for a hit of ``cost``, or None; asks no
        store and consumes nothing (a stack of policies asks each before charging any)."""
        guard = self._guard
        if policy.algorithm not in guard.cacheable:
            return None
        cached = guard.cached(self._core.first_key(policy, identity), cost)
        if cached is not None and self._top is not None:
            self._top.record(policy, identity, cost)  # the request it answers is denied
        return cached


_STORE_FAULTS = (StorageError, RequestRejected)


class Limiter(LimiterBase[SyncStorage]):
    """Decides whether an identity may spend ``cost`` under a policy, blocking.

    >>> limiter = Limiter.from_url("memory://")
    >>> policy = Policy("api", "2/second")
    >>> [limiter.hit(policy, "alice").allowed for _ in range(3)]
    [True, True, False]

    ``Limiter(storage, **options)`` takes a storage already opened; :meth:`from_url` and
    :meth:`from_client` open one, and describe the options.
    """

    @classmethod
    def from_url(cls, url: str | None = None, **options: Unpack[UrlOptions]) -> Limiter:
        """A limiter on ``memory://``, ``redis://``, ``rediss://``, ``unix://``,
        ``redis+cluster://`` or ``redis+sentinel://`` (``valkey`` may replace ``redis``).

        Without a URL, the one in the ``RATEKEEPER_STORAGE_URL`` environment variable; without
        that, ``memory://``, and a warning (once per process) that its limits are per process.

        Options, all keyword-only (:class:`ratekeeper.typing.UrlOptions`):

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
        url, store, limiter = opening("Limiter.from_url", url, options)
        storage = open_sync(url, **store)
        try:
            return cls(storage, **limiter)
        except BaseException:
            storage.close()  # connects on first use: nothing was sent
            raise

    @classmethod
    def from_client(cls, client: Any, **options: Unpack[LimiterOptions]) -> Limiter:
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
        check_options("Limiter.from_client", options)
        storage = open_client_sync(client)
        try:
            return cls(storage, **options)
        except BaseException:
            storage.close()  # gives nothing back: the client stays as it was
            raise

    def _drive(self, steps: Decision | Steps) -> Any:
        """Run ``steps`` on the storage, in this thread; their result."""
        if isinstance(steps, Decision):
            return steps
        run = self.storage.run
        try:
            step = next(steps)
            while True:
                if isinstance(step, Later):  # a heartbeat: in place, its outcome told, not raised
                    self._drive(step.steps)
                    step = next(steps)
                    continue
                outcome: object
                try:
                    outcome = run(step.script, step.keys, step.args)
                except _STORE_FAULTS as fault:
                    outcome = fault
                step = steps.send(outcome)
        except StopIteration as done:
            return done.value

    def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Consume ``cost`` if every rate of ``policy`` admits it; otherwise change nothing."""
        return self._drive(self._path.hit(policy, identity, cost))  # type: ignore[no-any-return]

    def peek(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Whether a hit of ``cost`` would pass now, without consuming anything."""
        return self._drive(self._path.peek(policy, identity, cost))  # type: ignore[no-any-return]

    def acquire(self, policy: Policy, identity: Identity, cost: int = 1) -> Lease:
        """Take a lease of ``cost`` units under a ``concurrency`` policy.

        The lease is granted only if ``lease.allowed``; release it with ``lease.release()`` or
        by using it as a context manager.
        """
        path = self._path
        call = path.acquire(policy, identity, cost)
        return Lease(
            call,
            self._drive(path.steps_of(call)),
            lambda taken: bool(self._drive(path.release(taken, identity)).allowed),
        )

    def reserve(
        self,
        policy: Policy,
        identity: Identity,
        cost: int = 1,
        *,
        cancel_on_error: bool = False,
    ) -> Reservation:
        """Consume an estimate of ``cost`` if every rate of ``policy`` admits it, to settle
        with the real cost once it is known:

        >>> r = limiter.reserve(tokens, "key-7", cost=500)  # doctest: +SKIP
        >>> if r.allowed:  # doctest: +SKIP
        ...     r.settle(call_the_model())  # charges exactly what was used

        ``r.settle(actual)`` refunds the difference or adds the rest (even past the limit) and
        returns the decision as it stands after; ``r.cancel()`` refunds it all. Each is one
        atomic store call. A reservation never settled keeps its estimate. As a context
        manager, leaving the block keeps the estimate unless it was settled, or, with
        ``cancel_on_error``, refunds it when the block raised. A ``concurrency`` policy hands
        out leases instead (:meth:`acquire`).
        """
        path = self._path
        call = self._core.reserve_call(policy, identity, cost)
        decision, stamp = self._drive(path.reserve(call))
        return Reservation(
            call,
            decision,
            stamp,
            lambda made, at, actual: self._drive(path.settle(made, at, actual)),
            cancel_on_error,
        )

    def resume(
        self, policy: Policy, identity: Identity, estimate: int, stamp: int | None
    ) -> Reservation:
        """A held reservation of ``estimate`` made at ``stamp`` (``reservation.stamp``) by
        another process or an earlier request, to settle or cancel here (``ratekeeper
        serve``'s ``/settle``); nothing is sent until then."""
        path = self._path
        call = self._core.reserve_call(policy, identity, estimate)
        return Reservation(
            call,
            path.resumed(call),
            stamp,
            lambda made, at, actual: self._drive(path.settle(made, at, actual)),
            False,
        )

    def charge(self, policy: Policy, identity: Identity, cost: int) -> Decision:
        """Add ``cost`` to what ``identity`` has consumed under ``policy`` whatever the limit
        (work done without a reservation: a response's size, a job's real run time); the
        decision as it stands after, for a next unit."""
        return self._drive(self._path.charge(policy, identity, cost))  # type: ignore[no-any-return]

    def reset(self, policy: Policy, identity: Identity) -> int:
        """Forget everything ``identity`` has consumed under ``policy``; how many of its keys
        existed (0: nothing was stored). Raises StorageError if the store cannot be reached:
        a reset is never silently skipped."""
        return self.storage.delete(self._path.reset(policy, identity))

    def top(self, policy: Policy | str, *, since: float = 600.0, limit: int = 10) -> Offenders:
        """The identities ``policy`` denied most across every limiter on this store over the
        last ``since`` seconds (whole minutes; up to an hour), most denied first, with the
        total and the error bound of each count (``ratekeeper._engine.top``). This limiter's own
        counts are merged first. Raises StorageError if the store cannot be read."""
        name, (script, keys, args) = self._top_read(policy, since, limit)
        self.merge_top()
        assert self._top is not None
        return self._top.offenders(name, since, self.storage.run(script, keys, args))

    def merge_top(self) -> None:
        """Merge what this limiter counted of the top offenders into the store now (it
        does so every few seconds on its own, and on :meth:`close`)."""
        if self._top is not None:
            for call in self._top.drain():
                self._drive(self._path.merge_top(Run(*call)))

    def _wake_top(self) -> None:
        """A thread that merges in ``FLUSH_EVERY`` seconds (a denial after it starts the
        next), unless the limiter is closed first (``close`` merges then)."""

        def merge() -> None:
            if not self._closing.wait(FLUSH_EVERY):
                self.merge_top()

        threading.Thread(target=merge, name="ratekeeper-top", daemon=True).start()

    def close(self) -> None:
        """Merge the top offenders counted here, and release the storage's connections."""
        self._closing.set()
        try:
            self.merge_top()
        finally:
            self.storage.close()

    def __enter__(self) -> Limiter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait(
        self, policy: Policy, identity: Identity, cost: int = 1, *, timeout: float | None = None
    ) -> Decision:
        """Hit until admitted and return the admitting decision, sleeping the exact
        ``retry_after`` of each denial plus jitter (up to 10%, at most 1 s).

        Raises :class:`RateLimited` (``.decision``: the last denial) as soon as the next try
        would come after ``timeout`` seconds (None: wait as long as it takes), and at once when
        the cost can never pass. See ``ratekeeper._limiters.wait`` for the rule.
        """
        from .wait import wait_sync

        return wait_sync(self, policy, identity, cost, timeout)


class AsyncLimiter(LimiterBase[AsyncStorage]):
    """Decides whether an identity may spend ``cost`` under a policy, on asyncio.

    The same methods and options as :class:`Limiter`, as coroutines.
    ``AsyncLimiter(storage, **options)`` takes a storage already opened.
    """

    @classmethod
    def from_url(
        cls, url: str | None = None, *, batching: bool = True, **options: Unpack[UrlOptions]
    ) -> AsyncLimiter:
        """An asyncio limiter; the URLs (and ``RATEKEEPER_STORAGE_URL``) and options are those
        of :meth:`Limiter.from_url`, and ``batching`` (default True; Redis and Valkey only)
        coalesces concurrent calls into pipelined round trips."""
        # An asyncio storage opens no connection before its first call: if an option is
        # refused, there is nothing to close.
        url, store, limiter = opening("AsyncLimiter.from_url", url, options)
        return cls(open_async(url, batching=batching, **store), **limiter)

    @classmethod
    def from_client(
        cls, client: Any, *, batching: bool = True, **options: Unpack[LimiterOptions]
    ) -> AsyncLimiter:
        """An asyncio limiter on your own ``redis.asyncio.Redis`` (Sentinel-managed or not) or
        ``redis.asyncio.cluster.RedisCluster``: what :meth:`Limiter.from_client` says of the
        client holds here too (used as configured, never changed or closed), and ``batching``
        is that of :meth:`from_url`."""
        check_options("AsyncLimiter.from_client", options)
        return cls(open_client_async(client, batching=batching), **options)

    async def _drive(self, steps: Decision | Steps) -> Any:
        """Run ``steps`` on the storage; their result. One answered without the store still
        lets other tasks run first, as I/O would: a flood of cached denials cannot hold the
        loop, nor can a caller that retries at once an error raised without the store (an
        open breaker under ``failure_mode="raise"``)."""
        if isinstance(steps, Decision):
            await asyncio.sleep(0)
            return steps
        try:
            step = next(steps)
        except StopIteration as done:
            await asyncio.sleep(0)
            return done.value
        except _STORE_FAULTS:
            await asyncio.sleep(0)
            raise
        run = self.storage.run
        try:
            while True:
                if isinstance(step, Later):  # a heartbeat: a task of its own
                    step.fleet.track(asyncio.ensure_future(self._drive(step.steps)))
                    step = next(steps)
                    continue
                outcome: object
                try:
                    outcome = await run(step.script, step.keys, step.args)
                except _STORE_FAULTS as fault:
                    outcome = fault
                step = steps.send(outcome)
        except StopIteration as done:
            return done.value

    async def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Consume ``cost`` if every rate of ``policy`` admits it; otherwise change nothing."""
        return await self._drive(self._path.hit(policy, identity, cost))  # type: ignore[no-any-return]

    async def peek(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Whether a hit of ``cost`` would pass now, without consuming anything."""
        return await self._drive(self._path.peek(policy, identity, cost))  # type: ignore[no-any-return]

    def acquire(self, policy: Policy, identity: Identity, cost: int = 1) -> Pending[AsyncLease]:
        """Take a lease under a ``concurrency`` policy: ``lease = await limiter.acquire(...)``
        or ``async with limiter.acquire(...) as lease:`` (released on exit)."""
        path = self._path
        call = path.acquire(policy, identity, cost)

        async def release(taken: Call) -> bool:
            return bool((await self._drive(path.release(taken, identity))).allowed)

        async def take() -> AsyncLease:
            return AsyncLease(call, await self._drive(path.steps_of(call)), release)

        return Pending(take)

    def reserve(
        self,
        policy: Policy,
        identity: Identity,
        cost: int = 1,
        *,
        cancel_on_error: bool = False,
    ) -> Pending[AsyncReservation]:
        """:meth:`Limiter.reserve` on asyncio: ``r = await limiter.reserve(...)`` (then
        ``await r.settle(actual)``), or ``async with limiter.reserve(...) as r:``."""
        path = self._path
        call = self._core.reserve_call(policy, identity, cost)

        async def settle(made: Call, at: int | None, actual: int) -> Decision:
            return await self._drive(path.settle(made, at, actual))  # type: ignore[no-any-return]

        async def make() -> AsyncReservation:
            decision, stamp = await self._drive(path.reserve(call))
            return AsyncReservation(call, decision, stamp, settle, cancel_on_error)

        return Pending(make)

    def resume(
        self, policy: Policy, identity: Identity, estimate: int, stamp: int | None
    ) -> AsyncReservation:
        """:meth:`Limiter.resume` on asyncio."""
        path = self._path
        call = self._core.reserve_call(policy, identity, estimate)

        async def settle(made: Call, at: int | None, actual: int) -> Decision:
            return await self._drive(path.settle(made, at, actual))  # type: ignore[no-any-return]

        return AsyncReservation(call, path.resumed(call), stamp, settle, False)

    async def charge(self, policy: Policy, identity: Identity, cost: int) -> Decision:
        """:meth:`Limiter.charge` on asyncio."""
        return await self._drive(self._path.charge(policy, identity, cost))  # type: ignore[no-any-return]

    async def reset(self, policy: Policy, identity: Identity) -> int:
        """:meth:`Limiter.reset` on asyncio."""
        return await self.storage.delete(self._path.reset(policy, identity))

    async def top(
        self, policy: Policy | str, *, since: float = 600.0, limit: int = 10
    ) -> Offenders:
        """:meth:`Limiter.top` on asyncio."""
        name, (script, keys, args) = self._top_read(policy, since, limit)
        await self.merge_top()
        assert self._top is not None
        return self._top.offenders(name, since, await self.storage.run(script, keys, args))

    async def merge_top(self) -> None:
        """:meth:`Limiter.merge_top` on asyncio."""
        if self._top is not None:
            for call in self._top.drain():
                await self._drive(self._path.merge_top(Run(*call)))

    def _wake_top(self) -> None:
        """A merge in ``FLUSH_EVERY`` seconds, as a task of the event loop (the denial that
        calls this is decided on it)."""
        loop = asyncio.get_running_loop()

        def merge() -> None:
            task = loop.create_task(self.merge_top())
            self._merging.add(task)
            task.add_done_callback(self._merging.discard)

        self._merge_timer = loop.call_later(FLUSH_EVERY, merge)

    async def close(self) -> None:
        """Merge the top offenders counted here, and release the storage's connections."""
        if self._merge_timer is not None:
            self._merge_timer.cancel()
        try:
            if self._merging:
                await asyncio.gather(*self._merging, return_exceptions=True)
            await self.merge_top()
        finally:
            await self.storage.close()

    async def connect(self) -> bool:
        """Open the store's connection now (and check the server, as the first call would), so
        that the first decisions after start do not wait for it: ``async with`` does it on
        entry, the ASGI middleware at the lifespan's startup. Whether the store answered; one
        that cannot be reached now is not an error here (the first decisions meet it, and the
        failure mode decides). A handshake the store refuses (a wrong password, a database out
        of range) raises RequestRejected, as the first decision would."""
        connect = getattr(self.storage, "connect", None)
        if connect is None:  # memory://, or a storage of the user's without one
            return True
        try:
            await connect()
        except StorageError:
            return False
        return True

    async def __aenter__(self) -> AsyncLimiter:
        try:
            await self.connect()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def wait(
        self, policy: Policy, identity: Identity, cost: int = 1, *, timeout: float | None = None
    ) -> Decision:
        """:meth:`Limiter.wait` on asyncio: ``await limiter.wait(policy, identity)``."""
        from .wait import wait_async

        return await wait_async(self, policy, identity, cost, timeout)
