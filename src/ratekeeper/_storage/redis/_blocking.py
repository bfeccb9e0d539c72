"""The blocking transport to one server: exchanges driven over redis-py connections.

It moves bytes for an ``Exchange`` and reports what happened; the exchange decides the rest
(``Exchange.failed`` for a failed write or read). It skips what redis-py does around every
command and a limiter does not need (a pool check-out with its lock, the retry wrapper, response
callbacks): commands are packed by hiredis (``_wire``), and on Linux (not TLS) written and read
straight on the socket, by a hiredis reader of its own per socket (``_wire.read_reply``), with
the timeout set in the kernel (``SO_SNDTIMEO``/``SO_RCVTIMEO``) so that a call is one ``send``
and one ``recv``.

Connections: to a plain server (TCP or unix socket, not TLS) they are taken from the client's
pool once and kept on a stack; a thread pops one, so threads never share a connection. Before
each write a kept connection is checked (``_wire.IdleCheck``): readable while idle means the
server closed it (a restart, an idle timeout, CLIENT KILL), which the exchange treats as a
connection that broke before the request could run. Through Sentinel, or over TLS, each call
checks a connection out of redis-py's pool and back, as redis-py does (its check-out makes the
same staleness check, and a Sentinel master switch disconnects only connections checked in).
A connection whose exchange did not end on a reply is disconnected, so no late reply can be
read as another's.

redis-py internals: ``Connection._sock``, ``Connection._parser._reader`` (only whether it is
set: redis-py reads the connection with hiredis, so the raw path reads as it would), ``connect``,
``disconnect``, ``send_packed_command``, ``read_response``, ``socket_timeout``; the pool's
``get_connection``/``release`` through ``_compat``. What it keeps per socket is in an attribute
of its own on the connection, ``_ratekeeper``.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
import weakref
from typing import Any

import redis

from ..._algorithms.scripts import Script
from ..base import ROUND_TRIP
from ._compat import get_connection
from ._errors import CLIENT_ERRORS, IO_ERRORS, translate
from ._exchange import DONE, RECONNECT, Exchange
from ._wire import CAN_POLL, IdleCheck, closed_while_idle, new_reader, pack_command, read_reply

__all__ = ["BlockingTransport", "can_keep"]

#: Linux sockets time out in the kernel (SO_SNDTIMEO, SO_RCVTIMEO), so a blocking call makes
#: one syscall per send and per receive. A Python socket with a timeout polls before each.
_KERNEL_TIMEOUTS = sys.platform.startswith("linux")


def can_keep(client: Any) -> bool:
    """Whether the transport may keep ``client``'s connections: a plain client and pool, to a
    server that is not behind TLS (whose idle sockets can be readable for TLS's own records)."""
    pool = getattr(client, "connection_pool", None)
    return (
        CAN_POLL
        and type(client) is redis.Redis
        and type(pool) is redis.ConnectionPool
        and not issubclass(pool.connection_class, redis.SSLConnection)
    )


class BlockingTransport:
    """Runs exchanges on one server for any number of threads."""

    def __init__(self, pool: Any, *, keep: bool) -> None:
        self.pool = pool
        self.keep = keep
        self.idle: list[Any] = []
        _TRANSPORTS.add(self)

    def run(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> Any:
        """The script's reply; the exchange's error instead, raised."""
        exchange = Exchange(script, keys, args)
        connection = self._take()
        try:
            step = _step(connection, exchange, self.keep)
            while step != DONE:
                if step == RECONNECT:
                    connection.disconnect()
                # A further round trip (a script load, a fresh connection): the store is
                # judged by the last one.
                exchange.sent = time.perf_counter()
                step = _step(connection, exchange, self.keep)
        except BaseException:
            connection.disconnect()  # a bug or an interrupt mid-exchange: its state is unknown
            raise
        finally:
            self._give(connection)
        if exchange.sent:
            ROUND_TRIP.set(exchange)
        return exchange.outcome()

    def execute(self, *command: Any) -> Any:
        """One plain command (``INFO``) on a connection of this transport; errors translated."""
        connection = self._take()
        try:
            if connection._sock is None:
                connection.connect()
            connection.send_packed_command([pack_command(command)], False)
            return connection.read_response()
        except CLIENT_ERRORS as exc:
            connection.disconnect()
            raise translate(exc) from exc
        finally:
            self._give(connection)

    def _take(self) -> Any:
        if self.keep:
            try:
                return self.idle.pop()
            except IndexError:
                pass
        try:
            return get_connection(self.pool)
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc

    def _give(self, connection: Any) -> None:
        if self.keep:
            self.idle.append(connection)
        else:
            self.pool.release(connection)

    def close(self) -> None:
        """Give the kept connections back to the pool (the user's, it may be), disconnected."""
        idle, self.idle = self.idle, []
        for connection in idle:
            connection.disconnect()
            self.pool.release(connection)

    def forget(self) -> None:
        """In a forked child: the parent's sockets are not this process's to use."""
        self.idle = []


def _step(connection: Any, exchange: Exchange, check_idle: bool) -> int:
    """Send ``exchange.command`` on ``connection``, read the reply, and tell the exchange."""
    if connection._sock is None:
        try:
            connection.connect()  # redis-py's handshake (AUTH, SELECT, ...), under its timeouts
        except CLIENT_ERRORS as exc:
            return exchange.unsent(exc, broke=False)
        exchange.sent = time.perf_counter()  # the set-up is not the store's round trip
    packed = pack_command(exchange.command)
    kept = connection.__dict__.get("_ratekeeper")
    if kept is None or kept.sock is not connection._sock:
        kept = _Socket(connection)
    if check_idle and kept.idle.closed():
        connection.disconnect()
        return exchange.unsent(closed_while_idle(), broke=True)
    reader = kept.reader
    try:
        if reader is not None:
            kept.sock.sendall(packed)
        else:
            connection.send_packed_command([packed], False)
    except IO_ERRORS as exc:
        connection.disconnect()
        return exchange.failed(exc, sent=False, seconds=connection.socket_timeout)
    try:
        if reader is not None:
            reply = read_reply(reader, kept.sock, kept.buffer)
        else:
            reply = _read(connection)
    except IO_ERRORS as exc:
        connection.disconnect()
        return exchange.failed(exc, sent=True, seconds=connection.socket_timeout)
    return exchange.replied(reply)


def _read(connection: Any) -> Any:
    """The reply through redis-py, an error reply returned as its exception object."""
    try:
        return connection.read_response()
    except redis.ResponseError as exc:
        return exc


class _Socket:
    """What the transport keeps for the socket a connection has now (a new socket, after a
    reconnect, gets its own): its idle check, and where its replies can be read straight from
    it (Linux, not TLS, redis-py reading it with hiredis), a reader and a buffer of its own,
    with the socket made blocking and the connection's timeout set in the kernel."""

    __slots__ = ("buffer", "idle", "reader", "sock")

    def __init__(self, connection: Any) -> None:
        sock = self.sock = connection._sock
        tls = isinstance(connection, redis.SSLConnection)
        self.idle = IdleCheck(sock, tls=tls)
        self.reader: Any = None
        self.buffer = bytearray()
        if _KERNEL_TIMEOUTS and not tls and _hiredis_reads(connection):
            timeout = connection.socket_timeout
            sock.settimeout(None)
            if timeout is not None:
                # (0, 0) would mean no timeout at all: never less than a microsecond.
                seconds, micros = divmod(max(1, round(timeout * 1_000_000)), 1_000_000)
                timeval = struct.pack("ll", seconds, micros)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            self.reader = new_reader()
            self.buffer = bytearray(65536)
        connection._ratekeeper = self


def _hiredis_reads(connection: Any) -> bool:
    """Whether redis-py reads ``connection`` with hiredis (not a parser class of the user's)."""
    return getattr(connection._parser, "_reader", None) is not None


_TRANSPORTS: weakref.WeakSet[BlockingTransport] = weakref.WeakSet()


def _forget_after_fork() -> None:
    for transport in list(_TRANSPORTS):
        transport.forget()


os.register_at_fork(after_in_child=_forget_after_fork)
