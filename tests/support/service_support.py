"""What the service tests share: an in-process ``Service`` on free ports, ``ratekeeper serve``
as a subprocess (waiting for its ready lines, never sleeping), and gRPC calls with either the
official Envoy stubs (xds-protos, when installed) or the project's own messages."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ratekeeper.service import rls_pb2 as ours
from ratekeeper.service._server import RLS_METHOD, ServeOptions, Service

from .processes import stop_process

#: The store timeout the service tests give ``serve`` (see :func:`running`).
STORE_TIMEOUT = 2.0

SCRIPT = shutil.which("ratekeeper", path=os.path.dirname(sys.executable)) or "ratekeeper"

try:  # the official stubs: test-only (xds-protos overwrites other packages' files)
    from envoy.service.ratelimit.v3 import rls_pb2 as official
    from envoy.service.ratelimit.v3 import rls_pb2_grpc as official_grpc
except ImportError:
    official = None
    official_grpc = None


@dataclass(frozen=True)
class Stubs:
    """Builds requests and calls ShouldRateLimit with one set of generated messages."""

    name: str
    request_type: Any
    response_type: Any

    def request(
        self,
        domain: str,
        *descriptors: list[tuple[str, str]] | dict[str, Any],
        hits_addend: int = 0,
    ) -> Any:
        """A request; a descriptor is its entries, or a dict with ``entries`` and optional
        ``hits_addend`` (per descriptor) and ``limit`` ((requests_per_unit, unit name))."""
        request = self.request_type(domain=domain, hits_addend=hits_addend)
        for given in descriptors:
            spec = given if isinstance(given, dict) else {"entries": given}
            descriptor = request.descriptors.add()
            for key, value in spec["entries"]:
                descriptor.entries.add(key=key, value=value)
            if "hits_addend" in spec:
                descriptor.hits_addend.value = spec["hits_addend"]
            if "limit" in spec:
                requests, unit = spec["limit"]
                descriptor.limit.requests_per_unit = requests
                descriptor.limit.unit = (
                    type(descriptor.limit)
                    .DESCRIPTOR.fields_by_name["unit"]
                    .enum_type.values_by_name[unit]
                    .number
                )
        return request

    def caller(self, channel: grpc.aio.Channel) -> Callable[..., Any]:
        if self.name == "official":
            return official_grpc.RateLimitServiceStub(channel).ShouldRateLimit  # type: ignore[union-attr]
        return channel.unary_unary(
            RLS_METHOD,
            request_serializer=self.request_type.SerializeToString,
            response_deserializer=self.response_type.FromString,
        )

    def code(self, name: str) -> int:
        return int(self.response_type.Code.Value(name))

    def unit(self, name: str) -> int:
        return int(self.response_type.RateLimit.Unit.Value(name))


OURS = Stubs("ours", ours.RateLimitRequest, ours.RateLimitResponse)
OFFICIAL = (
    Stubs("official", official.RateLimitRequest, official.RateLimitResponse)
    if official is not None
    else None
)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@contextlib.asynccontextmanager
async def running(config: Path, storage: str, **options: Any) -> AsyncIterator[Service]:
    """A ``Service`` in this event loop on free loopback ports. The store timeout is 2 s unless
    given (``STORE_TIMEOUT``): on a loaded CI machine 20 ms can pass, and a test about
    something else must not see a failure mode."""
    options.setdefault("key_prefix", f"svc{time.monotonic_ns()}")
    options.setdefault("timeout", STORE_TIMEOUT)
    service = Service(
        ServeOptions(
            config=str(config),
            storage=storage,
            host="127.0.0.1",
            grpc_port=0,
            http_port=0,
            **options,
        )
    )
    try:
        await service.start()
        yield service
    finally:
        await service.stop()


class ServeProcess:
    """``ratekeeper serve`` in a subprocess; its stderr is read by a thread into a queue, so a
    test waits for a line (a ready line, a reload) instead of sleeping."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, argv: list[str] | None = None
    ) -> None:
        self.proc = subprocess.Popen(
            argv if argv is not None else [SCRIPT, "serve", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put("")  # EOF

    def wait_for(self, fragment: str, count: int = 1, timeout: float = 30) -> list[str]:
        """The first ``count`` stderr lines containing ``fragment`` (already seen ones count)."""
        deadline = time.monotonic() + timeout
        found = [line for line in self.seen if fragment in line]
        while len(found) < count:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {fragment!r} within {timeout} s; stderr so far:\n{''.join(self.seen)}"
                ) from None
            if line == "":
                raise AssertionError(
                    f"{self.proc.args} exited ({self.proc.wait()}) before {fragment!r}:\n"
                    + "".join(self.seen)
                )
            self.seen.append(line)
            if fragment in line:
                found.append(line)
        return found[:count]

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self) -> int:
        code = stop_process(self.proc, 20)
        self._reader.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return code


@contextlib.contextmanager
def serve_process(*args: str, env: dict[str, str] | None = None) -> Iterator[ServeProcess]:
    process = ServeProcess(*args, env=env)
    try:
        yield process
    finally:
        process.stop()
