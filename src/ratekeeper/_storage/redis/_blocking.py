"""The blocking transport to one server: exchanges driven over redis-py connections.

It moves bytes for an ``Exchange`` and reports what happened; the exchange decides the rest. It
skips what redis-py does around every command and a limiter does not need (a pool check-out
with its lock, the retry wrapper, response callbacks): commands are packed by hiredis, and on
Linux (not TLS) written and read straight on the socket, with the timeout set in the kernel
(``SO_SNDTIMEO``/``SO_RCVTIMEO``) so that a call is one ``send`` and one ``recv``.

Connections: to a plain server (TCP or unix socket, not TLS) they are taken from the client's
pool once and kept on a stack; a thread pops one, so threads never share a connection. Before
each write a kept connection is polled: readable while idle means the server closed it (a
restart, an idle timeout, CLIENT KILL), which the exchange treats as a connection that broke
before the request could run. Through Sentinel, or over TLS, each call checks a connection out
of redis-py's pool and back, as redis-py does (its check-out makes the same staleness check,
and a Sentinel master switch disconnects only connections checked in). A connection whose
exchange did not end on a reply is disconnected, so no late reply can be read as another's.

redis-py internals: ``Connection._sock``, ``Connection._parser._reader`` (the hiredis reader,
whose replies are redis-py's own objects, error replies as exceptions), ``connect``,
``disconnect``, ``send_packed_command``, ``read_response``, ``socket_timeout``; the pool's
``get_connection``/``release`` through ``_compat``.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, cast

import redis
from hiredis import pack_command as _hiredis_pack

from ..._scripts import Script
from ..base import SENT
from ._compat import INCOMPLETE, get_connection
from ._errors import CLIENT_ERRORS, as_broken, as_timeout, translate
from ._exchange import DONE, RECONNECT, Exchange

__all__ = ["BlockingTransport", "can_keep", "pack_command"]

#: hiredis's RESP encoder, several times faster than redis-py's (its stub types the argument
#: as a 1-tuple).
pack_command = cast(Callable[[tuple[Any, ...]], bytes], _hiredis_pack)

#: Linux sockets time out in the kernel (SO_SNDTIMEO, SO_RCVTIMEO), so a blocking call makes
#: one syscall per send and per receive. A Python socket with a timeout polls before each.
_KERNEL_TIMEOUTS = sys.platform.startswith("linux")
_CAN_POLL = hasattr(select, "poll")


def can_keep(client: Any) -> bool:
    """Whether the transport may keep ``client``'s connections: a plain client and pool, to a
    server that is not behind TLS (whose idle sockets can be readable for TLS's own records)."""
    pool = getattr(client, "connection_pool", None)
    return (
        _CAN_POLL
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
            SENT.set(exchange.sent)
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
    raw = _raw_state(connection)
    if check_idle and _readable(connection, raw):
        connection.disconnect()
        closed = redis.ConnectionError("the server closed the connection while it was idle")
        return exchange.unsent(closed, broke=True)
    try:
        if raw is not None:
            connection._sock.sendall(packed)
        else:
            connection.send_packed_command([packed], False)
    except (redis.TimeoutError, BlockingIOError, TimeoutError) as exc:
        connection.disconnect()
        return exchange.timed_out(as_timeout(exc, connection.socket_timeout))
    except (redis.ConnectionError, OSError) as exc:
        connection.disconnect()
        return exchange.unsent(as_broken(exc), broke=True)
    try:
        reply = _read_raw(connection, raw) if raw is not None else _read(connection)
    except (redis.TimeoutError, BlockingIOError, TimeoutError) as exc:
        connection.disconnect()
        return exchange.timed_out(as_timeout(exc, connection.socket_timeout))
    except (*CLIENT_ERRORS, OSError) as exc:
        connection.disconnect()
        return exchange.lost(as_broken(exc))
    return exchange.replied(reply)


def _read(connection: Any) -> Any:
    """The reply through redis-py, an error reply returned as its exception object."""
    try:
        return connection.read_response()
    except redis.ResponseError as exc:
        return exc


def _raw_state(connection: Any) -> tuple[Any, bytearray, Any] | None:
    """(socket, read buffer, poller) for reading ``connection`` straight from its socket, set up
    once per socket: blocking, with the connection's timeout in the kernel. None where that
    path does not apply (not Linux, TLS, no hiredis reader)."""
    sock = connection._sock
    state = connection.__dict__.get("_ratekeeper")
    if state is not None and state[0] is sock:
        return cast(tuple[Any, bytearray, Any], state)
    if (
        not _KERNEL_TIMEOUTS
        or isinstance(connection, redis.SSLConnection)
        or getattr(connection._parser, "_reader", None) is None
    ):
        return None
    timeout = connection.socket_timeout
    sock.settimeout(None)
    if timeout is not None:
        # (0, 0) would mean no timeout at all: never less than a microsecond.
        seconds, micros = divmod(max(1, round(timeout * 1_000_000)), 1_000_000)
        timeval = struct.pack("ll", seconds, micros)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    state = connection._ratekeeper = (sock, bytearray(65536), poller)
    return state


def _readable(connection: Any, raw: tuple[Any, bytearray, Any] | None) -> bool:
    """Whether an idle connection has something to read: the server's close, most likely."""
    if raw is not None:
        return bool(raw[2].poll(0))
    poller = select.poll()
    poller.register(connection._sock, select.POLLIN)
    return bool(poller.poll(0))


def _read_raw(connection: Any, raw: tuple[Any, bytearray, Any]) -> Any:
    """The reply read straight from the socket by the hiredis reader of redis-py's parser."""
    sock, buffer, _ = raw
    reader = connection._parser._reader
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


_TRANSPORTS: weakref.WeakSet[BlockingTransport] = weakref.WeakSet()


def _forget_after_fork() -> None:
    for transport in list(_TRANSPORTS):
        transport.forget()


os.register_at_fork(after_in_child=_forget_after_fork)
