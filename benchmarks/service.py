"""``ratekeeper serve`` under load, beside a trivial gRPC servicer and the in-process
``AsyncLimiter`` on the same store, in one run.

Targets, each a separate process on loopback, pinned with ``taskset``:

* ``trivial``     a ``grpc.aio`` server answering ShouldRateLimit with a constant OK response,
  under the same method path, messages and generic handler as the service: the floor of
  what one Python gRPC process can serve here (CPU 0);
* ``serve/1w``    ``ratekeeper serve --workers 1`` on a private Redis (CPU 0);
* ``serve/2w``    ``ratekeeper serve --workers 2`` on the same ports (CPUs 0 and 1).

Loads, each at 1, 16 and 64 concurrent streams (``--streams``):

* ``h2load``   (Debian ``nghttp2-client``) posting one gRPC-framed request again and again over
  1 connection (1 stream) or 8 (16 and 64 streams), pinned to CPU 1; it reports calls/s (it
  does not read gRPC trailers, so the aio client below is the one that checks answers);
* ``aio``      a ``grpc.aio`` client process (CPU 1) with the same connections and streams,
  which times every call (``perf_counter_ns``) for p50/p99 and checks every answer is OK;

and ``in-process``: the same number of asyncio tasks calling ``AsyncLimiter.hit`` directly on
the same store and policy (this process, CPU 0), the ceiling the service's gRPC layer costs
against.

The limit is ``fixed_window`` at 4,000,000,000 per hour, so every call is admitted and decided
by the store (no deny cache). The aio client and the in-process tasks spread calls over 10,000
users; h2load sends one body, one user. The Redis server runs on CPU 1 with the load
generators: this machine has 2 cores, so two workers share them with Redis and the load, and
the CPU each process used is reported to show where the time went.

Ratios reported (h2load, per stream count): ``serve/1w / trivial`` (goal >= 0.7) and
``serve/2w / serve/1w`` (goal >= 1.6, or the CPU accounting that says why not).

Run: ``python benchmarks/service.py [--seconds 3] [--warmup 1] [--streams 1,16,64]``
Results: a table on stdout and ``benchmarks/results/service.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import Server, find_binary, machine_cpu, machine_info, percentile

from ratekeeper import AsyncLimiter, StorageError
from ratekeeper.service._config import identity_of
from ratekeeper.service._loader import load_config
from ratekeeper.service._server import RLS_METHOD, RLS_SERVICE
from ratekeeper.service.rls_pb2 import RateLimitRequest, RateLimitResponse

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "service.json"
SCRIPT = shutil.which("ratekeeper", path=os.path.dirname(sys.executable)) or "ratekeeper"
CONFIG = """\
domain: bench
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 4000000000}
"""
USERS = 10_000
#: The store timeout of the service and the in-process limiter (``--store-timeout``): the
#: production default. The service judges the store by the store's time (a reply's arrival,
#: not when its loaded loop read it), so a saturated worker shows up as latency, never as
#: UNAVAILABLE; the aio client counts every call that was not answered OK.
TIMEOUT = 0.020


def request(user: int) -> RateLimitRequest:
    message = RateLimitRequest(domain="bench")
    message.descriptors.add().entries.add(key="user", value=f"u{user}")
    return message


def connections(streams: int) -> int:
    return 1 if streams == 1 else 8


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return sum(int(v) for v in fields[11:15]) / tick


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the workers of ``serve --workers 2``)."""
    out = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for child in children:
        out += tree(int(child))
    return out


# -- the processes under test ---------------------------------------------------------------------


async def trivial_server(port: int) -> None:
    """The floor: the service's method, messages and generic handler, a constant answer."""
    import grpc

    answer = RateLimitResponse(overall_code=RateLimitResponse.OK)
    answer.statuses.add(code=RateLimitResponse.OK, limit_remaining=1)

    async def handle(message: RateLimitRequest, context: Any) -> RateLimitResponse:
        return answer

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handler = grpc.unary_unary_rpc_method_handler(
        handle,
        request_deserializer=RateLimitRequest.FromString,
        response_serializer=RateLimitResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(RLS_SERVICE, {"ShouldRateLimit": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


async def aio_client(port: int, streams: int, seconds: float, warmup: float) -> dict[str, Any]:
    """``streams`` closed-loop callers over ``connections(streams)`` channels; latencies of the
    calls that started inside the measured window."""
    import grpc

    # A local subchannel pool gives each channel its own connection (gRPC shares one between
    # channels to one target by default, and SO_REUSEPORT spreads connections, not calls).
    channels = [
        grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        for _ in range(connections(streams))
    ]
    calls = [
        channel.unary_unary(
            RLS_METHOD,
            request_serializer=RateLimitRequest.SerializeToString,
            response_deserializer=RateLimitResponse.FromString,
        )
        for channel in channels
    ]
    for channel in channels:
        await channel.channel_ready()
    bodies = [request(user) for user in range(USERS)]
    latencies: list[int] = []
    bad = 0
    failed: dict[str, int] = {}
    begin = time.perf_counter_ns() + int(warmup * 1e9)
    end = begin + int(seconds * 1e9)

    async def caller(n: int) -> None:
        nonlocal bad
        call = calls[n % len(calls)]
        i = n
        while True:
            started = time.perf_counter_ns()
            if started >= end:
                return
            try:
                answer = await call(bodies[i % USERS])
            except grpc.aio.AioRpcError as exc:  # UNAVAILABLE: the store failed, said serve
                failed[exc.code().name] = failed.get(exc.code().name, 0) + 1
                answer = None
            i += streams
            if answer is None or answer.overall_code != RateLimitResponse.OK:
                bad += 1
            if started >= begin:
                latencies.append(time.perf_counter_ns() - started)

    await asyncio.gather(*(caller(n) for n in range(streams)))
    for channel in channels:
        await channel.close()
    latencies.sort()
    return {
        "calls_per_s": len(latencies) / seconds,
        "p50_ms": percentile(latencies, 0.50) / 1e6,
        "p99_ms": percentile(latencies, 0.99) / 1e6,
        "not_ok": bad,
        "failed": failed,
    }


async def in_process(url: str, streams: int, seconds: float, warmup: float) -> dict[str, Any]:
    """The same decisions made by ``AsyncLimiter.hit`` in this process, no gRPC."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(CONFIG)
        config = load_config(path)
    entries = [[("user", f"u{user}")] for user in range(USERS)]
    (rule,) = config.resolve("bench", [entries[0]])
    assert rule is not None
    assert rule.policy is not None
    policy = rule.policy
    identities = [identity_of("bench", e) for e in entries]
    latencies: list[int] = []
    failed = 0
    begin = time.perf_counter_ns() + int(warmup * 1e9)
    end = begin + int(seconds * 1e9)
    async with AsyncLimiter.from_url(
        url,
        key_prefix="inproc",
        failure_mode="raise",
        timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
    ) as limiter:

        async def caller(n: int) -> None:
            nonlocal failed
            i = n
            while True:
                started = time.perf_counter_ns()
                if started >= end:
                    return
                try:
                    decision = await limiter.hit(policy, identities[i % USERS])
                except StorageError:  # the store's time was over the timeout: counted
                    failed += 1
                else:
                    assert decision.allowed
                i += streams
                if started >= begin:
                    latencies.append(time.perf_counter_ns() - started)

        await asyncio.gather(*(caller(n) for n in range(streams)))
    latencies.sort()
    return {
        "calls_per_s": len(latencies) / seconds,
        "p50_ms": percentile(latencies, 0.50) / 1e6,
        "p99_ms": percentile(latencies, 0.99) / 1e6,
        "failed": failed,
    }


# -- driving -------------------------------------------------------------------------------------


def h2load(port: int, streams: int, seconds: float, warmup: float, body: Path) -> dict[str, Any]:
    conns = connections(streams)
    command = [
        "taskset", "-c", "1", "h2load",
        "-c", str(conns), "-m", str(streams // conns), "-D", f"{round(seconds * 1000)}ms",
        "--warm-up-time", f"{round(warmup * 1000)}ms",
        "-H", "content-type: application/grpc", "-H", "te: trailers", "-d", str(body),
        f"http://127.0.0.1:{port}{RLS_METHOD}",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rate = re.search(r"finished in [\d.]+s, ([\d.]+) req/s", out)
    done = re.search(
        r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed", out
    )
    if rate is None or done is None:
        raise RuntimeError(f"unexpected h2load output:\n{out}")
    return {"calls_per_s": float(rate.group(1)), "failed": int(done.group(3))}


def aio_load(port: int, streams: int, seconds: float, warmup: float) -> dict[str, Any]:
    command = [
        "taskset", "-c", "1", sys.executable, str(HERE), "--aio-client",
        str(port), str(streams), str(seconds), str(warmup),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the aio client failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


class Target:
    """A server process started pinned, waited for, measured, stopped."""

    def __init__(self, name: str, command: list[str], ready: str, count: int = 1) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        seen = 0
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if ready in line:
                seen += 1
                if seen == count:
                    break
        else:
            raise RuntimeError(f"{name} exited before it was ready")

    def cpu(self) -> float:
        return sum(cpu_seconds(pid) for pid in tree(self.proc.pid))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def measure_targets(
    url: str, tmp: Path, body: Path, streams_list: list[int], args: Any, redis_pid: int
) -> list[dict[str, Any]]:
    """Every target under every load and stream count, with the CPU each process used."""
    results: list[dict[str, Any]] = []
    targets = {
        "trivial": ["taskset", "-c", "0", sys.executable, str(HERE), "--trivial-server"],
        "serve/1w": ["taskset", "-c", "0", SCRIPT, "serve", "--workers", "1"],
        "serve/2w": ["taskset", "-c", "0,1", SCRIPT, "serve", "--workers", "2"],
    }
    span = args.seconds + args.warmup
    for name, base in targets.items():
        port = free_port()
        if name == "trivial":
            command, count = [*base, str(port)], 1
        else:
            command = [
                *base, "--config", str(tmp / "bench.yaml"), "--storage", url,
                "--host", "127.0.0.1", "--grpc-port", str(port), "--timeout", str(TIMEOUT),
                "--http-port", str(free_port()), "--key-prefix", name.replace("/", "-"),
            ]  # fmt: skip
            count = 1 if name == "serve/1w" else 2
        target = Target(name, command, "ready", count)
        try:
            for streams in streams_list:
                for load in ("h2load", "aio"):
                    cpu_before, redis_before = target.cpu(), cpu_seconds(redis_pid)
                    machine_before = machine_cpu()
                    if load == "h2load":
                        row = h2load(port, streams, args.seconds, args.warmup, body)
                    else:
                        row = aio_load(port, streams, args.seconds, args.warmup)
                    machine_after = machine_cpu()
                    row["server_cpu_share"] = (target.cpu() - cpu_before) / span
                    row["redis_cpu_share"] = (cpu_seconds(redis_pid) - redis_before) / span
                    if machine_before is not None and machine_after is not None:
                        busy = machine_after[0] - machine_before[0]
                        row["machine_busy_share"] = busy / span
                    results.append({"target": name, "load": load, "streams": streams, **row})
                    print(results[-1], flush=True)
        finally:
            target.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    streams_list = [int(s) for s in args.streams.split(",")]
    if shutil.which("h2load") is None or shutil.which("taskset") is None:
        sys.exit("needs h2load (apt-get install nghttp2-client) and taskset (util-linux)")
    tmp = Path(tempfile.mkdtemp(prefix="rk-service-bench-"))
    (tmp / "bench.yaml").write_text(CONFIG)
    frame = request(7).SerializeToString()
    body = tmp / "body.grpc"
    body.write_bytes(b"\x00" + len(frame).to_bytes(4, "big") + frame)
    results: list[dict[str, Any]] = []
    binary = find_binary()
    with Server(binary) as server:
        subprocess.run(["taskset", "-p", "-c", "1", str(server.proc.pid)], check=True,  # type: ignore[union-attr]
                       capture_output=True)  # fmt: skip
        url = server.url
        os.sched_setaffinity(0, {0})
        for streams in streams_list:
            row = asyncio.run(in_process(url, streams, args.seconds, args.warmup))
            results.append({"target": "in-process", "load": "asyncio", "streams": streams, **row})
            print(results[-1], flush=True)
        os.sched_setaffinity(0, {0, 1})
        results += measure_targets(url, tmp, body, streams_list, args, server.proc.pid)  # type: ignore[union-attr]
    shutil.rmtree(tmp, ignore_errors=True)

    def rate(target: str, load: str, streams: int) -> float:
        (row,) = [
            r for r in results
            if r["target"] == target and r["load"] == load and r["streams"] == streams
        ]  # fmt: skip
        return float(row["calls_per_s"])

    ratios = {}
    for streams in streams_list:
        for load in ("h2load", "aio"):
            ratios[f"{load}/{streams}"] = {
                "serve_1w_over_trivial": rate("serve/1w", load, streams)
                / rate("trivial", load, streams),
                "serve_2w_over_1w": rate("serve/2w", load, streams)
                / rate("serve/1w", load, streams),
                "serve_1w_over_in_process": rate("serve/1w", load, streams)
                / rate("in-process", "asyncio", streams),
            }
    print()
    print(f"{'target':<11} {'load':<8} {'streams':>7} {'calls/s':>9} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'server cpu':>10} {'redis cpu':>9}")  # fmt: skip
    for r in results:
        print(
            f"{r['target']:<11} {r['load']:<8} {r['streams']:>7} {r['calls_per_s']:>9.0f} "
            f"{r.get('p50_ms', float('nan')):>7.2f} {r.get('p99_ms', float('nan')):>7.2f} "
            f"{r.get('server_cpu_share', float('nan')):>10.2f} "
            f"{r.get('redis_cpu_share', float('nan')):>9.2f}"
        )
    print()
    for key, value in ratios.items():
        print(key, {k: round(v, 2) for k, v in value.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": machine_info(None, "grpcio", "protobuf", "uvicorn"),
                "seconds": args.seconds,
                "warmup": args.warmup,
                "server_binary": f"{binary.flavor} {binary.version}",
                "results": results,
                "ratios": ratios,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trivial-server":
        asyncio.run(trivial_server(int(sys.argv[2])))
    elif len(sys.argv) > 1 and sys.argv[1] == "--aio-client":
        port, streams, seconds, warmup = sys.argv[2:6]
        row = asyncio.run(aio_client(int(port), int(streams), float(seconds), float(warmup)))
        print(json.dumps(row))
    else:
        main()
