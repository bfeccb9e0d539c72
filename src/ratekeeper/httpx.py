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

With ``actual_cost=`` (a callable of the response: the real cost, or None), ``cost`` is an
estimate: each request reserves it (``limiter.reserve``), waiting or raising as above, and the
reservation is settled with ``actual_cost(response)`` once the body is in memory: at once when
the upstream transport read it already, else when the response is closed (httpx closes it
after reading it; ``client.stream(...)`` when its block ends). Until then the estimate counts.

* ``actual_cost`` returns None, the body was not read to its end (a stream closed early, a
  read that failed) or the response is never closed: the estimate is kept.
* ``actual_cost`` raises, or returns anything but None or an int from 0 to 2**53: the
  estimate is kept and the error reaches the caller (from the request, or from the read that
  ends a stream or the close of it).
* The request fails before anything reached the server (:data:`UNSENT`: no connection, no
  pooled connection in time, a scheme no transport serves): the reservation is cancelled.
  Any other failure (a write or read error, a timeout waiting for the answer, a cancelled
  task) keeps the estimate: the server may have done the work.

Without ``actual_cost`` a request is one plain hit, as before: no reservation, no copy of the
body. With it, the transport keeps the raw body of each response it did not get read until the
response is closed, to give ``actual_cost`` a copy of the response (same status, headers and
request) whose ``content``, ``text`` and ``json()`` work.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Generic, TypeVar

import httpx

from ._algorithms.policy import Policy
from ._engine.core import _check_cost, check_actual
from ._engine.keys import Identity
from ._limiters.limiter import AsyncLimiter, Limiter
from ._limiters.reservation import AsyncReservation, Reservation
from ._limiters.wait import timeout_of, wait_async, wait_sync
from ._model.decision import Decision
from ._model.errors import ConfigError

__all__ = ["UNSENT", "AsyncRateLimitedTransport", "RateLimitedTransport", "host_key"]

#: The failures after which a request certainly never reached the server: with
#: ``actual_cost=``, its reservation is cancelled (any other failure keeps the estimate).
UNSENT: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.UnsupportedProtocol,
)


#: The reservation a settlement settles: the transport's kind.
R = TypeVar("R", Reservation, AsyncReservation)


def host_key(request: httpx.Request) -> Identity:
    """The default key: the host the request goes to."""
    return request.url.host


class _Charge:
    """What a transport charges for each request, checked once: ``policy``, ``key(request)``,
    ``cost`` (the estimate, with ``actual_cost``), the ``wait`` option as a ``timeout`` and
    ``actual_cost`` (None: plain hits)."""

    __slots__ = ("actual_cost", "cost", "key", "policy", "timeout")

    def __init__(
        self,
        policy: Policy,
        key: Callable[[httpx.Request], Identity],
        cost: int,
        wait: bool | float,
        actual_cost: Callable[[httpx.Response], int | None] | None,
    ) -> None:
        if not isinstance(policy, Policy):
            raise ConfigError(f"policy must be a Policy, got {policy!r}")
        if not callable(key):
            raise ConfigError(f"key must be a callable of the request, got {key!r}")
        if actual_cost is not None:
            if not callable(actual_cost):
                raise ConfigError(
                    f"actual_cost must be None or a callable of the response, got {actual_cost!r}"
                )
            if policy.algorithm == "concurrency":
                raise ConfigError(
                    f"policy {policy.name!r} hands out leases: actual_cost= settles "
                    "reservations, which take a rate policy"
                )
        self.policy = policy
        self.key = key
        self.cost = _check_cost(cost)
        self.timeout = timeout_of(wait)
        self.actual_cost = actual_cost


class _Settlement(Generic[R]):
    """The rule for settling one request's reservation, written once for both transports and
    without I/O: the transports only reserve, send, settle and cancel as it says.

    It sees the response arrive (:meth:`arrived`), the raw body go by (:meth:`seen`,
    :meth:`ended`), and says once what to settle with (:meth:`actual`)."""

    __slots__ = (
        "_chunks",
        "_complete",
        "_done",
        "_response",
        "_streamed",
        "charge",
        "request",
        "reserved",
    )

    def __init__(self, charge: _Charge, reserved: R, request: httpx.Request) -> None:
        self.charge = charge
        self.reserved: R = reserved
        self.request = request
        self._response: httpx.Response | None = None
        self._chunks: list[bytes] = []
        self._complete = False
        self._streamed = False  # its body goes by through the transport's stream
        self._done = False

    def failed(self, failure: BaseException) -> bool:
        """Sending raised ``failure``: whether to cancel the reservation (nothing reached the
        server, :data:`UNSENT`); else the estimate is kept."""
        self._done = True
        if isinstance(failure, UNSENT):
            return True
        self.reserved.keep()
        return False

    def arrived(self, response: httpx.Response) -> bool:
        """Whether ``response``'s body is in memory already (settle now); else the transport
        wraps its stream, and settles when it is closed."""
        self._response = response
        if response.is_closed:  # the upstream transport read it whole (httpx.MockTransport)
            self._complete = True
            return True
        self._streamed = True
        return False

    def seen(self, chunk: bytes) -> None:
        """A raw chunk of the body went by."""
        self._chunks.append(chunk)

    def ended(self) -> None:
        """The body was read to its end."""
        self._complete = True

    def actual(self) -> int | None:
        """The cost to settle with, asked once (then None): ``actual_cost`` of the response,
        or None to keep the estimate (it said None, or the body was not read to its end).
        When ``actual_cost`` raises or answers nonsense, the estimate is kept and the error
        raised."""
        if self._done:
            return None
        self._done = True
        response, chunks, self._chunks = self._response, self._chunks, []
        measure = self.charge.actual_cost
        if measure is None or response is None or not self._complete:
            self.reserved.keep()
            return None
        try:
            if self._streamed:  # its body is in the chunks seen: a copy with the body read
                response = httpx.Response(
                    response.status_code,
                    headers=response.headers,
                    content=b"".join(chunks),
                    request=self.request,
                    extensions=response.extensions,
                )
            cost = measure(response)
            if cost is not None:
                try:
                    check_actual(cost)
                except ConfigError:
                    raise ConfigError(
                        f"actual_cost must return None or an int from 0 to 2**53, got {cost!r}"
                    ) from None
        except BaseException:
            self.reserved.keep()
            raise
        if cost is None:
            self.reserved.keep()
        return cost


class _Reserving:
    """A limiter whose hits are reservations, for the wait rule (``_wait``): the last one
    made is :attr:`made` (a denied one holds nothing, so trying again costs nothing)."""

    __slots__ = ("limiter", "made")

    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter
        self.made: Reservation | None = None

    def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        self.made = self.limiter.reserve(policy, identity, cost)
        return self.made.decision

    def wait(self, charge: _Charge, request: httpx.Request) -> _Settlement[Reservation]:
        """Reserve ``charge.cost`` for ``request`` as ``wait=`` says (or raise RateLimited)."""
        wait_sync(self, charge.policy, charge.key(request), charge.cost, charge.timeout)
        assert self.made is not None
        return _Settlement(charge, self.made, request)


class _AsyncReserving:
    """:class:`_Reserving` over an :class:`AsyncLimiter`."""

    __slots__ = ("limiter", "made")

    def __init__(self, limiter: AsyncLimiter) -> None:
        self.limiter = limiter
        self.made: AsyncReservation | None = None

    async def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        self.made = await self.limiter.reserve(policy, identity, cost)
        return self.made.decision

    async def wait(self, charge: _Charge, request: httpx.Request) -> _Settlement[AsyncReservation]:
        """:meth:`_Reserving.wait` on asyncio."""
        await wait_async(self, charge.policy, charge.key(request), charge.cost, charge.timeout)
        assert self.made is not None
        return _Settlement(charge, self.made, request)


class _SettlingStream(httpx.SyncByteStream):
    """A response stream that settles its request's reservation when it is closed."""

    def __init__(self, stream: httpx.SyncByteStream, settlement: _Settlement[Reservation]) -> None:
        self.stream = stream
        self.settlement = settlement

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.stream:
            self.settlement.seen(chunk)
            yield chunk
        self.settlement.ended()

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            actual = self.settlement.actual()
            if actual is not None:
                self.settlement.reserved.settle(actual)


class _AsyncSettlingStream(httpx.AsyncByteStream):
    """:class:`_SettlingStream` for ``httpx.AsyncClient``."""

    def __init__(
        self, stream: httpx.AsyncByteStream, settlement: _Settlement[AsyncReservation]
    ) -> None:
        self.stream = stream
        self.settlement = settlement

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.stream:
            self.settlement.seen(chunk)
            yield chunk
        self.settlement.ended()

    async def aclose(self) -> None:
        try:
            await self.stream.aclose()
        finally:
            actual = self.settlement.actual()
            if actual is not None:
                await self.settlement.reserved.settle(actual)


class RateLimitedTransport(httpx.BaseTransport):
    """A transport for ``httpx.Client`` that charges every request to a :class:`Limiter`,
    then sends it with ``transport`` (default: a new ``httpx.HTTPTransport()``); with
    ``actual_cost``, reserves ``cost`` and settles what the response says it cost."""

    def __init__(
        self,
        limiter: Limiter,
        policy: Policy,
        *,
        key: Callable[[httpx.Request], Identity] = host_key,
        cost: int = 1,
        wait: bool | float = True,
        transport: httpx.BaseTransport | None = None,
        actual_cost: Callable[[httpx.Response], int | None] | None = None,
    ) -> None:
        if not isinstance(limiter, Limiter):
            raise ConfigError(
                f"RateLimitedTransport takes a Limiter (AsyncRateLimitedTransport an "
                f"AsyncLimiter), got {limiter!r}"
            )
        self.limiter = limiter
        self.charge = _Charge(policy, key, cost, wait, actual_cost)
        self.transport = httpx.HTTPTransport() if transport is None else transport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        c = self.charge
        if c.actual_cost is None:
            self.limiter.wait(c.policy, c.key(request), c.cost, timeout=c.timeout)
            return self.transport.handle_request(request)
        settlement = _Reserving(self.limiter).wait(c, request)
        try:
            response = self.transport.handle_request(request)
        except BaseException as failure:
            if settlement.failed(failure):
                settlement.reserved.cancel()
            raise
        if not settlement.arrived(response):
            assert isinstance(response.stream, httpx.SyncByteStream)
            response.stream = _SettlingStream(response.stream, settlement)
            return response
        actual = settlement.actual()
        if actual is not None:
            settlement.reserved.settle(actual)
        return response

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
        actual_cost: Callable[[httpx.Response], int | None] | None = None,
    ) -> None:
        if not isinstance(limiter, AsyncLimiter):
            raise ConfigError(
                f"AsyncRateLimitedTransport takes an AsyncLimiter (RateLimitedTransport a "
                f"Limiter), got {limiter!r}"
            )
        self.limiter = limiter
        self.charge = _Charge(policy, key, cost, wait, actual_cost)
        self.transport = httpx.AsyncHTTPTransport() if transport is None else transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        c = self.charge
        if c.actual_cost is None:
            await self.limiter.wait(c.policy, c.key(request), c.cost, timeout=c.timeout)
            return await self.transport.handle_async_request(request)
        settlement = await _AsyncReserving(self.limiter).wait(c, request)
        try:
            response = await self.transport.handle_async_request(request)
        except BaseException as failure:
            if settlement.failed(failure):
                await settlement.reserved.cancel()
            raise
        if not settlement.arrived(response):
            assert isinstance(response.stream, httpx.AsyncByteStream)
            response.stream = _AsyncSettlingStream(response.stream, settlement)
            return response
        actual = settlement.actual()
        if actual is not None:
            await settlement.reserved.settle(actual)
        return response

    async def aclose(self) -> None:
        """Close the wrapped transport (the limiter is the caller's to close)."""
        await self.transport.aclose()
