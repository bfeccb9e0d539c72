"""The wire under every transport to one server: rounds packed, replies read, idle sockets checked.

The transports (``_blocking`` on redis-py's connections, ``_pipeline`` on redis-py's asyncio
connections, ``_link`` on ratekeeper's own) move the same bytes, and what they share is written
once here:

- ``pack_round``: the commands of a round in one buffer, packed by hiredis, and which calls
  each reply answers (a SCRIPT LOAD goes once for every call of its script that needs it);
- ``new_reader`` and ``read_reply``: where ratekeeper reads replies itself (a link's
  reads, the blocking transport's read straight from the socket) it reads them
  with a hiredis reader made as redis-py makes its own: error replies as the exception objects
  redis-py's parser builds, a reply that is not RESP as its ``InvalidResponse``;
- ``IdleCheck``: whether the server closed a connection while it was idle (a restart, an idle
  timeout, CLIENT KILL). Its socket is polled without waiting, by a poller made once per
  socket; readable while idle means closed (or out of step: the same either way). Over TLS,
  whose own records can make an idle socket readable, it cannot tell and says open.

What a failed write or read means for a call is the exchange's to say (``Exchange.failed``).

redis-py internals: ``redis._parsers.BaseParser.parse_error`` (a classmethod in every supported
version).
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any, TypeVar, cast

import hiredis
import redis
from redis._parsers import BaseParser
from redis.exceptions import InvalidResponse

from ._exchange import Exchange

__all__ = [
    "CAN_POLL",
    "INCOMPLETE",
    "IdleCheck",
    "closed_while_idle",
    "new_reader",
    "pack_command",
    "pack_round",
    "read_reply",
]

_T = TypeVar("_T")

#: hiredis's RESP encoder, several times faster than redis-py's (its stub types the argument
#: as a 1-tuple).
pack_command = cast(Callable[[tuple[Any, ...]], bytes], hiredis.pack_command)

#: What a reader of ``new_reader`` returns while a reply is incomplete (no reply is this).
INCOMPLETE: Any = object()

#: Whether sockets can be polled here (not on Windows): where not, nothing is found closed
#: while idle, so the blocking transport does not keep connections.
CAN_POLL = hasattr(select, "poll")


def pack_round(items: list[_T], exchanges: list[Exchange]) -> tuple[list[list[_T]], bytes]:
    """The commands of one round in one buffer, and which items each reply is for, in order: a
    SCRIPT LOAD is sent once for every call of its script that needs it. ``exchanges``: the
    exchange of each item, in the same order (``items`` itself where items are exchanges)."""
    if len(items) == 1:
        return [items], pack_command(exchanges[0].command)
    slots: list[list[_T]] = []
    loads: dict[str, list[_T]] = {}
    packed: list[bytes] = []
    for item, exchange in zip(items, exchanges, strict=True):
        if exchange.loading:
            group = loads.get(exchange.script.sha)
            if group is not None:
                group.append(item)
                continue
            group = loads[exchange.script.sha] = [item]
        else:
            group = [item]
        slots.append(group)
        packed.append(pack_command(exchange.command))
    return slots, b"".join(packed)


def new_reader() -> Any:
    """A hiredis reader for one connection (it keeps what it was fed until a reply is whole).
    It decodes nothing, whatever ``decode_responses`` says: script replies are integers."""
    return hiredis.Reader(
        protocolError=InvalidResponse,
        replyError=BaseParser.parse_error,
        notEnoughData=INCOMPLETE,
    )


def read_reply(reader: Any, sock: Any, buffer: bytearray) -> Any:
    """The next reply on blocking ``sock``, received into ``buffer`` and parsed by ``reader``
    (one of ``new_reader``): an error reply returned as its exception object, but a
    ConnectionError raised, as redis-py's ``read_response`` raises it. Raises the socket's
    errors, and redis-py's ConnectionError when the server closed the connection."""
    reply = reader.gets()
    while reply is INCOMPLETE:
        n = sock.recv_into(buffer)
        if n == 0:
            raise redis.ConnectionError("Connection closed by server.")
        reader.feed(buffer, 0, n)
        reply = reader.gets()
    if isinstance(reply, redis.ConnectionError):
        raise reply
    return reply


class IdleCheck:
    """The idle-close check of one socket (see the module's comment); ``sock`` None: there is
    none to poll, and only what the caller knows otherwise counts."""

    __slots__ = ("_poll",)

    def __init__(self, sock: Any, *, tls: bool) -> None:
        self._poll: Callable[[int], list[tuple[int, int]]] | None = None
        if CAN_POLL and sock is not None and not tls:
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            self._poll = poller.poll

    def closed(self) -> bool:
        """Whether the idle socket is readable: the server closed it. Asked without waiting."""
        poll = self._poll
        return poll is not None and bool(poll(0))


def closed_while_idle() -> redis.ConnectionError:
    """The error of a connection ``IdleCheck`` found closed: nothing was sent on it, so the
    exchange sends its call again on a fresh one (once)."""
    return redis.ConnectionError("the server closed the connection while it was idle")
