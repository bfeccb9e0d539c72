"""Reloading the configuration while serving: a Kubernetes-style ``..data`` symlink swap under
load (no failed RPC, the new limit in force within 1 s, a broken file changes nothing and is
reported with its line), a file edited in place, and SIGHUP to ``ratekeeper serve``. Tests
wait on the watcher's condition or on the server's log lines, never on sleeps."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from ratekeeper.service._reload import ConfigWatcher

from ..support.servers import RedisServer, free_port
from ..support.service_support import OURS, running, serve_process, write


def limits(requests: int) -> str:
    return f"""\
domain: rl
descriptors:
  - key: user
    rate_limit:
      name: per-user
      unit: hour
      requests_per_unit: {requests}
"""


BROKEN = """\
domain: rl
descriptors:
  - key: user
    rate_limit: {unit: fortnight, requests_per_unit: 5}
"""


@pytest.fixture
def redis_url(servers: dict[str, RedisServer]) -> str:
    return next(iter(servers.values())).url


def configmap(root: Path, version: int, text: str) -> None:
    """What the kubelet does on a ConfigMap update: the files in a new timestamped directory,
    then ``..data`` swapped to it in one rename; ``limits.yaml`` links through ``..data``."""
    target = root / f"..2026_12_03_{version:04d}"
    write(target / "limits.yaml", text)
    tmp = root / "..data_tmp"
    os.symlink(target.name, tmp)
    os.replace(tmp, root / "..data")
    if not (root / "limits.yaml").is_symlink():
        os.symlink("..data/limits.yaml", root / "limits.yaml")


async def wait_until(watcher: ConfigWatcher, done: object, timeout: float = 5.0) -> None:
    async with watcher.changed:
        await asyncio.wait_for(watcher.changed.wait_for(done), timeout)  # type: ignore[arg-type]


async def client(
    n: int,
    channel: grpc.aio.Channel,
    seen: list[tuple[float, float, int]],
    failures: list[BaseException],
    stop: asyncio.Event,
) -> None:
    """Calls one after another until ``stop``, recording when each was sent and answered and
    the limit it saw."""
    call = OURS.caller(channel)
    i = 0
    while not stop.is_set():
        request = OURS.request("rl", [("user", f"c{n}-{i}")])
        i += 1
        sent = time.monotonic()
        try:
            response = await call(request)
        except grpc.aio.AioRpcError as exc:
            failures.append(exc)
            continue
        seen.append((sent, time.monotonic(), response.statuses[0].current_limit.requests_per_unit))


def test_symlink_swap_under_load(tmp_path: Path, redis_url: str) -> None:
    root = tmp_path / "config"
    root.mkdir()
    configmap(root, 1, limits(1_000_000))

    async def main() -> None:
        async with running(root, redis_url) as service:
            watcher = service.watcher
            seen: list[tuple[float, float, int]] = []  # (sent, answered, requests_per_unit)
            failures: list[BaseException] = []
            stop = asyncio.Event()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
                clients = [
                    asyncio.create_task(client(n, channel, seen, failures, stop)) for n in range(16)
                ]
                while len(seen) < 200:  # load is running
                    await asyncio.sleep(0.01)
                swapped = time.monotonic()
                configmap(root, 2, limits(2_000_000))
                await wait_until(watcher, lambda: watcher.generation >= 2)
                in_force = time.monotonic()
                # the broken version: refused, reported with its line, the old one stays
                configmap(root, 3, BROKEN)
                await wait_until(watcher, lambda: watcher.failures >= 1)
                broken_at = time.monotonic()
                mark = len(seen)
                while len(seen) < mark + 200:
                    await asyncio.sleep(0.01)
                stop.set()
                await asyncio.gather(*clients)

            assert failures == []
            assert in_force - swapped < 1.0
            first_new = min(answered for _, answered, limit in seen if limit == 2_000_000)
            assert first_new - swapped < 1.0
            # every call sent once the reload was applied saw the new limit, and no call ever
            # saw anything but the two configured limits
            assert {limit for sent, _, limit in seen if sent > in_force} == {2_000_000}
            assert {limit for *_, limit in seen} == {1_000_000, 2_000_000}
            assert {limit for sent, _, limit in seen if sent > broken_at} == {2_000_000}
            assert watcher.generation == 2
            assert watcher.last_error is not None
            assert "limits.yaml:4:" in watcher.last_error  # the line of the bad unit
            assert "fortnight" in watcher.last_error
            text, _ = service.metrics.render()
            assert b'ratekeeper_service_config_reloads_total{outcome="error"} 1.0' in text
            assert b'ratekeeper_service_config_reloads_total{outcome="ok"} 2.0' in text

    asyncio.run(main())


def test_file_edited_in_place(tmp_path: Path, redis_url: str) -> None:
    config = write(tmp_path / "one.yaml", limits(5))

    async def main() -> None:
        async with (
            running(config, redis_url, reload_interval=0.05) as service,
            grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel,
        ):
            call = OURS.caller(channel)
            request = OURS.request("rl", [("user", "edit")])
            assert (await call(request)).statuses[0].limit_remaining == 4
            config.write_text(limits(7))
            await wait_until(service.watcher, lambda: service.watcher.generation >= 2)
            # the counter is kept across the reload (the rule's place did not change)
            after = await call(request)
            assert after.statuses[0].current_limit.requests_per_unit == 7
            assert after.statuses[0].limit_remaining == 5
            assert await service.watcher.poll_once() is None  # nothing changed since

    asyncio.run(main())


def test_sighup(tmp_path: Path, redis_url: str) -> None:
    config = write(tmp_path / "hup.yaml", limits(3))
    http_port = free_port()
    with serve_process(
        "--config", str(config),
        "--storage", redis_url,
        "--host", "127.0.0.1",
        "--grpc-port", str(free_port()),
        "--http-port", str(http_port),
        "--reload-interval", "60",  # only SIGHUP reloads within this test
    ) as server:  # fmt: skip
        server.wait_for("ready")

        def served_limit() -> int:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/rlconfig") as answer:
                shown = json.load(answer)
            return int(shown["domains"][0]["descriptors"][0]["rate_limit"]["requests_per_unit"])

        assert served_limit() == 3
        config.write_text(limits(9))
        server.signal(signal.SIGHUP)
        server.wait_for("SIGHUP: configuration reloaded")
        assert served_limit() == 9
        config.write_text(BROKEN)
        server.signal(signal.SIGHUP)
        (line,) = server.wait_for("was not reloaded")
        assert f"{config}:4:" in line
        assert served_limit() == 9
        assert server.stop() == 0
