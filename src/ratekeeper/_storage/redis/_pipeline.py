"""The asyncio pipeline: many exchanges over one connection, one round trip per step.

``run_pipeline`` writes the command of every exchange in one write, reads the replies in order
under one deadline, and tells each exchange what happened; those that have a next command (a
``SCRIPT LOAD`` after NOSCRIPT, sent once for every call of the script that needs it, then
``EVALSHA`` or ``EVAL`` again) go out together in the next round. Each exchange advances at
every round, so a batch takes at most four. The exchange decides (``Exchange.failed`` for a
failed write or read); this module moves bytes, packed by ``_wire.pack_round``:

- a connection found closed by the server before the write (what the loop has seen of it, then
  ``_wire.IdleCheck``: readable while idle means closed) or whose write failed: the exchanges
  say reconnect, and the next round goes out on a fresh connection, once;
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
as exception objects), ``_reader`` (its ``StreamReader``) and ``_writer.transport``. The idle
check of its transport is kept in an attribute of ratekeeper's own on it, ``_ratekeeper``.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio

from ._errors import CLIENT_ERRORS, IO_ERRORS, REROUTE
from ._exchange import DONE, Exchange
from ._wire import IdleCheck, closed_while_idle, pack_round

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:  # redis-py depends on async-timeout there
    from async_timeout import timeout as _deadline  # type: ignore[import-not-found,unused-ignore]

__all__ = ["can_keep_async", "run_pipeline"]


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
        closed = closed_while_idle()
        for exchange in exchanges:
            next_step(exchange, exchange.unsent(closed, broke=True))
        return again

    slots, packed = pack_round(exchanges, exchanges)
    sent = time.perf_counter()  # this round trip, not the connection's set-up, is the store's
    for exchange in exchanges:
        exchange.sent = sent
    seconds = connection.socket_timeout
    try:
        await connection.send_packed_command(packed, False)
    except IO_ERRORS as exc:
        await connection.disconnect()
        for exchange in exchanges:
            next_step(exchange, exchange.failed(exc, sent=False, seconds=seconds))
        return again

    read = 0
    try:
        parser = connection._parser
        async with _deadline(seconds):
            for group in slots:
                reply = await parser.read_response()
                read += 1
                for exchange in group:
                    if reroute and isinstance(reply, REROUTE):
                        rerouted.append(exchange)
                    else:
                        next_step(exchange, exchange.replied(reply))
    except IO_ERRORS as exc:
        await connection.disconnect()
        for group in slots[read:]:
            for exchange in group:
                next_step(exchange, exchange.failed(exc, sent=True, seconds=seconds))
    return again


def _closed_while_idle(connection: Any) -> bool:
    """Whether the server closed an idle connection (or wrote to it: out of step either way).

    The event loop may not have seen the server's FIN yet (its callbacks run after the task
    that is about to write; redis-py's pool check-out, a read under ``timeout(0)``, misses it
    for the same reason), so after what the loop has seen, the socket itself is checked
    (``IdleCheck``, made once per transport; over TLS only what the loop has seen counts).
    """
    reader = connection._reader
    if reader.at_eof() or reader.exception() is not None:
        return True
    transport = connection._writer.transport
    if transport.is_closing():
        return True
    kept: tuple[Any, IdleCheck] | None = connection.__dict__.get("_ratekeeper")
    if kept is None or kept[0] is not transport:
        sock = transport.get_extra_info("socket")
        if sock is None:
            return True
        tls = transport.get_extra_info("sslcontext") is not None
        kept = connection._ratekeeper = (transport, IdleCheck(sock, tls=tls))
    return kept[1].closed()
