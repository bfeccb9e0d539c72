"""httpx transports that limit outbound requests (``pip install 'ratekeeper[httpx]'``).

>>> import httpx
>>> from ratekeeper import Limiter, Policy
>>> from ratekeeper.httpx import RateLimitedTransport
>>> transport = RateLimitedTransport(Limiter.from_url("memory://"), Policy("github", "10/s"))
>>> client = httpx.Client(transport=transport)

Every request is charged ``cost`` under ``policy`` to ``key(request)`` (by default the host it
goes to) before it is sent. With ``wait=True`` (the default) a denied request waits until the
limit admits it, so the client keeps to the rate; ``wait=<seconds>`` waits at most that long
and ``wait=False`` does not wait; either then raises :class:`~ratekeeper.RateLimited` and
sends nothing. The limiter decides across every process that shares its store, so a fleet
of workers calling one API keeps to one limit.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from ._core import _check_cost
from ._errors import ConfigError
from ._keys import Identity
from ._limiter import AsyncLimiter, Limiter
from ._policy import Policy
from ._wait import timeout_of

__all__ = ["AsyncRateLimitedTransport", "RateLimitedTransport", "host_key"]


def host_key(request: httpx.Request) -> Identity:
    """The default key: the host the request goes to."""
    return request.url.host


class _Charge:
    """What a transport charges for each request, checked once: ``policy``, ``key(request)``,
    ``cost``, and the ``wait`` option as a ``timeout``."""

    __slots__ = ("cost", "key", "policy", "timeout")

    def __init__(
        self,
        policy: Policy,
        key: Callable[[httpx.Request], Identity],
        cost: int,
        wait: bool | float,
    ) -> None:
        if not isinstance(policy, Policy):
            raise ConfigError(f"policy must be a Policy, got {policy!r}")
        if not callable(key):
            raise ConfigError(f"key must be a callable of the request, got {key!r}")
        self.policy = policy
        self.key = key
        self.cost = _check_cost(cost)
        self.timeout = timeout_of(wait)


class RateLimitedTransport(httpx.BaseTransport):
    """A transport for ``httpx.Client`` that charges every request to a :class:`Limiter`,
    then sends it with ``transport`` (default: a new ``httpx.HTTPTransport()``)."""

    def __init__(
        self,
        limiter: Limiter,
        policy: Policy,
        *,
        key: Callable[[httpx.Request], Identity] = host_key,
        cost: int = 1,
        wait: bool | float = True,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not isinstance(limiter, Limiter):
            raise ConfigError(
                f"RateLimitedTransport takes a Limiter (AsyncRateLimitedTransport an "
                f"AsyncLimiter), got {limiter!r}"
            )
        self.limiter = limiter
        self.charge = _Charge(policy, key, cost, wait)
        self.transport = httpx.HTTPTransport() if transport is None else transport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        c = self.charge
        self.limiter.wait(c.policy, c.key(request), c.cost, timeout=c.timeout)
        return self.transport.handle_request(request)

    def close(self) -> None:
        """Close the wrapped transport (the limiter is the caller's to close)."""
        self.transport.close()


class AsyncRateLimitedTransport(httpx.AsyncBaseTransport):
    """:class:`RateLimitedTransport` for ``httpx.AsyncClient``, over an :class:`AsyncLimiter`
    and ``transport`` (default: a new ``httpx.AsyncHTTPTransport()``)."""

    def __init__(
        self,
        limiter: AsyncLimiter,
        policy: Policy,
        *,
        key: Callable[[httpx.Request], Identity] = host_key,
        cost: int = 1,
        wait: bool | float = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not isinstance(limiter, AsyncLimiter):
            raise ConfigError(
                f"AsyncRateLimitedTransport takes an AsyncLimiter (RateLimitedTransport a "
                f"Limiter), got {limiter!r}"
            )
        self.limiter = limiter
        self.charge = _Charge(policy, key, cost, wait)
        self.transport = httpx.AsyncHTTPTransport() if transport is None else transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        c = self.charge
        await self.limiter.wait(c.policy, c.key(request), c.cost, timeout=c.timeout)
        return await self.transport.handle_async_request(request)

    async def aclose(self) -> None:
        """Close the wrapped transport (the limiter is the caller's to close)."""
        await self.transport.aclose()
