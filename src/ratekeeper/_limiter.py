"""``Limiter`` (blocking) and ``AsyncLimiter`` (asyncio): thin drivers over the shared core.

Everything but I/O (key building, argument encoding, reading the reply) lives in ``_core``; the
two classes below only pass a call to their storage and its reply back to the core.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from ._clock import Clock
from ._core import Call, Core
from ._decision import Decision
from ._keys import DEFAULT_KEY_PREFIX, Identity
from ._lease import Acquiring, AsyncLease, Lease
from ._policy import Policy
from ._storage import AsyncStorage, SyncStorage, open_async, open_sync

__all__ = ["AsyncLimiter", "Limiter"]


class Limiter:
    """Decides whether an identity may spend ``cost`` under a policy, blocking.

    >>> limiter = Limiter.from_url("memory://")
    >>> policy = Policy("api", "2/second")
    >>> [limiter.hit(policy, "alice").allowed for _ in range(3)]
    [True, True, False]
    """

    def __init__(
        self,
        storage: SyncStorage,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
    ) -> None:
        self._core = Core(key_prefix=key_prefix, clock=clock)
        self.storage = storage

    @classmethod
    def from_url(
        cls,
        url: str = "memory://",
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
        **options: Any,
    ) -> Limiter:
        """A limiter on ``memory://``, ``redis://``, ``rediss://`` or ``unix://``.

        ``clock`` switches from the store's clock to client time (a callable returning epoch
        seconds). Redis URLs take ``timeout``, ``connect_timeout``, ``max_connections`` and
        ``redis_options`` (a dict passed to redis-py).
        """
        core = Core(key_prefix=key_prefix, clock=clock)  # validate before connecting
        return cls(open_sync(url, clock=clock, **options), key_prefix=core.keys.prefix, clock=clock)

    def _run(self, call: Call) -> Decision:
        return self._core.decide(call, self.storage.run(call.script, call.keys, call.args))

    def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Consume ``cost`` if every rate of ``policy`` admits it; otherwise change nothing."""
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
        """Forget everything ``identity`` has consumed under ``policy``."""
        self.storage.delete(self._core.reset_keys(policy, identity))

    def keys(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        """The store keys that hold ``identity``'s state under ``policy`` (for debugging)."""
        return self._core.reset_keys(policy, identity)

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


class AsyncLimiter:
    """Decides whether an identity may spend ``cost`` under a policy, on asyncio.

    The same methods as :class:`Limiter`, as coroutines.
    """

    def __init__(
        self,
        storage: AsyncStorage,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
    ) -> None:
        self._core = Core(key_prefix=key_prefix, clock=clock)
        self.storage = storage

    @classmethod
    def from_url(
        cls,
        url: str = "memory://",
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
        **options: Any,
    ) -> AsyncLimiter:
        """An asyncio limiter; the URLs and options are those of :meth:`Limiter.from_url`."""
        core = Core(key_prefix=key_prefix, clock=clock)
        return cls(
            open_async(url, clock=clock, **options), key_prefix=core.keys.prefix, clock=clock
        )

    async def _run(self, call: Call) -> Decision:
        return self._core.decide(call, await self.storage.run(call.script, call.keys, call.args))

    async def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        """Consume ``cost`` if every rate of ``policy`` admits it; otherwise change nothing."""
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
        """Forget everything ``identity`` has consumed under ``policy``."""
        await self.storage.delete(self._core.reset_keys(policy, identity))

    def keys(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        """The store keys that hold ``identity``'s state under ``policy`` (for debugging)."""
        return self._core.reset_keys(policy, identity)

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
