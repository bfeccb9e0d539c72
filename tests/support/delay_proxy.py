"""A loopback TCP proxy that can slow a server down: every chunk of data from the server to the
client waits ``delay`` seconds before it is forwarded. Client-to-server data passes at once.

    with DelayProxy(server.port) as proxy:
        limiter = Limiter.from_url(proxy.url, ...)
        proxy.delay = 0.03   # each reply now arrives 30 ms late; set back to 0 to heal

Threads, not asyncio, so it works the same under a sync or an async limiter. Each connection
gets two pump threads; ``close()`` shuts every socket down and joins every thread.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType


class DelayProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<upstream_port>, delaying server replies."""

    def __init__(self, upstream_port: int, delay: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.connections = 0
        self._acceptor = threading.Thread(target=self._accept, name="delay-proxy", daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self.connections += 1
                self._sockets += [client, upstream]
                pumps = [
                    threading.Thread(
                        target=self._pump, args=(client, upstream, False), daemon=True
                    ),
                    threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True),
                ]
                self._threads += pumps
            for pump in pumps:
                pump.start()

    def _pump(self, source: socket.socket, sink: socket.socket, delayed: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if delayed:
                    delay = self.delay
                    if delay > 0:
                        time.sleep(delay)  # the point of this proxy: a slow server
                sink.sendall(data)
        except OSError:
            pass
        finally:
            # Half-close towards the other side so its pump ends too.
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
            threads, self._threads = self._threads, []
        # On Linux, shutdown() wakes a thread blocked in accept(); close() alone would not.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(5)
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(5)
        for sock in sockets:
            sock.close()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
