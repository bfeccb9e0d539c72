"""One of ratekeeper's own asyncio connections: a non-blocking socket the event loop watches,
that writes a round of commands and reads their replies with hiredis (``_wire.new_reader``), as
``Round`` objects in the order sent; before a write, ``usable`` says whether the server closed it
while it was idle (``_wire.IdleCheck``). The pool of them, and what a round means for the
exchanges it carries, is ``_protocol``.

**The store's time, not the loop's.** A reply is stamped with when it reached this process, not
when a busy event loop got round to reading it: on TCP the kernel stamps every segment it
receives (``SO_TIMESTAMPNS``, read with ``recvmsg``), and the stamp, moved onto
``time.perf_counter``'s clock, is the reply's ``arrived`` time. A round's deadline is judged by
it: a reply that arrived within ``timeout`` of the write is a reply however late the loop read
it, and one that arrived after the deadline is a timeout however early the loop read it. Before
a round is given up (``_protocol``'s timer), the socket is read once more (``drain``): a reply
waiting there, unread because the loop was busy, is found and judged by its stamp. That is why
the link reads its socket itself (``loop.add_reader``) rather than through an asyncio transport,
which reads with ``recv`` and keeps no stamp: TLS goes through an ``ssl.SSLObject`` on memory
buffers, as asyncio's own TLS does, so its raw segments are stamped too. A unix socket has no
stamps: there ``arrived`` is when the loop read the reply (``stamped`` is False), and only the
deadline's last read applies.

redis-py internals: none here (the reader's, in ``_wire``).
"""

from __future__ import annotations

import asyncio
import atexit
import socket
import ssl
import struct
import sys
import time
from collections import deque
from typing import Any, Protocol

import redis
from redis.exceptions import InvalidResponse

from ._batch import Pending
from ._errors import REROUTE
from ._exchange import DONE
from ._wire import INCOMPLETE, IdleCheck, new_reader

__all__ = ["Link", "Pool", "Round", "keep_stamping", "stamps_on"]


class Pool(Protocol):
    """Where a link goes back once its round is settled (``_protocol.Links``)."""

    def give(self, link: Link | None) -> None: ...


#: The most bytes one read takes from the socket.
_READ = 262_144
#: Linux's ``SO_TIMESTAMPNS`` (Python's ``socket`` module does not name it): every received
#: segment is stamped with the kernel's ``CLOCK_REALTIME``, handed over by ``recvmsg``.
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform == "linux" else None)
_ANCILLARY = socket.CMSG_SPACE(16) if hasattr(socket, "CMSG_SPACE") else 0
_TIMESPEC = {16: struct.Struct("@qq"), 8: struct.Struct("@ii")}
_NEVER = float("inf")
#: A read this soon after its round was written needs no stamp: the reply arrived within it.
PROMPT = 0.001


def stamps_on(sock: socket.socket) -> bool:
    """Ask the kernel to stamp what ``sock`` receives; whether it will (TCP on Linux)."""
    if _SO_TIMESTAMPNS is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    keep_stamping()
    return True


def keep_stamping() -> None:
    """Open the process's stamping socket (``_keeper``) if it is not open yet: ahead of the
    first link, so that stamping is on by the time its replies come."""
    if not _KEEPER:
        _KEEPER.append(_keeper())


def _keeper() -> socket.socket | None:
    """A socket that asks for stamps and stays open for the process's life. Linux stamps
    received segments only while some socket on the machine asks, and turns stamping on
    lazily (a deferred work item) when the first one does: the first replies on a link made
    while no other socket asked could arrive unstamped (then they are timed from their read,
    a busy loop's wait included). With this one open, the links never wait for that."""
    if _SO_TIMESTAMPNS is None:
        return None
    try:
        keeper = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    try:
        keeper.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        keeper.close()
        return None
    atexit.register(keeper.close)
    return keeper


_KEEPER: list[socket.socket | None] = []


def _arrived(ancillary: list[tuple[int, int, bytes]]) -> float:
    """When the newest segment of a read just made reached the socket, on
    ``time.perf_counter``'s clock (now, if the kernel gave no stamp). Only the time it waited
    unread is taken from the wall clock, read together with ``perf_counter`` after the read (a
    pause between them would move the arrival), so a step of the wall clock moves nothing else."""
    now = time.perf_counter()
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
            layout = _TIMESPEC.get(len(data))
            if layout is not None:
                seconds, nanos = layout.unpack(data)
                waited = time.time() - (seconds + nanos * 1e-9)
                return now - waited if waited > 0 else now
    return now


class Round:
    """The replies of one write: ``count`` of them, in order, into ``replies``. With ``slots``
    (the calls each reply answers), each reply is handed to its calls as it arrives: a call
    whose exchange it ends is settled there and then; the others wait in ``again`` for the
    next round. ``deadline``: the ``perf_counter`` time by which a reply must have arrived
    (judged by its stamp); a later one ends its calls with ``late``. ``prompt``: until then,
    a read needs no stamp (``PROMPT`` after the write)."""

    __slots__ = (
        "again", "count", "deadline", "future", "late", "pool", "prompt", "replies", "reroute",
        "slots",
    )  # fmt: skip

    def __init__(
        self,
        count: int,
        future: asyncio.Future[None],
        slots: list[list[Pending]] | None,
        pool: Pool | None,
        sent: float,
        deadline: float,
        reroute: list[Pending] | None = None,
    ) -> None:
        self.count = count
        #: A cluster node's round: where calls redirected elsewhere (ASK, TRYAGAIN) go.
        self.reroute = reroute
        self.future = future
        self.slots = slots
        #: Where the link goes back once the round ends with every call settled: at once, so
        #: that the callers it wakes find it idle.
        self.pool = pool
        self.prompt = sent + PROMPT
        self.deadline = deadline
        self.late: Exception | None = None
        self.replies: list[Any] = []
        self.again: list[Pending] = []


class Link:
    """One connection: rounds written in one go, replies read and stamped as they arrive."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        tls: ssl.SSLObject | None = None,
        incoming: ssl.MemoryBIO | None = None,
        outgoing: ssl.MemoryBIO | None = None,
    ) -> None:
        self.loop = loop
        self.sock = sock
        self._fd = sock.fileno()
        self._tls = tls
        #: Whether the connection is TLS (``ssl.SSLObject`` on memory buffers).
        self.encrypted = tls is not None
        self._incoming = incoming
        self._outgoing = outgoing
        #: Whether replies carry the kernel's receive time (TCP on Linux).
        self.stamped = stamps_on(sock)
        self.reader = new_reader()
        self.rounds: deque[Round] = deque()
        #: Set once the connection is lost (then ``rounds`` is empty for good).
        self.lost: BaseException | None = None
        self.gone: asyncio.Future[None] = loop.create_future()
        self._pending = bytearray()  # written, not yet taken by the kernel
        self._idle = IdleCheck(sock, tls=tls is not None)
        loop.add_reader(self._fd, self._readable)

    # --- the socket -------------------------------------------------------------------------

    def _readable(self) -> bool:
        """The loop saw the socket readable (or ``drain`` asks): read what is there. Whether
        anything was. The kernel's stamp is asked for only when the read is not prompt (the
        loop was busy): a prompt one's replies arrived within ``PROMPT`` of their write."""
        arrived = time.perf_counter()
        rounds = self.rounds
        try:
            if self.stamped and rounds and arrived > rounds[0].prompt:
                data, ancillary, _, _ = self.sock.recvmsg(_READ, _ANCILLARY)
                arrived = _arrived(ancillary)
            else:
                data = self.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self._close(exc)
            return False
        if not data:
            self._close(redis.ConnectionError("Connection closed by server."))
            return False
        if self._tls is not None:
            plain = self._decrypt(data)
            if plain is None:
                return True
            data = plain
        self._replies(data, arrived)
        return True

    def drain(self) -> None:
        """Read whatever has arrived that the loop has not read yet (it was busy)."""
        while self.lost is None and self._readable():
            pass

    def _decrypt(self, data: bytes) -> bytes | None:
        """The plain bytes in ``data``, TLS records read from the socket; None if none."""
        assert self._tls is not None
        assert self._incoming is not None
        self._incoming.write(data)
        chunks = []
        try:
            while True:
                chunk = self._tls.read(_READ)
                if not chunk:
                    break
                chunks.append(chunk)
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            self._close(redis.ConnectionError("Connection closed by server."))
            return None
        except ssl.SSLError as exc:
            self._close(redis.ConnectionError(f"TLS error: {exc}"))
            return None
        self._flush_tls()  # a key update or alert the TLS layer answers
        return b"".join(chunks) or None

    def _flush_tls(self) -> None:
        assert self._outgoing is not None
        if self._outgoing.pending:
            self._write(self._outgoing.read())

    def _write(self, data: bytes) -> None:
        if self._pending:
            self._pending += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._close(exc)
            return
        if sent < len(data):
            self._pending += data[sent:]
            self.loop.add_writer(self._fd, self._writable)

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self._pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(exc)
            return
        del self._pending[:sent]
        if not self._pending:
            self.loop.remove_writer(self._fd)

    # --- replies ----------------------------------------------------------------------------

    def _replies(self, data: bytes, arrived: float) -> None:
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
                if self.stamped and arrived > current.deadline and current.late is None:
                    # Replies arrive in order: this one and every later one are late.
                    current.late = redis.TimeoutError("the reply arrived after the deadline")
                if slots is not None:
                    if current.late is not None:
                        for call in slots[len(replies)]:
                            call.exchange.answered = arrived
                            call.exchange.timed_out(current.late)
                            call.deliver()
                    elif current.reroute is not None and isinstance(reply, REROUTE):
                        current.reroute.extend(slots[len(replies)])
                    else:
                        for call in slots[len(replies)]:
                            exchange = call.exchange
                            exchange.answered = arrived
                            if exchange.replied(reply) == DONE:
                                call.deliver()
                            else:
                                current.again.append(call)
                replies.append(reply)
                if len(replies) == current.count:
                    rounds.popleft()
                    if current.pool is not None and not current.again:
                        current.pool.give(self)
                    if not current.future.done():
                        if current.late is not None and slots is None:
                            current.future.set_exception(current.late)
                        else:
                            current.future.set_result(None)
                reply = reader.gets()
        except InvalidResponse as exc:
            self.abort(exc)
        except Exception as exc:  # a bug, not the store: the round's waiter raises it
            self.abort(exc)

    # --- used by ``_protocol`` --------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Open, as far as the loop has seen, and not found closed by the server while idle
        (``IdleCheck``; over TLS only what the loop has seen counts). Checked before each
        write."""
        if self.lost is not None:
            return False
        return bool(self.rounds) or not self._idle.closed()

    def send(
        self,
        packed: bytes,
        count: int,
        slots: list[list[Pending]] | None = None,
        pool: Pool | None = None,
        sent: float = 0.0,
        timeout: float | None = None,
        reroute: list[Pending] | None = None,
    ) -> Round:
        """Write ``packed`` (``count`` commands) at ``sent`` (``time.perf_counter()``) and
        return the round their replies go to (and, with ``slots``, the calls each answers;
        with ``pool``, where the link goes back once they are all settled; ``timeout``: their
        replies must arrive within it; ``reroute``: a cluster node's, where redirected calls
        go)."""
        deadline = _NEVER if timeout is None else sent + timeout
        current = Round(count, self.loop.create_future(), slots, pool, sent, deadline, reroute)
        self.rounds.append(current)
        if self._tls is not None:
            self._tls.write(packed)
            self._flush_tls()
        else:
            self._write(packed)
        return current

    def abort(self, exc: BaseException) -> None:
        """Close at once: every round still waiting fails with ``exc``."""
        self._close(exc)

    def _close(self, exc: BaseException) -> None:
        open_loop = not self.loop.is_closed()
        if self.lost is None:
            self.lost = exc
            if open_loop:
                self.loop.remove_reader(self._fd)
                if self._pending:
                    self.loop.remove_writer(self._fd)
            self.sock.close()
        if not open_loop:  # its futures can no longer call back
            self.rounds = deque()
            return
        rounds, self.rounds = self.rounds, deque()
        for waiting in rounds:
            if not waiting.future.done():
                waiting.future.set_exception(exc)
                waiting.future.exception()  # retrieved: a round nobody awaits logs nothing
        if not self.gone.done():
            self.gone.set_result(None)

    async def close(self) -> None:
        if self.lost is None:
            self.abort(redis.ConnectionError("closed by ratekeeper"))
