"""The asyncio transport to one server: ratekeeper's own connections, read by hiredis.

A ``Link`` is one connection (``_link``). ``Link.send`` writes a packed round of commands in one
``send`` and returns a ``Round``; each read feeds hiredis and hands each reply to the exchanges
of the calls it answers as it arrives: a call whose exchange ends there is resolved there (its
caller runs on the loop's next turn), one that needs another command (NOSCRIPT) waits for the
next round; the link goes back to the pool as the round ends, and the round's future wakes the
lane's task, which sends what is left or the next batch. No stream reader, no coroutine per
reply: a round of 200 script calls costs one write, the reads the kernel makes, and one wake-up
of the task that sent it.

``Links`` opens them (``_connect``) and keeps them, configured as redis-py would configure its
own connection for the same client: the same host and port, unix socket path or TLS context
(built by redis-py's ``SSLConnection`` from the same options), then ``AUTH`` (username and
password, or password), ``CLIENT SETNAME`` and ``SELECT``, sent together, in RESP2. Only a
client that redis-py would connect that way is served here (``Links.serving``; a cluster's
nodes, ``Links.for_node``; the primary a Sentinel names, ``Links.for_sentinel``, which
``follow`` the sentinels' word): a connection class, a credential provider, RESP3, a retry or
any other connection option of the user's keeps redis-py's own connections (``_pipeline``), as
does a client of the user's.

What happens to the calls is the exchange's rule (``_exchange``), driven by ``run``:

- a link found closed before the write (the loop saw the server close it, or, not over TLS,
  its socket is readable while idle: the server's FIN not yet seen by the loop) is replaced and
  the round goes out on a fresh one, once per call (``unsent(broke=True)``); a link that
  cannot be opened ends the calls (``unsent(broke=False)``);
- no reply in time, judged by when the replies arrived (``_link``: the kernel's receive time),
  not by when a busy loop read them: when the round's timer fires, what has arrived unread is
  read first; what is still missing ends with a timeout, never sent again, and the link is
  closed; a reply that arrived after the deadline is a timeout too (the link stays in step);
- a link lost after the write ends the calls still waiting, and only those (a round is on one
  link), never sent again;
- the round's failure is classified by ``Exchange.failed``, replies by ``_errors.translate``
  through the exchange; error replies are the exception objects redis-py's parser builds
  (``BaseParser.parse_error``, in ``_wire``'s reader).

Anything else raised while a round runs (a bug, a cancellation; in a read too, where the
round's waiter gets it) closes the link, whose replies may still be on their way, and
propagates: the batcher hands it to every caller of the batch not answered yet.

redis-py internals: the pool's ``connection_class`` and ``connection_kwargs``; an asyncio
``SSLConnection``'s ``ssl_context.get()`` for TLS. (Those of the links' reader: ``_wire``.)
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio

from ._batch import Pending
from ._connect import handshake, open_socket
from ._errors import CLIENT_ERRORS, IO_ERRORS
from ._exchange import DONE
from ._link import Link, Round, keep_stamping
from ._wire import closed_while_idle, pack_command, pack_round

__all__ = ["Link", "Links", "Round"]

#: The asyncio connection classes whose connections a link makes the same way.
_PLAIN = redis.asyncio.Connection
_UNIX = redis.asyncio.UnixDomainSocketConnection
_TLS = redis.asyncio.SSLConnection
#: Connection options a link honours (or that change nothing for it). ``retry`` is the one
#: ``_config`` sets (the exchange's rule replaces it); a user's own keeps redis-py's path.
_HONOURED = frozenset(
    {
        "host",
        "port",
        "path",
        "db",
        "username",
        "password",
        "client_name",
        "socket_timeout",
        "socket_connect_timeout",
        "decode_responses",  # script replies are integers; INFO is parsed either way
        "encoding",
        "encoding_errors",
        "retry",
        "protocol",
        "lib_name",
        "lib_version",
        "health_check_interval",
        "ssl_keyfile",
        "ssl_certfile",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_data",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_ciphers",
        # redis-py 8 (relaxed timeouts during server maintenance): its copies of the address
        # and timeouts, and the push notifications that drive it, which come over RESP3 only; a
        # link speaks RESP2, so they never arrive.
        "orig_host_address",
        "orig_socket_timeout",
        "orig_socket_connect_timeout",
        "maint_notifications_config",
        "maint_notifications_pool_handler",
        # redis-py 8: state for the client's own HIMPORT commands; a link sends scripts only.
        "himport_registry",
        # A cluster client's nodes: the client library's name, for CLIENT SETINFO (as
        # lib_name and lib_version, not sent by a link).
        "driver_info",
    }
)
#: Options that change nothing while unset (None or False), and keep redis-py's connections
#: when set.
_UNSET_ONLY = frozenset({"credential_provider", "socket_keepalive", "socket_keepalive_options"})


class Links:
    """The links of one asyncio storage, to one server: opened on demand, kept while idle."""

    def __init__(
        self,
        *,
        address: dict[str, Any],
        handshake: tuple[tuple[Any, ...], ...],
        timeout: float | None,
        connect_timeout: float | None,
        ssl: Any = None,
        max_links: int | None = None,
    ) -> None:
        self.address = address
        self.handshake = handshake
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.ssl = ssl
        self.max_links = max_links
        self.idle: list[Link] = []
        self.every: set[Link] = set()  # links made and not lost: idle or in use
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Links made before the address last changed (``follow``) are not reused.
        self._made_for: dict[Link, dict[str, Any]] = {}
        keep_stamping()

    @classmethod
    def serving(cls, client: Any, *, own_retry: bool) -> Links | None:
        """Links made as ``client`` (a ``redis.asyncio.Redis``) would make its connections, or
        None when it is configured in a way only redis-py's own connections honour (see the
        module's comment). ``own_retry``: the user gave the client a ``retry`` of their own."""
        pool = getattr(client, "connection_pool", None)
        if (
            type(client) is not redis.asyncio.Redis
            or type(pool) is not redis.asyncio.ConnectionPool
            or own_retry
        ):
            return None
        return cls._made_as(pool.connection_class, pool.connection_kwargs, pool.max_connections)

    @classmethod
    def for_sentinel(cls, pool: Any, *, own_retry: bool) -> Links | None:
        """Links to the primary a Sentinel-managed ``pool`` serves, made as its connections
        would be, or None (as ``serving``). Their address is the one the sentinels name, which
        the storage's watch tells them (``follow``)."""
        if own_retry:
            return None
        kind = _TLS if issubclass(pool.connection_class, _TLS) else _PLAIN
        kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "connection_pool"}
        return cls._made_as(kind, {**kwargs, "host": "", "port": 0}, pool.max_connections)

    def follow(self, host: str, port: int) -> None:
        """The server moved (a Sentinel failover): links are made to ``host:port`` from now on,
        and those to the old address are closed once idle, never reused."""
        if self.address.get("host") == host and self.address.get("port") == port:
            return
        self.address = {"host": host, "port": port}
        idle, self.idle = self.idle, []
        for link in idle:
            link.abort(redis.ConnectionError("the server it was made to is no longer the primary"))

    @classmethod
    def for_node(cls, node: Any) -> Links | None:
        """Links made as a cluster client's ``node`` (a ``ClusterNode``) would make its
        connections, or None (as ``serving``)."""
        return cls._made_as(node.connection_class, node.connection_kwargs, node.max_connections)

    @classmethod
    def _made_as(cls, kind: Any, options: dict[str, Any], max_connections: int) -> Links | None:
        kwargs = {k: v for k, v in options.items() if k not in _UNSET_ONLY or v}
        if (
            sys.platform == "win32"  # the proactor loop watches no sockets (add_reader)
            or kind not in (_PLAIN, _UNIX, _TLS)
            or set(kwargs) - _HONOURED
            or kwargs.get("protocol") not in (None, 2, "2")
            or kwargs.get("health_check_interval", 0)
        ):
            return None
        handshake: list[tuple[Any, ...]] = []
        username, password = kwargs.get("username"), kwargs.get("password")
        if username or password:
            handshake.append(("AUTH", username, password or "") if username else ("AUTH", password))
        if kwargs.get("client_name"):
            handshake.append(("CLIENT", "SETNAME", kwargs["client_name"]))
        if kwargs.get("db"):
            handshake.append(("SELECT", kwargs["db"]))
        ssl = None
        if kind is _UNIX:
            address: dict[str, Any] = {"path": kwargs.get("path", "")}
        else:
            address = {
                "host": kwargs.get("host", "localhost"),
                "port": int(kwargs.get("port", 6379)),
            }
            if kind is _TLS:
                ssl = kind(**kwargs).ssl_context.get()  # redis-py's context for these options
        max_links = max_connections if max_connections < 2**31 else None
        return cls(
            address=address,
            handshake=tuple(handshake),
            timeout=kwargs.get("socket_timeout"),
            connect_timeout=kwargs.get("socket_connect_timeout"),
            ssl=ssl,
            max_links=max_links,
        )

    # --- links ------------------------------------------------------------------------------

    def take(self) -> Link | None:
        """An idle link of the running loop, or None."""
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            # Links belong to the loop that opened them; those of a finished loop are closed.
            for old in list(self.every):
                old.abort(redis.ConnectionError("its event loop has ended"))
            self.loop = loop
            self.idle = []
            self.every = set()
            self._made_for = {}
        idle = self.idle
        while idle:
            link = idle.pop()
            if link.lost is None:
                return link
        return None

    def give(self, link: Link | None) -> None:
        """Keep ``link`` for the next caller (if it is fine and still of this loop)."""
        if link is None:
            return
        if (
            link.lost is None
            and not link.rounds
            and link.loop is self.loop
            and self._made_for.get(link) is self.address
        ):
            self.idle.append(link)
        elif link.lost is None:
            link.abort(redis.ConnectionError("a link out of step is not reused"))

    async def connect(self) -> Link:
        """A new link, connected and configured; redis-py's errors if it cannot be."""
        loop = asyncio.get_running_loop()
        if self.max_links is not None and len(self.every) >= self.max_links:
            raise redis.ConnectionError("Too many connections")
        deadline = None if self.connect_timeout is None else loop.time() + self.connect_timeout
        address = self.address
        if not address.get("host") and "path" not in address:
            raise redis.ConnectionError("no primary is named by the sentinels yet")
        sock = await open_socket(loop, address, deadline)
        tls = incoming = outgoing = None
        try:
            if self.ssl is not None:
                incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
                tls = self.ssl.wrap_bio(incoming, outgoing, server_hostname=address["host"])
                await handshake(loop, sock, tls, incoming, outgoing, deadline)
        except BaseException:
            sock.close()
            raise
        link = Link(loop, sock, tls, incoming, outgoing)
        try:
            self.every.add(link)
            self._made_for[link] = address
            link.gone.add_done_callback(lambda _: self._forget(link))
            if self.handshake:
                await self._configure(link)
        except BaseException as exc:
            link.abort(exc if isinstance(exc, Exception) else redis.ConnectionError("cancelled"))
            raise
        return link

    def _forget(self, link: Link) -> None:
        self.every.discard(link)
        self._made_for.pop(link, None)

    async def _configure(self, link: Link) -> None:
        """AUTH, CLIENT SETNAME and SELECT in one round, as redis-py sends them."""
        packed = b"".join(pack_command(command) for command in self.handshake)
        replies = await self.round_trip(link, packed, len(self.handshake))
        for command, reply in zip(self.handshake, replies, strict=True):
            if isinstance(reply, Exception):
                # An error reply to the handshake (a wrong password, a DB index out of range)
                # is the configuration's, not an outage: raised as redis-py raises it.
                raise reply
            if reply not in (b"OK", "OK"):
                what = {"AUTH": "Invalid Username or Password", "SELECT": "Invalid Database"}
                raise redis.ConnectionError(
                    f"{what.get(command[0], 'Error setting client name')}: {reply}"
                )

    async def round_trip(self, link: Link, packed: bytes, count: int) -> list[Any]:
        """Write one round and wait for all its replies; redis-py's errors if the link breaks
        or does not answer in time (then it is closed: a late reply must not be read as
        another's)."""
        current = link.send(packed, count, None, None, time.perf_counter(), self.timeout)
        if self.timeout is None:
            await current.future
            return current.replies
        timer = link.loop.call_later(self.timeout, _expire, link, current, self.timeout)
        try:
            await current.future
        finally:
            timer.cancel()
        return current.replies

    async def command(self, *command: Any) -> Any:
        """One plain command (``INFO``) on a link; redis-py's errors as they are."""
        link = self.take() or await self.connect()
        try:
            (reply,) = await self.round_trip(link, pack_command(command), 1)
        except BaseException:
            link.abort(redis.ConnectionError("interrupted"))
            raise
        self.give(link)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def close(self) -> None:
        """Close every link, those in use too (their calls fail as on a lost connection)."""
        self.idle = []
        if self.loop is not None and self.loop is asyncio.get_running_loop():
            for link in list(self.every):
                await link.close()

    # --- driving exchanges -----------------------------------------------------------------

    async def run(
        self,
        calls: list[Pending],
        rerouted: list[Pending] | None = None,
        unreachable: Callable[[], None] | None = None,
    ) -> None:
        """Drive the calls' exchanges to their end on one link of this pool, settling each
        call as its exchange ends (see the module's comment for what happens when the link
        breaks or the store does not answer). A cluster node's: calls redirected (ASK,
        TRYAGAIN) go to ``rerouted``, for redis-py's cluster client to send (``_command``);
        ``unreachable`` is called when no connection could be made (not in time, or at all)."""
        link = self.take()
        try:
            while calls:
                if link is not None and not link.usable:
                    # Closed by the server while idle: nothing of this round has run.
                    link.abort(redis.ConnectionError("closed by the server while idle"))
                    link = None
                    closed = closed_while_idle()
                    calls = [c for c in calls if c.exchange.unsent(closed, broke=True) != DONE]
                    continue
                if link is None:
                    try:
                        link = await self.connect()
                    except CLIENT_ERRORS as exc:
                        if unreachable is not None and not isinstance(exc, redis.TimeoutError):
                            unreachable()  # refused or reset: gone, not slow
                        for call in calls:
                            call.exchange.unsent(exc, broke=False)
                        return
                calls = await self._round(link, calls, rerouted)
                if link.lost is not None or not calls:
                    # Broke during the round (the rest go on a new one), or back in the pool.
                    link = None
        except BaseException:
            if link is not None:
                link.abort(redis.ConnectionError("interrupted"))
            raise
        self.give(link)

    async def _round(
        self, link: Link, calls: list[Pending], rerouted: list[Pending] | None = None
    ) -> list[Pending]:
        """One round trip; returns the calls that go on to the next."""
        sent = time.perf_counter()  # this round trip, not the link's set-up, is the store's
        for call in calls:
            call.exchange.sent = sent
        slots, packed = pack_round(calls, [call.exchange for call in calls])
        timeout = self.timeout
        current = link.send(packed, len(slots), slots, self, sent, timeout, rerouted)
        timer = (
            None
            if timeout is None
            else link.loop.call_later(timeout, _expire, link, current, timeout)
        )
        error: Any = None
        try:
            await current.future
        except IO_ERRORS as exc:
            error = exc
        finally:
            if timer is not None:
                timer.cancel()
        if error is not None:
            # Timed out, or lost after the write: the calls without a reply may have run.
            for group in slots[len(current.replies) :]:
                for call in group:
                    call.exchange.failed(error, sent=True, seconds=self.timeout)
        return current.again


def _expire(link: Link, current: Round, seconds: float) -> None:
    """The round's time is up. What arrived and a busy loop has not read yet is read first,
    and judged by when it arrived (``_link``); if the replies are still not all there, the
    link is closed, and its rounds fail with redis-py's timeout."""
    if not current.future.done():
        link.drain()
    if not current.future.done():
        link.abort(redis.TimeoutError(f"no reply within {seconds} s"))
