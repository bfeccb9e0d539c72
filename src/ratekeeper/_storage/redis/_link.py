"""One of ratekeeper's own asyncio connections: an ``asyncio.Protocol`` that writes a round of
commands and reads their replies with hiredis (``_wire.new_reader``), as ``Round`` objects in
the order sent; before a write, ``usable`` says whether the server closed it while it was idle
(``_wire.IdleCheck``). The pool of them, and what a round means for the exchanges it carries,
is ``_protocol``.

redis-py internals: none here (the reader's, in ``_wire``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import InvalidResponse

from ._batch import Pending
from ._exchange import DONE
from ._wire import INCOMPLETE, IdleCheck, new_reader

if TYPE_CHECKING:
    from ._protocol import Links

__all__ = ["Link", "Round"]


class Round:
    """The replies of one write: ``count`` of them, in order, into ``replies``. With ``slots``
    (the calls each reply answers), each reply is handed to its calls as it arrives: a call
    whose exchange it ends is settled there and then; the others wait in ``again`` for the
    next round."""

    __slots__ = ("again", "count", "future", "pool", "replies", "slots")

    def __init__(
        self,
        count: int,
        future: asyncio.Future[None],
        slots: list[list[Pending]] | None,
        pool: Links | None,
    ) -> None:
        self.count = count
        self.future = future
        self.slots = slots
        #: Where the link goes back once the round ends with every call settled: at once, so
        #: that the callers it wakes find it idle.
        self.pool = pool
        self.replies: list[Any] = []
        self.again: list[Pending] = []


class Link(asyncio.Protocol):
    """One connection: rounds written in one go, replies read by hiredis as they arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.reader = new_reader()
        self.rounds: deque[Round] = deque()
        #: Set once the connection is lost (then ``rounds`` is empty for good).
        self.lost: BaseException | None = None
        self.gone: asyncio.Future[None] = loop.create_future()
        self._idle: IdleCheck | None = None

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        tls = transport.get_extra_info("sslcontext") is not None
        self._idle = IdleCheck(transport.get_extra_info("socket"), tls=tls)

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        rounds = self.rounds
        try:
            reply = reader.gets()
            while reply is not INCOMPLETE:
                if not rounds:  # a reply nobody asked for: out of step
                    raise InvalidResponse("a reply arrived for no command")
                current = rounds[0]
                replies = current.replies
                slots = current.slots
                if slots is not None:
                    for call in slots[len(replies)]:
                        if call.exchange.replied(reply) == DONE:
                            call.settle()
                        else:
                            current.again.append(call)
                replies.append(reply)
                if len(replies) == current.count:
                    rounds.popleft()
                    if current.pool is not None and not current.again:
                        current.pool.give(self)
                    if not current.future.done():
                        current.future.set_result(None)
                reply = reader.gets()
        except InvalidResponse as exc:
            self.abort(exc)
        except Exception as exc:  # a bug, not the store: the round's waiter raises it
            self.abort(exc)

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        lost = exc if exc is not None else redis.ConnectionError("Connection closed by server.")
        self._fail(lost)
        if not self.gone.done():
            self.gone.set_result(None)

    # --- used by ``run`` --------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Open, as far as the loop has seen, and not found closed by the server while idle
        (``IdleCheck``; over TLS only what the loop has seen counts). Checked before each
        write."""
        transport = self.transport
        if self.lost is not None or transport is None or transport.is_closing():
            return False
        idle = self._idle
        return idle is None or bool(self.rounds) or not idle.closed()

    def send(
        self,
        packed: bytes,
        count: int,
        slots: list[list[Pending]] | None = None,
        pool: Links | None = None,
    ) -> Round:
        """Write ``packed`` (``count`` commands) and return the round their replies go to
        (and, with ``slots``, the calls each answers; with ``pool``, where the link goes back
        once they are all settled)."""
        current = Round(count, self.loop.create_future(), slots, pool)
        self.rounds.append(current)
        assert self.transport is not None
        self.transport.write(packed)
        return current

    def abort(self, exc: BaseException) -> None:
        """Close at once: every round still waiting fails with ``exc``."""
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        rounds, self.rounds = self.rounds, deque()
        for waiting in rounds:
            if not waiting.future.done():
                waiting.future.set_exception(exc)
                waiting.future.exception()  # retrieved: a round nobody awaits logs nothing

    async def close(self) -> None:
        if self.transport is not None and not self.gone.done():
            self.abort(redis.ConnectionError("closed by ratekeeper"))
            await self.gone
