"""Web servers the tests start on free loopback ports, and a load of concurrent requests.

* :func:`web_process`: a server process (uvicorn, gunicorn, ``ratekeeper demo --serve``),
  waited for until it answers over HTTP, never slept for, and stopped on exit.
* :func:`in_thread`: a standard-library server (``http.server``, ``wsgiref``) served from a
  thread of the test process; :class:`Upstream`, one that counts what it received.
* :func:`hammer`: GETs from several threads released at once, each on a new connection.
"""

from __future__ import annotations

import contextlib
import os
import socketserver
import subprocess
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

import httpx

from .processes import log_text, stop_process, wait_until
from .servers import free_port

ROOT = Path(__file__).resolve().parents[2]
#: Client threads of :func:`hammer`.
THREADS = 8


class WebProcess:
    """A web server process started by :func:`web_process`."""

    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        self.url = url
        self.proc = proc
        self.log = log
        #: Its exit status, once stopped.
        self.returncode: int | None = None
        self._final_output: str | None = None

    def output(self) -> str:
        """What it has written (stdout and stderr) so far; all of it once stopped."""
        return self._final_output if self._final_output is not None else log_text(self.log)

    def wait_until(self, ready: Callable[[], Any], what: str) -> Any:
        """Poll ``ready()`` until it returns something true (returned), with a deadline; fail
        with the end of the log if the server dies or the time is up."""
        return wait_until(ready, self.proc, self.log, what)

    def answers(self, path: str) -> bool:
        """``GET path`` answers 200 (on a new connection)."""
        try:
            return httpx.get(self.url + path, timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self, grace: float) -> None:
        self.returncode = stop_process(self.proc, grace)
        self._final_output = log_text(self.log)


@contextlib.contextmanager
def web_process(
    command: Callable[[int], Sequence[str]],
    what: str,
    *,
    env: Mapping[str, str] | None = None,
    health: str = "/health",
    grace: float = 30.0,
) -> Iterator[WebProcess]:
    """``command(port)`` run from the repository root on a free loopback port, in a session of
    its own (its workers go with it), with this environment plus ``env`` but without
    ``WEB_CONCURRENCY`` (which would change a server's worker count). Yielded once
    ``GET health`` answers 200; stopped on exit (SIGTERM, then SIGKILL to the session after
    ``grace`` seconds), its exit status then in ``returncode``."""
    port = free_port()
    environ = {**os.environ, **(env or {})}
    environ.pop("WEB_CONCURRENCY", None)
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            list(command(port)), cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        server = WebProcess(f"http://127.0.0.1:{port}", proc, log)
        try:
            server.wait_until(lambda: server.answers(health), f"{what} ({health})")
            yield server
        finally:
            server.stop(grace)


@contextlib.contextmanager
def in_thread(server: socketserver.BaseServer) -> Iterator[str]:
    """Serve ``server`` (bound to a loopback port) from a thread; yields its URL (no trailing
    slash). Shut down and closed on exit."""
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class Upstream:
    """An HTTP server on a free loopback port, served from a thread while in a ``with`` block:
    every GET gets 200 ``ok``, and ``received`` counts them by their ``x-tenant`` header ("" for
    none). ``url`` ends with a slash."""

    def __init__(self) -> None:
        self.received: Counter[str] = Counter()
        lock = threading.Lock()
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with lock:
                    received[self.headers.get("x-tenant", "")] += 1
                body = b"ok"
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._handler = Handler
        self._serving = contextlib.ExitStack()
        self.url = ""

    def __enter__(self) -> Upstream:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler)
        httpd.daemon_threads = True
        self.url = self._serving.enter_context(in_thread(httpd)) + "/"
        return self

    def __exit__(self, *exc: object) -> None:
        self._serving.close()


@dataclass(frozen=True)
class Reply:
    sent: Mapping[str, str]  # the request headers
    status: int
    headers: httpx.Headers
    body: bytes


def hammer(url: str, path: str, header_sets: Sequence[Mapping[str, str]]) -> list[Reply]:
    """One GET of ``path`` per header set, from ``THREADS`` threads released at once, each
    request on a new connection (so every worker of a server takes part); the replies in no
    particular order."""
    chunks = [header_sets[i::THREADS] for i in range(THREADS)]
    start = threading.Barrier(THREADS)

    def run(chunk: Sequence[Mapping[str, str]]) -> list[Reply]:
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=url, timeout=30, limits=limits) as http:
            start.wait(30)
            out = []
            for headers in chunk:
                r = http.get(path, headers=dict(headers))
                out.append(Reply(headers, r.status_code, r.headers, r.content))
            return out

    with ThreadPoolExecutor(THREADS) as pool:
        return [reply for replies in pool.map(run, chunks) for reply in replies]
