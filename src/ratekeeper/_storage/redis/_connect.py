"""Opening one of ratekeeper's own connections (``_link``) by a deadline: the address looked up,
the TCP (or unix socket) connection made, the TLS handshake done on memory buffers.

**Judged by the kernel's view, not the loop's.** Each step waits for the socket with a timer at
the deadline that only looks: when it fires, the socket is polled once more, and a connection
the kernel made in time (or a handshake record that arrived) counts, even if a busy event loop
had not yet run the callback that would have seen it. Nothing is cancelled while it may have
succeeded. (``asyncio.wait_for`` around ``loop.create_connection`` cancelled connections the
kernel had made, whenever the loop's own work held up the few callbacks between the connect
and its end: a cold worker given a burst failed open on "Timeout connecting to server".)

redis-py internals: none (its exceptions are raised, as its own connections raise them).
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import socket
import ssl
from collections.abc import Callable
from typing import Any

import redis

__all__ = ["handshake", "open_socket"]


async def open_socket(
    loop: asyncio.AbstractEventLoop, address: dict[str, Any], deadline: float | None
) -> socket.socket:
    """A non-blocking socket connected to ``address`` (a unix ``path``, or ``host`` and
    ``port``: each address the name resolves to is tried in turn) by ``deadline`` (the loop's
    time). redis-py's errors if it cannot be."""
    if "path" in address:
        targets: list[tuple[Any, ...]] = [(socket.AF_UNIX, address["path"])]
    else:
        host, port = address["host"], address["port"]
        resolved = _literal(host, port)
        if resolved is None:
            lookup = asyncio.ensure_future(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            try:
                await _until(loop, lookup, deadline, lookup.done)
            except OSError as exc:
                raise redis.ConnectionError(f"Error connecting to the server: {exc}") from exc
            resolved = [(info[0], info[4]) for info in lookup.result()]
        targets = resolved
    error: OSError = OSError("no address")
    for family, where in targets:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            if family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = sock.connect_ex(where)
            if code in _IN_PROGRESS:
                await _ready(loop, sock, deadline, write=True)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, os.strerror(code))
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise redis.ConnectionError(f"Error connecting to the server: {error}")


_IN_PROGRESS = frozenset({errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK})


def _literal(host: str, port: int) -> list[tuple[Any, ...]] | None:
    """``host`` as an IP address, needing no lookup; None for a name."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return [(family, (host, port))]
    return None


async def handshake(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    tls: ssl.SSLObject,
    incoming: ssl.MemoryBIO,
    outgoing: ssl.MemoryBIO,
    deadline: float | None,
) -> None:
    """The TLS handshake of ``tls`` over ``sock``, by ``deadline``; redis-py's errors."""
    try:
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await _send_all(loop, sock, outgoing.read(), deadline)
                await _ready(loop, sock, deadline, write=False)
                data = sock.recv(_TLS_READ)
                if not data:
                    raise ConnectionResetError("closed during the TLS handshake") from None
                incoming.write(data)
        await _send_all(loop, sock, outgoing.read(), deadline)
    except (OSError, ssl.SSLError) as exc:
        raise redis.ConnectionError(f"Error connecting to the server: {exc}") from exc


_TLS_READ = 65_536


async def _send_all(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes, deadline: float | None
) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except (BlockingIOError, InterruptedError):
            await _ready(loop, sock, deadline, write=True)


async def _ready(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, deadline: float | None, *, write: bool
) -> None:
    """Until ``sock`` is writable (``write``) or readable, by ``deadline``. When the deadline
    passes the socket is looked at once more: a connection the kernel made in time, that a busy
    loop had not yet seen, is made (the loop's lag is not the store's)."""
    future: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    if write:
        loop.add_writer(fd, _resolve, future)
    else:
        loop.add_reader(fd, _resolve, future)
    try:
        await _until(loop, future, deadline, lambda: _polled(sock, write))
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def _until(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    deadline: float | None,
    look: Callable[[], bool],
) -> None:
    """Await ``future`` until ``deadline``; then, unless ``look()`` finds it done by now, it is
    cancelled and redis-py's connect timeout raised."""
    if deadline is None:
        await future
        return
    expired: list[bool] = []
    timer = loop.call_at(deadline, _looked, future, look, expired)
    try:
        await future
    except asyncio.CancelledError:
        if expired:
            raise redis.TimeoutError("Timeout connecting to server") from None
        raise
    finally:
        timer.cancel()


def _looked(future: asyncio.Future[Any], look: Callable[[], bool], expired: list[bool]) -> None:
    if future.done():
        return
    if look():
        if not future.done():
            future.set_result(None)
        return
    expired.append(True)
    future.cancel()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _polled(sock: socket.socket, write: bool) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(0))
