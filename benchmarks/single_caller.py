"""Single-caller throughput and latency: ratekeeper vs limits vs a raw EVALSHA ceiling.

One synchronous caller, one private Redis/Valkey server on loopback, K identities hit in turn
under a generous limit (1000/minute: nearly every hit is admitted). Each round runs every case
for the same duration, one after the other; the order rotates between rounds and every ratio is
paired within a round, so drift (thermal, noisy neighbours) hits all cases alike.

Cases:

* ``ratekeeper``   ``Limiter.from_url(url).hit(policy, identity)``, sliding_log algorithm;
* ``limits``       ``limits`` ``MovingWindowRateLimiter`` on ``limits.storage.RedisStorage``;
* ``raw_evalsha``  redis-py ``client.evalsha`` of ratekeeper's own ``sliding_log.lua`` with the
  KEYS/ARGV ratekeeper sends, precomputed per identity: the client ceiling for that script.

``--denied`` adds the same three cases for a single identity whose limit (10/minute) is spent,
so nearly every hit is denied.

Run: ``.venv/bin/python benchmarks/single_caller.py [--seconds N] [--rounds R] [--identities K]``
Results: a table on stdout and ``benchmarks/results/single_caller.json``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import limits
import limits.storage
import limits.strategies
import redis
import redis.utils
from _measure import machine_cpu, machine_info, max_load, percentile, server_cpu
from _server import Server, ServerBinary, find_binary
from rich.console import Console
from rich.table import Table

import ratekeeper
from ratekeeper import Limiter, Policy
from ratekeeper._core import Core
from ratekeeper._scripts import load_script

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "single_caller.json"

ADMIT_RATE = "1000/minute"
DENY_RATE = "10/minute"
POLICY_NAME = "bench"

# Commands the harness itself sends between cases; left out of the server-side stats.
HARNESS_COMMANDS = frozenset({"info", "config", "flushall", "ping", "script", "client", "hello"})


@dataclass
class Sample:
    """One case run once: its call count, wall time, per-call latencies and cost counters."""

    calls: int
    elapsed_ns: int
    latencies_ns: list[int]
    admitted: int
    client_cpu_ns: int
    server_cpu_s: float = 0.0
    commandstats: dict[str, dict[str, float]] = field(default_factory=dict)
    machine_busy_s: float | None = None  # all CPUs, from /proc/stat (Linux only)
    steal_s: float | None = None

    @property
    def foreign_cpu_s(self) -> float | None:
        """CPU time that neither the caller nor the server used: other load on the machine."""
        if self.machine_busy_s is None:
            return None
        return max(0.0, self.machine_busy_s - self.client_cpu_ns / 1e9 - self.server_cpu_s)

    @property
    def rate(self) -> float:
        return self.calls / (self.elapsed_ns / 1e9)


# A runner takes a duration in ns and returns (calls, elapsed_ns, latencies_ns, admitted).
Runner = Callable[[int], tuple[int, int, list[int], int]]
Factory = Callable[[str, list[str], str], tuple[Runner, Callable[[], None]]]


def ratekeeper_runner(
    url: str, identities: list[str], rate: str
) -> tuple[Runner, Callable[[], None]]:
    # Every decision must come from the store: no failing open on a slow call of a loaded
    # machine (the default 20 ms timeout), no local answers from the deny cache.
    limiter = Limiter.from_url(
        url, failure_mode="raise", timeout=2, connect_timeout=2, deny_cache=0
    )
    policy = Policy(POLICY_NAME, rate, algorithm="sliding_log")
    hit = limiter.hit

    def run(duration_ns: int) -> tuple[int, int, list[int], int]:
        clock = time.perf_counter_ns
        lat: list[int] = []
        append = lat.append
        k = len(identities)
        i = admitted = 0
        start = clock()
        deadline = start + duration_ns
        while True:
            identity = identities[i % k]
            t0 = clock()
            decision = hit(policy, identity)
            t1 = clock()
            append(t1 - t0)
            admitted += decision.allowed
            i += 1
            if t1 >= deadline:
                return i, t1 - start, lat, admitted

    return run, limiter.close


def limits_runner(url: str, identities: list[str], rate: str) -> tuple[Runner, Callable[[], None]]:
    storage = limits.storage.RedisStorage(url)
    limiter = limits.strategies.MovingWindowRateLimiter(storage)
    item = limits.parse(rate)
    hit = limiter.hit

    def run(duration_ns: int) -> tuple[int, int, list[int], int]:
        clock = time.perf_counter_ns
        lat: list[int] = []
        append = lat.append
        k = len(identities)
        i = admitted = 0
        start = clock()
        deadline = start + duration_ns
        while True:
            identity = identities[i % k]
            t0 = clock()
            allowed = hit(item, identity)
            t1 = clock()
            append(t1 - t0)
            admitted += allowed
            i += 1
            if t1 >= deadline:
                return i, t1 - start, lat, admitted

    return run, storage.storage.close


def raw_runner(url: str, identities: list[str], rate: str) -> tuple[Runner, Callable[[], None]]:
    client = redis.Redis.from_url(url)
    script = load_script("sliding_log")
    sha = client.script_load(script.source)
    assert sha == script.sha, (sha, script.sha)
    policy = Policy(POLICY_NAME, rate, algorithm="sliding_log")
    core = Core()
    # KEYS and ARGV exactly as Limiter.hit builds them, split around ARGV[4], the token: it must
    # stay unique per call (a reused token would overwrite one log member instead of adding one,
    # and the server would run a smaller workload than ratekeeper's).
    calls = []
    for identity in identities:
        call = core.hit(policy, identity, 1)
        assert isinstance(call.args[3], str), "ARGV[4] should be the token"
        calls.append((call.keys, call.args[:3], call.args[4:]))
    nonce = os.urandom(6).hex()
    serial = itertools.count()
    evalsha = client.evalsha

    def run(duration_ns: int) -> tuple[int, int, list[int], int]:
        clock = time.perf_counter_ns
        lat: list[int] = []
        append = lat.append
        k = len(calls)
        i = admitted = 0
        start = clock()
        deadline = start + duration_ns
        while True:
            keys, head, tail = calls[i % k]
            token = f"{nonce}{next(serial):x}"
            t0 = clock()
            reply = evalsha(sha, 1, *keys, *head, token, *tail)
            t1 = clock()
            append(t1 - t0)
            admitted += reply[0]
            i += 1
            if t1 >= deadline:
                return i, t1 - start, lat, admitted

    return run, client.close


FACTORIES: dict[str, Factory] = {
    "ratekeeper": ratekeeper_runner,
    "limits": limits_runner,
    "raw_evalsha": raw_runner,
}


def run_case(admin: redis.Redis, runner: Runner, duration_ns: int) -> Sample:
    """Run one case from an empty store with fresh server stats."""
    admin.flushall()
    gc.collect()
    admin.config_resetstat()
    cpu0 = server_cpu(admin)
    machine0 = machine_cpu()
    proc0 = time.process_time_ns()
    calls, elapsed, lat, admitted = runner(duration_ns)
    proc1 = time.process_time_ns()
    machine1 = machine_cpu()
    cpu1 = server_cpu(admin)
    stats = {
        name.removeprefix("cmdstat_"): {
            key: float(value)
            for key, value in fields.items()
            if key in ("calls", "usec", "usec_per_call", "failed_calls", "rejected_calls")
        }
        for name, fields in admin.info("commandstats").items()
        if name.removeprefix("cmdstat_").split("|")[0] not in HARNESS_COMMANDS
    }
    sample = Sample(calls, elapsed, lat, admitted, proc1 - proc0, cpu1 - cpu0, stats)
    if machine0 is not None and machine1 is not None:
        sample.machine_busy_s = machine1[0] - machine0[0]
        sample.steal_s = machine1[1] - machine0[1]
    return sample


def summarize(samples: list[Sample]) -> dict[str, Any]:
    rates = [s.rate for s in samples]
    pooled = sorted(itertools.chain.from_iterable(s.latencies_ns for s in samples))
    calls = sum(s.calls for s in samples)
    evalsha = [s.commandstats.get("evalsha", {}) for s in samples]
    evalsha_calls = sum(e.get("calls", 0.0) for e in evalsha)
    evalsha_usec = sum(e.get("usec", 0.0) for e in evalsha)
    merged: dict[str, dict[str, float]] = {}
    for s in samples:
        for name, fields in s.commandstats.items():
            into = merged.setdefault(name, {"calls": 0.0, "usec": 0.0})
            into["calls"] += fields.get("calls", 0.0)
            into["usec"] += fields.get("usec", 0.0)
    for fields in merged.values():
        fields["usec_per_call"] = fields["usec"] / fields["calls"] if fields["calls"] else 0.0
    return {
        "decisions_per_s": {
            "median": statistics.median(rates),
            "min": min(rates),
            "max": max(rates),
            "per_round": rates,
        },
        "latency_us": {
            "p50": percentile(pooled, 0.50) / 1000,
            "p90": percentile(pooled, 0.90) / 1000,
            "p99": percentile(pooled, 0.99) / 1000,
            "p999": percentile(pooled, 0.999) / 1000,
            "mean": statistics.fmean(pooled) / 1000,
            "max": pooled[-1] / 1000,
            "samples": len(pooled),
        },
        "calls": calls,
        "admitted_fraction": sum(s.admitted for s in samples) / calls,
        "client_cpu_us_per_call": sum(s.client_cpu_ns for s in samples) / calls / 1000,
        "server_cpu_us_per_call": sum(s.server_cpu_s for s in samples) / calls * 1e6,
        "server_evalsha_us_per_call": evalsha_usec / evalsha_calls if evalsha_calls else None,
        "server_evalsha_calls_per_decision": evalsha_calls / calls,
        "server_commandstats": merged,
        "server_evalsha_us_per_call_per_round": [e.get("usec_per_call") for e in evalsha],
        # Other load on the machine while the case ran, in CPUs (1.0 = one core kept busy).
        "foreign_load_cpus_per_round": [
            None if s.foreign_cpu_s is None else s.foreign_cpu_s / (s.elapsed_ns / 1e9)
            for s in samples
        ],
        "steal_cpus_per_round": [
            None if s.steal_s is None else s.steal_s / (s.elapsed_ns / 1e9) for s in samples
        ],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per case per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--identities", type=int, default=10_000)
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds per case, discarded")
    parser.add_argument(
        "--denied", action="store_true", help="also run a one-identity, always-denied variant"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1 or args.identities < 1 or args.warmup < 0:
        parser.error("--seconds, --rounds and --identities must be positive")
    return args


def variants(args: argparse.Namespace) -> list[tuple[str, list[str], str]]:
    """(case-name suffix, identities, rate) for each workload."""
    out = [("", [f"user:{i}" for i in range(args.identities)], ADMIT_RATE)]
    if args.denied:
        out.append(("/denied", ["user:denied"], DENY_RATE))
    return out


def run_all(
    console: Console, args: argparse.Namespace, binary: ServerBinary
) -> tuple[dict[str, list[Sample]], dict[str, Any]]:
    """Start the server, run every case in rotating order each round, stop the server."""
    with Server(binary) as server:
        admin = server.client()
        info = admin.info("server")
        server_info = {
            "flavor": binary.flavor,
            "path": binary.path,
            "version": binary.version,
            "redis_version": str(info.get("redis_version")),
            "valkey_version": str(info["valkey_version"]) if "valkey_version" in info else None,
        }
        cases: dict[str, Runner] = {}
        closers: list[Callable[[], None]] = []
        for suffix, identities, rate in variants(args):
            for name, factory in FACTORIES.items():
                runner, close = factory(server.url, identities, rate)
                cases[name + suffix] = runner
                closers.append(close)
        names = list(cases)
        expected = len(names) * (args.rounds * args.seconds + args.warmup)
        console.print(
            f"{len(names)} cases x {args.rounds} rounds x {args.seconds:g} s, "
            f"{args.identities} identities, about {expected:.0f} s"
        )
        for name in names:  # warm up: connections, script caches, code paths
            run_case(admin, cases[name], int(args.warmup * 1e9))

        samples: dict[str, list[Sample]] = {name: [] for name in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                sample = run_case(admin, cases[name], int(args.seconds * 1e9))
                samples[name].append(sample)
                foreign = sample.foreign_cpu_s
                load = "" if foreign is None else f"  other load {foreign / args.seconds:.2f} CPU"
                console.print(
                    f"round {r + 1}/{args.rounds}  {name:20s} {sample.rate:9,.0f}/s{load}"
                )
        for close in closers:
            close()
        admin.close()
    return samples, server_info


def paired_ratios(
    samples: dict[str, list[Sample]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """ratekeeper's decisions/s over each other case's, round by round, and their median."""
    ratios: dict[str, dict[str, Any]] = {}
    for suffix, _, _ in variants(args):
        ours = samples["ratekeeper" + suffix]
        for other in ("limits", "raw_evalsha"):
            theirs = samples[other + suffix]
            per_round = [a.rate / b.rate for a, b in zip(ours, theirs, strict=True)]
            ratios[f"ratekeeper{suffix} / {other}{suffix}"] = {
                "median": statistics.median(per_round),
                "min": min(per_round),
                "max": max(per_round),
                "per_round": per_round,
            }
    return ratios


def print_tables(
    console: Console,
    args: argparse.Namespace,
    summary: dict[str, dict[str, Any]],
    ratios: dict[str, dict[str, Any]],
) -> None:
    table = Table(title=f"single sync caller, {args.rounds} rounds x {args.seconds:g} s per case")
    table.add_column("case", no_wrap=True)
    for header in (
        "decisions/s\nmedian",
        "min-max",
        "p50\nus",
        "p99\nus",
        "server\nEVALSHA us",
        "server\nCPU us",
        "client\nCPU us",
        "admitted",
        "other load\nCPU (max)",
    ):
        table.add_column(header, justify="right")
    for name, s in summary.items():
        d = s["decisions_per_s"]
        ev = s["server_evalsha_us_per_call"]
        table.add_row(
            name,
            f"{d['median']:,.0f}",
            f"{d['min']:,.0f}-{d['max']:,.0f}",
            f"{s['latency_us']['p50']:.1f}",
            f"{s['latency_us']['p99']:.1f}",
            "-" if ev is None else f"{ev:.2f}",
            f"{s['server_cpu_us_per_call']:.1f}",
            f"{s['client_cpu_us_per_call']:.1f}",
            f"{s['admitted_fraction']:.1%}",
            max_load(s["foreign_load_cpus_per_round"]),
        )
    console.print(table)
    worst = max(v or 0.0 for s in summary.values() for v in s["foreign_load_cpus_per_round"])
    if worst > 0.2:
        console.print(
            f"[bold yellow]warning:[/] other processes used up to {worst:.2f} CPU during a case: "
            "absolute numbers are unreliable; prefer the paired ratios, or rerun on a quiet machine"
        )

    ratio_table = Table(title="decisions/s ratios, paired within each round")
    ratio_table.add_column("ratio", no_wrap=True)
    ratio_table.add_column("median", justify="right")
    ratio_table.add_column("min-max", justify="right")
    ratio_table.add_column("per round", justify="right")
    for label, ratio in ratios.items():
        ratio_table.add_row(
            label,
            f"{ratio['median']:.3f}",
            f"{ratio['min']:.3f}-{ratio['max']:.3f}",
            " ".join(f"{v:.3f}" for v in ratio["per_round"]),
        )
    console.print(ratio_table)

    commands = Table(title="server commandstats: calls per decision x us per call (all rounds)")
    commands.add_column("case", no_wrap=True)
    commands.add_column("commands")
    for name, s in summary.items():
        parts = [
            f"{cmd} {fields['calls'] / s['calls']:.2f}x{fields['usec_per_call']:.2f}"
            for cmd, fields in sorted(s["server_commandstats"].items())
        ]
        commands.add_row(name, ", ".join(parts))
    console.print(commands)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=max(Console().width, 120))
    binary = find_binary()
    console.print(f"server: {binary.flavor} {binary.version} ({binary.path})")
    console.print(
        f"redis-py {version('redis')} (hiredis: {redis.utils.HIREDIS_AVAILABLE}), "
        f"limits {version('limits')}, ratekeeper {ratekeeper.__version__}, "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    samples, server_info = run_all(console, args, binary)
    summary = {name: summarize(values) for name, values in samples.items()}
    ratios = paired_ratios(samples, args)
    print_tables(console, args, summary, ratios)

    results = {
        "benchmark": "single_caller",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(server_info, "limits"),
        "config": {
            "seconds_per_case": args.seconds,
            "rounds": args.rounds,
            "identities": args.identities,
            "warmup_seconds": args.warmup,
            "admit_rate": ADMIT_RATE,
            "deny_rate": DENY_RATE if args.denied else None,
            "policy_name": POLICY_NAME,
            "algorithm": "sliding_log",
            "cases": list(samples),
        },
        "cases": summary,
        "ratios": ratios,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
