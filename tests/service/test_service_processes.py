"""``ratekeeper serve`` as users run it: several server processes on one private Redis with 64
concurrent gRPC clients admit exactly the limit (sliding_log and fixed_window); ``--workers 2``
shares the ports (SO_REUSEPORT) and the limit; ``--check``; a bad file stops the server with
its location; the environment variables."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
from collections import Counter
from pathlib import Path

import grpc
import httpx
import pytest

from ..support.private_servers import private_servers
from ..support.servers import free_port
from ..support.service_support import OURS, SCRIPT, STORE_TIMEOUT, serve_process, write

pytestmark = pytest.mark.usefixtures("binaries")

CONFIG = """\
domain: fleet
descriptors:
  - key: slog
    rate_limit: {unit: day, requests_per_unit: 100, algorithm: sliding_log}
  - key: fixed
    rate_limit: {unit: day, requests_per_unit: 100}
"""

CLIENTS = 64
CALLS = 4  # per client and descriptor: 256 tries at a limit of 100


async def hammer(ports: list[int]) -> Counter[str]:
    """64 clients, each on its own channel (its own connection) to one of ``ports`` in turn,
    all at once; how many calls were admitted per descriptor."""
    admitted: Counter[str] = Counter()
    start = asyncio.Event()

    async def client(n: int) -> None:
        port = ports[n % len(ports)]
        # a local subchannel pool: a connection of its own (gRPC shares one between channels
        # to one target by default, and the kernel spreads connections, not calls)
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            call = OURS.caller(channel)
            await channel.channel_ready()
            await start.wait()
            for i in range(CALLS * 2):
                key = ("slog", "fixed")[i % 2]
                response = await call(OURS.request("fleet", [(key, "shared")]))
                if response.overall_code == OURS.code("OK"):
                    admitted[key] += 1

    tasks = [asyncio.create_task(client(n)) for n in range(CLIENTS)]
    await asyncio.sleep(0)
    start.set()
    await asyncio.gather(*tasks)
    return admitted


def test_two_servers_exact(tmp_path: Path) -> None:
    config = write(tmp_path / "fleet.yaml", CONFIG)
    with private_servers() as started:
        redis_url = next(iter(started.values())).url
        grpc_ports = [free_port(), free_port()]
        common = ("--config", str(config), "--storage", redis_url, "--host", "127.0.0.1",
                  "--timeout", str(STORE_TIMEOUT))  # fmt: skip
        servers = [
            serve_process(*common, "--grpc-port", str(port), "--http-port", str(free_port()))
            for port in grpc_ports
        ]
        with servers[0] as first, servers[1] as second:
            first.wait_for("ready")
            second.wait_for("ready")
            admitted = asyncio.run(hammer(grpc_ports))
            assert admitted == {"slog": 100, "fixed": 100}
            assert first.stop() == 0
            assert second.stop() == 0


def test_workers_share_the_ports(tmp_path: Path) -> None:
    config = write(tmp_path / "fleet.yaml", CONFIG)
    with private_servers() as started:
        redis_url = next(iter(started.values())).url
        grpc_port, http_port = free_port(), free_port()
        with serve_process(
            "--config", str(config), "--storage", redis_url, "--host", "127.0.0.1",
            "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--workers", "2",
            "--timeout", str(STORE_TIMEOUT),
        ) as server:  # fmt: skip
            lines = server.wait_for("ready", count=2)
            pids = {re.search(r"worker (\d+)", line).group(1) for line in lines}  # type: ignore[union-attr]
            assert len(pids) == 2
            for line in lines:
                assert f"gRPC on 127.0.0.1:{grpc_port}, HTTP on 127.0.0.1:{http_port}" in line
            admitted = asyncio.run(hammer([grpc_port]))
            assert admitted == {"slog": 100, "fixed": 100}
            # Each scrape on a fresh connection lands on a worker the kernel picks, and each
            # shows both workers' counts together: exactly the limit.
            ok: dict[str, dict[str, float]] = {}
            for _ in range(40):
                text = httpx.get(f"http://127.0.0.1:{http_port}/metrics").text
                pid = re.search(r'ratekeeper_service_worker_info\{pid="(\d+)"\}', text)
                assert pid is not None
                ok[pid.group(1)] = {
                    key: float(found.group(1)) if found else 0.0
                    for key in ("slog", "fixed")
                    for found in [
                        re.search(
                            rf'ratekeeper_service_decisions_total\{{descriptor="fleet.{key}",'
                            rf'domain="fleet",outcome="ok"\}} (\S+)',
                            text,
                        )
                    ]
                }
            assert set(ok) == pids
            for counts in ok.values():
                assert counts == {"slog": 100, "fixed": 100}
            assert server.stop() == 0  # SIGTERM to the parent stops both workers


def test_check(tmp_path: Path) -> None:
    good = write(tmp_path / "good.yaml", CONFIG)
    done = subprocess.run(
        [SCRIPT, "serve", "--check", str(good)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout
    portable = subprocess.run(
        [SCRIPT, "serve", "--check", str(good), "--portable"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert portable.returncode == 1
    assert f"{good}:4:" in portable.stderr  # the algorithm extension, refused where written
    bad = write(tmp_path / "bad.yaml", CONFIG.replace("unit: day, requests", "unit: dya, requests"))
    done = subprocess.run(
        [SCRIPT, "serve", "--check", str(bad)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert re.search(rf"{re.escape(str(bad))}:\d+:\d+: .*dya", done.stderr)


def test_bad_config_stops_the_server(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.yaml", "domain: x\ndescriptors:\n  - key: a\n    nope: 1\n")
    done = subprocess.run(
        [SCRIPT, "serve", "--config", str(bad), "--storage", "memory://",
         "--grpc-port", "0", "--http-port", "0"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"{bad}:4:5:" in done.stderr
    memory = subprocess.run(
        [SCRIPT, "serve", "--config", str(bad), "--storage", "memory://", "--workers", "2"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert memory.returncode == 2
    assert "memory://" in memory.stderr


def test_environment(tmp_path: Path) -> None:
    config = write(tmp_path / "fleet.yaml", CONFIG)
    grpc_port, http_port = free_port(), free_port()
    env = {
        "RATEKEEPER_SERVE_CONFIG": str(config),
        "RATEKEEPER_STORAGE_URL": "memory://",
        "RATEKEEPER_SERVE_HOST": "127.0.0.1",
        "RATEKEEPER_SERVE_GRPC_PORT": str(grpc_port),
        "RATEKEEPER_SERVE_HTTP_PORT": str(http_port),
    }
    with serve_process(env=env) as server:
        (line,) = server.wait_for("ready")
        assert f"gRPC on 127.0.0.1:{grpc_port}, HTTP on 127.0.0.1:{http_port}" in line
        assert str(config) in line


@pytest.mark.parametrize("which", ["--grpc-port", "--http-port"])
def test_port_in_use(tmp_path: Path, which: str) -> None:
    """With one worker, reuse-port is off: a port another process holds is an error."""
    config = write(tmp_path / "fleet.yaml", CONFIG)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--http-port" if which == "--grpc-port" else "--grpc-port"
        done = subprocess.run(
            [SCRIPT, "serve", "--config", str(config), "--storage", "memory://",
             "--host", "127.0.0.1", which, str(port), other, "0"],
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
    assert done.returncode == 2
    kind = "gRPC" if which == "--grpc-port" else "HTTP"
    assert f"cannot serve {kind} on 127.0.0.1:{port}" in done.stderr
