"""One of ratekeeper's own asyncio connections: an ``asyncio.Protocol`` that writes a round of
commands and reads their replies with hiredis, as ``Round`` objects in the order sent. The
pool of them, and what a round means for the exchanges it carries, is ``_protocol``."""

from __future__ import annotations

import asyncio
import select
from collections import deque
from typing import TYPE_CHECKING, Any

import hiredis
import redis
from redis._parsers import BaseParser
from redis.exceptions import InvalidResponse

from ._batch import Pending
from ._exchange import DONE

if TYPE_CHECKING:
    from ._protocol import Links

__all__ = ["Link", "Round"]

#: What the hiredis reader returns while a reply is incomplete (a RESP2 reply is never this).
_INCOMPLETE = object()
_CAN_POLL = hasattr(select, "poll")


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
        self.reader = hiredis.Reader(
            protocolError=InvalidResponse,
            replyError=BaseParser.parse_error,
            notEnoughData=_INCOMPLETE,
        )
        self.rounds: deque[Round] = deque()
        #: Set once the connection is lost (then ``rounds`` is empty for good).
        self.lost: BaseException | None = None
        self.gone: asyncio.Future[None] = loop.create_future()
        self._poller: Any = None

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if _CAN_POLL and sock is not None and transport.get_extra_info("sslcontext") is None:
            # TLS's own records can make an idle socket readable: there only the loop counts.
            self._poller = select.poll()
            self._poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        rounds = self.rounds
        try:
            reply = reader.gets()
            while reply is not _INCOMPLETE:
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
        """Open, and not found readable while idle (which means closed by the server, or out
        of step either way). Checked before each write."""
        transport = self.transport
        if self.lost is not None or transport is None or transport.is_closing():
            return False
        poller = self._poller
        return poller is None or bool(self.rounds) or not poller.poll(0)

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
