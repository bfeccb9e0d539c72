"""Leases handed out by concurrency policies: hold one while the work runs, then release it.

A lease that is never released frees itself when the policy's period (the lease timeout) ends,
so a crashed holder cannot leak capacity for long.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any

from ._core import Call
from ._decision import Decision

__all__ = ["AsyncLease", "Lease"]


class _Held:
    """What both kinds of lease know: the call that took it, its decision, whether released."""

    __slots__ = ("_released", "call", "decision")

    def __init__(self, call: Call, decision: Decision) -> None:
        self.call = call
        self.decision = decision
        self._released = not decision.allowed

    @property
    def allowed(self) -> bool:
        """Whether the lease was granted."""
        return self.decision.allowed

    @property
    def held(self) -> bool:
        """Granted and not yet released (it may still have expired)."""
        return not self._released

    def _take_release(self) -> bool:
        """Mark released; whether the store must be told (the first time only)."""
        if self._released:
            return False
        self._released = True
        return True


class Lease(_Held):
    """A lease from :meth:`Limiter.acquire`. Check :attr:`allowed` before doing the work.

    >>> with limiter.acquire(jobs, "tenant-7") as lease:  # doctest: +SKIP
    ...     if lease.allowed:
    ...         run_job()
    """

    __slots__ = ("_release",)

    def __init__(self, call: Call, decision: Decision, release: Callable[[Call], bool]) -> None:
        super().__init__(call, decision)
        self._release = release

    def release(self) -> bool:
        """Give the units back. Returns whether the lease was still held; idempotent."""
        return self._take_release() and self._release(self.call)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class AsyncLease(_Held):
    """A lease from :meth:`AsyncLimiter.acquire`; ``release`` is a coroutine."""

    __slots__ = ("_release",)

    def __init__(
        self, call: Call, decision: Decision, release: Callable[[Call], Awaitable[bool]]
    ) -> None:
        super().__init__(call, decision)
        self._release = release

    async def release(self) -> bool:
        """Give the units back. Returns whether the lease was still held; idempotent."""
        return self._take_release() and await self._release(self.call)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()


class Acquiring:
    """What ``AsyncLimiter.acquire`` returns: await it for a lease, or ``async with`` it."""

    __slots__ = ("_coro_factory", "_lease")

    def __init__(self, coro_factory: Callable[[], Awaitable[AsyncLease]]) -> None:
        self._coro_factory = coro_factory
        self._lease: AsyncLease | None = None

    def __await__(self) -> Generator[Any, None, AsyncLease]:
        return self._coro_factory().__await__()

    async def __aenter__(self) -> AsyncLease:
        self._lease = await self._coro_factory()
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._lease is not None:
            await self._lease.release()
