"""The asyncio pipeline: many exchanges over one connection, one round trip per step.

``run_pipeline`` writes the command of every exchange in one write, reads the replies in order
under one deadline, and tells each exchange what happened; those that have a next command (a
``SCRIPT LOAD`` after NOSCRIPT, sent once for every call of the script that needs it, then
``EVALSHA`` or ``EVAL`` again) go out together in the next round. Each exchange advances at
every round, so a batch takes at most four. The exchange decides; this module moves bytes:

- a connection found closed by the server before the write (it is polled first: readable
  while idle means closed) or whose write failed: the exchanges say reconnect, and
  the next round goes out on a fresh connection, once;
- no reply in time, or a connection that broke after the write: the exchanges without a reply
  end with a StorageTimeout / StorageUnavailable, never sent again;
- a connection that cannot be made: the exchanges end with a StorageUnavailable (nothing was
  sent), and ``unreachable`` is called (a cluster storage then learns the slot map again);
- ``reroute`` (a cluster node's batch): calls redirected (MOVED, ASK, TRYAGAIN) are
  returned, for redis-py's cluster client to send (``_command``). A call that would be sent
  again on a fresh connection goes to the same node here: redis-py's client answers a
  connection error by closing every node's connections, in-flight calls to the nodes that are
  up included.

Anything but a client or socket error (a bug, a cancellation) disconnects the connection, whose
replies may still be on their way, and propagates.

redis-py internals (asyncio ``Connection``): ``connect``, ``disconnect``, ``is_connected``,
``send_packed_command``, ``socket_timeout``, ``_parser.read_response`` (error replies returned
as exception objects), ``_reader`` (its ``StreamReader``) and ``_writer.transport``.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import asyncio
import select
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio

from ._blocking import pack_command
from ._errors import CLIENT_ERRORS, REROUTE, as_broken, as_timeout
from ._exchange import DONE, Exchange

_T = TypeVar("_T")

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:  # redis-py depends on async-timeout there
    from async_timeout import timeout as _deadline  # type: ignore[import-not-found,unused-ignore]

__all__ = ["can_keep_async", "run_pipeline"]

#: A write or a read that ran out of time (``asyncio.TimeoutError`` is the builtin one from
#: Python 3.11, a class of its own before). Listed before OSError, a base of TimeoutError.
_TIMEOUTS = (redis.TimeoutError, TimeoutError, asyncio.TimeoutError)


def can_keep_async(client: Any) -> bool:
    """Whether a storage may keep ``client``'s connections between batches (see ``_blocking``:
    a plain client and pool, not TLS)."""
    pool = getattr(client, "connection_pool", None)
    return (
        type(client) is redis.asyncio.Redis
        and type(pool) is redis.asyncio.ConnectionPool
        and not issubclass(pool.connection_class, redis.asyncio.SSLConnection)
    )


async def run_pipeline(
    connection: Any,
    exchanges: list[Exchange],
    *,
    reroute: bool,
    unreachable: Callable[[], None] | None = None,
) -> list[Exchange]:
    """Drive ``exchanges`` to their end on ``connection``; with ``reroute``, return those
    left for redis-py's cluster client. ``unreachable``: called when no connection could be
    made."""
    rerouted: list[Exchange] = []
    try:
        while exchanges:
            exchanges = await _round(connection, exchanges, rerouted, reroute, unreachable)
    except BaseException:
        await connection.disconnect()
        raise
    return rerouted


async def _round(
    connection: Any,
    exchanges: list[Exchange],
    rerouted: list[Exchange],
    reroute: bool,
    unreachable: Callable[[], None] | None,
) -> list[Exchange]:
    """One round trip; returns the exchanges that go on to the next."""
    again: list[Exchange] = []

    def next_step(exchange: Exchange, step: int) -> None:
        if step != DONE:
            again.append(exchange)

    if not connection.is_connected:
        try:
            await connection.connect()
        except CLIENT_ERRORS as exc:
            if unreachable is not None and not isinstance(exc, redis.TimeoutError):
                unreachable()  # refused or reset: gone, not slow
            for exchange in exchanges:
                next_step(exchange, exchange.unsent(exc, broke=False))
            return again
    elif _closed_while_idle(connection):
        await connection.disconnect()
        closed = redis.ConnectionError("the server closed the connection while it was idle")
        for exchange in exchanges:
            next_step(exchange, exchange.unsent(closed, broke=True))
        return again

    slots, packed = pack_round(exchanges, _itself)
    sent = time.perf_counter()  # this round trip, not the connection's set-up, is the store's
    for exchange in exchanges:
        exchange.sent = sent
    try:
        await connection.send_packed_command(packed, False)
    except _TIMEOUTS as exc:
        await connection.disconnect()
        for exchange in exchanges:
            next_step(exchange, exchange.timed_out(as_timeout(exc, connection.socket_timeout)))
        return again
    except (*CLIENT_ERRORS, OSError) as exc:
        await connection.disconnect()
        for exchange in exchanges:
            next_step(exchange, exchange.unsent(as_broken(exc), broke=True))
        return again

    read = 0
    try:
        parser = connection._parser
        async with _deadline(connection.socket_timeout):
            for group in slots:
                reply = await parser.read_response()
                read += 1
                for exchange in group:
                    if reroute and isinstance(reply, REROUTE):
                        rerouted.append(exchange)
                    else:
                        next_step(exchange, exchange.replied(reply))
    except _TIMEOUTS as exc:
        await connection.disconnect()
        timeout = as_timeout(exc, connection.socket_timeout)
        for group in slots[read:]:
            for exchange in group:
                next_step(exchange, exchange.timed_out(timeout))
    except (*CLIENT_ERRORS, OSError) as exc:
        await connection.disconnect()
        broken = as_broken(exc)
        for group in slots[read:]:
            for exchange in group:
                next_step(exchange, exchange.lost(broken))
    return again


def pack_round(
    items: Sequence[_T], exchange_of: Callable[[_T], Exchange]
) -> tuple[list[list[_T]], bytes]:
    """The commands of one round, and which items each reply is for: a SCRIPT LOAD is sent
    once for every call of the script that needs it. Both asyncio transports (redis-py's
    connections here, ratekeeper's own links in ``_protocol``) pack their rounds with it."""
    slots: list[list[_T]] = []
    loads: dict[str, list[_T]] = {}
    packed: list[bytes] = []
    for item in items:
        exchange = exchange_of(item)
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


def _itself(exchange: Exchange) -> Exchange:
    return exchange


def _closed_while_idle(connection: Any) -> bool:
    """Whether the server closed an idle connection (or wrote to it: out of step either way).

    The event loop may not have seen the server's FIN yet (its callbacks run after the task
    that is about to write; redis-py's pool check-out, a read under ``timeout(0)``, misses it
    for the same reason), so the socket itself is polled, without waiting. Not over TLS, whose
    own records can make an idle socket readable: there only what the loop has seen counts.
    """
    reader = connection._reader
    if reader.at_eof() or reader.exception() is not None:
        return True
    transport = connection._writer.transport
    sock = transport.get_extra_info("socket")
    if transport.is_closing() or sock is None:
        return True
    if transport.get_extra_info("sslcontext") is not None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))
