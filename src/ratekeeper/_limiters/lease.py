"""Leases handed out by concurrency policies: hold one while the work runs, then release it.

A lease that is never released frees itself when the policy's period (the lease timeout) ends,
so a crashed holder cannot leak capacity for long.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

from .._engine.core import Call
from .._model.decision import Decision

__all__ = ["AsyncLease", "Lease", "Pending"]


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


class _Exits(Protocol):
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


_T = TypeVar("_T", bound=_Exits)


class Pending(Generic[_T]):
    """What ``AsyncLimiter.acquire`` and ``reserve`` return: await it for the lease (or
    reservation), or ``async with`` it (leaving the block as leaving the lease's own does)."""

    __slots__ = ("_made", "_make")

    def __init__(self, make: Callable[[], Awaitable[_T]]) -> None:
        self._make = make
        self._made: _T | None = None

    def __await__(self) -> Generator[Any, None, _T]:
        return self._make().__await__()

    async def __aenter__(self) -> _T:
        self._made = await self._make()
        return self._made

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._made is not None:
            await self._made.__aexit__(exc_type, exc, tb)
