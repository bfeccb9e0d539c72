"""Drivers of :meth:`Limiting.admit` and :meth:`Limiting.settle`: blocking, and asyncio.

A :class:`StoreCall` is answered by the limiter (its deny cache, ``peek``, ``reserve`` or
``hit``), a :class:`Settle` by settling or cancelling its reservation; any other step is a user's
awaitable, and is awaited. ``drive_blocking`` answers store calls with a
blocking limiter and awaits the rest; ``drive_sync`` runs it without an event loop, where a step
that would suspend is an error; ``drive_async`` answers store calls with an asyncio limiter.
"""

from __future__ import annotations

from typing import Any

from .._limiters.limiter import AsyncLimiter, Limiter
from ._steps import Settle, Steps, StoreCall

__all__ = ["drive_async", "drive_blocking", "drive_sync"]


def _answer(limiter: Limiter, step: StoreCall | Settle) -> Any:
    """A store call of ``admit`` or ``settle``, on a blocking limiter."""
    if type(step) is Settle:
        if step.actual is None:
            return step.reservation.cancel()
        return step.reservation.settle(step.actual)
    assert type(step) is StoreCall
    if step.cached:
        return limiter.cached(step.policy, step.identity, step.cost)
    if step.peek:
        return limiter.peek(step.policy, step.identity, step.cost)
    if step.reserve:
        return limiter.reserve(step.policy, step.identity, step.cost)
    return limiter.hit(step.policy, step.identity, step.cost)


async def drive_blocking(steps: Steps, limiter: Limiter) -> Any:
    """Run ``admit`` or ``settle`` with a blocking limiter's store calls, awaiting async
    callables: for an async view on an event loop that lives for one request (Django under
    WSGI), where an asyncio connection would outlive its loop."""
    reply: Any = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        if isinstance(step, (StoreCall, Settle)):
            reply = _answer(limiter, step)
        else:
            reply = await step


def drive_sync(steps: Steps, limiter: Limiter) -> Any:
    """Run ``admit`` or ``settle`` on a blocking limiter; their result. A step that would
    suspend (an awaitable a sync callable returned) is a TypeError."""
    running = drive_blocking(steps, limiter)
    try:
        suspended = running.send(None)
    except StopIteration as done:
        return done.value
    running.close()
    raise TypeError(f"a sync driver cannot await (it was asked to wait for {suspended!r})")


def _settle(step: Settle) -> Any:
    """The awaitable of a Settle step, on an asyncio reservation."""
    reservation = step.reservation
    return reservation.cancel() if step.actual is None else reservation.settle(step.actual)


async def drive_async(steps: Steps, limiter: AsyncLimiter) -> Any:
    """Run ``admit`` or ``settle`` on an asyncio limiter, awaiting async callables; their
    result."""
    try:
        step: Any = next(steps)
        while True:
            if type(step) is not StoreCall:
                reply = await (_settle(step) if type(step) is Settle else step)
            elif step.cached:
                reply = limiter.cached(step.policy, step.identity, step.cost)
            elif step.peek:
                reply = await limiter.peek(step.policy, step.identity, step.cost)
            elif step.reserve:
                reply = await limiter.reserve(step.policy, step.identity, step.cost)
            else:
                reply = await limiter.hit(step.policy, step.identity, step.cost)
            step = steps.send(reply)
    except StopIteration as done:  # a coroutine awaited above raises RuntimeError instead
        return done.value
