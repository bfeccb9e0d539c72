"""Drivers of :meth:`Limiting.admit` and :meth:`Limiting.settle`: blocking, and asyncio."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._decision import Decision
from ._limiting import Steps, StoreCall

if TYPE_CHECKING:
    from .._limiter import AsyncLimiter, Limiter


# --- drivers ------------------------------------------------------------------------------------


def _cached(limiter: Limiter | AsyncLimiter, call: StoreCall) -> Decision | None:
    """A denial of ``call`` in the limiter's local deny cache, or None: no store call."""
    guard = limiter._guard
    if not guard.caches(call.policy):
        return None
    key = limiter._core.first_key(call.policy, call.identity)
    if call.cost == 1:
        return guard.cached(key)
    deny = guard._deny
    return None if deny is None else deny.lookup(key, call.cost)


def _call_blocking(limiter: Limiter, step: StoreCall) -> Any:
    """One store call of ``admit`` or ``settle`` on a blocking limiter."""
    if step.cached:
        return _cached(limiter, step)
    if step.peek:
        return limiter.peek(step.policy, step.identity, step.cost)
    return limiter.hit(step.policy, step.identity, step.cost)


def drive_sync(steps: Steps, limiter: Limiter) -> Any:
    """Run ``admit`` or ``settle`` on a blocking limiter; their result."""
    reply: Any = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        if type(step) is not StoreCall:
            raise TypeError(f"a sync driver cannot await {step!r}")
        reply = _call_blocking(limiter, step)


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
        if type(step) is StoreCall:
            reply = _call_blocking(limiter, step)
        else:
            reply = await step  # type: ignore[misc]


async def drive_async(steps: Steps, limiter: AsyncLimiter) -> Any:
    """Run ``admit`` or ``settle`` on an asyncio limiter, awaiting async callables; their
    result."""
    reply: Any = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        if type(step) is StoreCall:
            if step.cached:
                reply = _cached(limiter, step)
            elif step.peek:
                reply = await limiter.peek(step.policy, step.identity, step.cost)
            else:
                reply = await limiter.hit(step.policy, step.identity, step.cost)
        else:
            reply = await step  # type: ignore[misc]
