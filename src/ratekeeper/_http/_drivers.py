"""Drivers of :meth:`Limiting.admit` and :meth:`Limiting.settle`: blocking, and asyncio.

One loop (``_drive``) moves the steps: a :class:`StoreCall` is answered by the limiter (its
deny cache, ``peek`` or ``hit``), anything else is a user's awaitable and is awaited. The
blocking driver runs that loop without an event loop: it may not suspend.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ._limiting import Steps, StoreCall

if TYPE_CHECKING:
    from .._limiter import AsyncLimiter, Limiter

__all__ = ["drive_async", "drive_blocking", "drive_sync"]

_Answer = Callable[[StoreCall], Awaitable[Any]]


async def _drive(steps: Steps, answer: _Answer) -> Any:
    reply: Any = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        reply = await (answer(step) if isinstance(step, StoreCall) else step)


def _blocking(limiter: Limiter) -> _Answer:
    async def answer(step: StoreCall) -> Any:
        if step.cached:
            return limiter.cached(step.policy, step.identity, step.cost)
        if step.peek:
            return limiter.peek(step.policy, step.identity, step.cost)
        return limiter.hit(step.policy, step.identity, step.cost)

    return answer


def _asyncio(limiter: AsyncLimiter) -> _Answer:
    async def answer(step: StoreCall) -> Any:
        if step.cached:
            return limiter.cached(step.policy, step.identity, step.cost)
        if step.peek:
            return await limiter.peek(step.policy, step.identity, step.cost)
        return await limiter.hit(step.policy, step.identity, step.cost)

    return answer


def drive_sync(steps: Steps, limiter: Limiter) -> Any:
    """Run ``admit`` or ``settle`` on a blocking limiter; their result. A step that would
    suspend (an awaitable a sync callable returned) is a TypeError."""
    running = _drive(steps, _blocking(limiter))
    try:
        suspended = running.send(None)
    except StopIteration as done:
        return done.value
    running.close()
    raise TypeError(f"a sync driver cannot await (it was asked to wait for {suspended!r})")


async def drive_blocking(steps: Steps, limiter: Limiter) -> Any:
    """Run ``admit`` or ``settle`` with a blocking limiter's store calls, awaiting async
    callables: for an async view on an event loop that lives for one request (Django under
    WSGI), where an asyncio connection would outlive its loop."""
    return await _drive(steps, _blocking(limiter))


async def drive_async(steps: Steps, limiter: AsyncLimiter) -> Any:
    """Run ``admit`` or ``settle`` on an asyncio limiter, awaiting async callables; their
    result."""
    return await _drive(steps, _asyncio(limiter))
