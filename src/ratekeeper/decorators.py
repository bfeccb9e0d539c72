"""``limit``: rate limit a function, sync or async, by a key taken from its arguments.

>>> from ratekeeper import Limiter, Policy
>>> limiter = Limiter.from_url("memory://")
>>> @limit(limiter, Policy("send", "2/minute"), key=lambda user, text: user)
... def send(user: str, text: str) -> str:
...     return text
>>> send("alice", "hi"), send("alice", "again")
('hi', 'again')
>>> from ratekeeper import RateLimited
>>> try:
...     send("alice", "once more")
... except RateLimited as exc:
...     print(exc.decision.allowed, exc.decision.remaining)
False 0

A sync function takes a :class:`~ratekeeper.Limiter`, a coroutine function an
:class:`~ratekeeper.AsyncLimiter`; the other pairing is refused when decorating, since a
blocking limiter would stall the event loop and an async one cannot be awaited from sync code.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from ._algorithms.policy import Policy
from ._engine.core import _check_cost
from ._engine.keys import Identity
from ._limiters.limiter import AsyncLimiter, Limiter
from ._limiters.wait import timeout_of
from ._model.errors import ConfigError

__all__ = ["limit"]

F = TypeVar("F", bound=Callable[..., Any])

#: A key: the identity itself, or a callable of the decorated function's arguments returning it.
Key = Identity | Callable[..., Identity]


def _key_function(key: Key) -> Callable[..., Identity]:
    if callable(key):
        return key
    if isinstance(key, (str, bytes, int)) and not isinstance(key, bool):
        return lambda *args, **kwargs: key
    raise ConfigError(
        f"key must be an identity (str, bytes or int) or a callable of the function's "
        f"arguments returning one, got {key!r}"
    )


def limit(
    limiter: Limiter | AsyncLimiter,
    policy: Policy,
    *,
    key: Key,
    cost: int = 1,
    wait: bool | float = False,
) -> Callable[[F], F]:
    """Charge ``cost`` under ``policy`` to ``key(*args, **kwargs)`` before every call.

    ``wait=False`` (the default) raises :class:`~ratekeeper.RateLimited` when denied, without
    calling the function; ``wait=True`` waits as long as it takes (``limiter.wait``), and
    ``wait=<seconds>`` waits at most that long, then raises RateLimited. ``key`` may also be a
    constant identity, for one limit shared by every call. Bad arguments raise ConfigError here,
    at decoration time.
    """
    if not isinstance(limiter, (Limiter, AsyncLimiter)):
        raise ConfigError(f"limiter must be a Limiter or an AsyncLimiter, got {limiter!r}")
    if not isinstance(policy, Policy):
        raise ConfigError(f"policy must be a Policy, got {policy!r}")
    _check_cost(cost)
    key_of = _key_function(key)
    timeout = timeout_of(wait)

    def decorate(func: F) -> F:
        is_async = inspect.iscoroutinefunction(func)
        if is_async and isinstance(limiter, Limiter):
            raise ConfigError(
                f"{func.__qualname__} is a coroutine function: limit it with an AsyncLimiter "
                f"(a blocking Limiter would stall the event loop)"
            )
        if not is_async and isinstance(limiter, AsyncLimiter):
            raise ConfigError(
                f"{func.__qualname__} is not a coroutine function: limit it with a Limiter "
                f"(an AsyncLimiter must be awaited)"
            )
        if isinstance(limiter, AsyncLimiter):
            async_limiter = limiter
            async_func = cast(Callable[..., Awaitable[Any]], func)

            @functools.wraps(func)
            async def limited_async(*args: Any, **kwargs: Any) -> Any:
                identity = key_of(*args, **kwargs)
                await async_limiter.wait(policy, identity, cost, timeout=timeout)
                return await async_func(*args, **kwargs)

            return cast(F, limited_async)
        sync_limiter = limiter

        @functools.wraps(func)
        def limited(*args: Any, **kwargs: Any) -> Any:
            sync_limiter.wait(policy, key_of(*args, **kwargs), cost, timeout=timeout)
            return func(*args, **kwargs)

        return cast(F, limited)

    return decorate
