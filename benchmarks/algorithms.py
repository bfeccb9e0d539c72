"""Per-algorithm Redis memory and server cost: ratekeeper's five algorithms, and ``limits``.

For every server binary found (Redis, and Valkey where available), on a private server on a free
loopback port (never 6379):

* **Memory per identity.** For each algorithm and limit (10, 10,000, 1,000,000 per hour; the
  sliding log only up to its default ``max_log_entries`` of 10,000), fill the state of many
  identities realistically, then sum ``MEMORY USAGE key SAMPLES 0`` over
  ``limiter.keys(policy, identity)`` and average over identities. Also reported: the growth of
  ``INFO memory`` ``used_memory`` per identity, which adds what ``MEMORY USAGE`` leaves out (the
  key's entry in the expires table, hash-table slots, allocator rounding). A two-rate policy gives
  bytes per identity per rate; concurrency is measured with k leases held. ``limits``' keys are
  measured the same way for comparison.
* **Server cost per decision.** ``CONFIG RESETSTAT``, then N decisions round-robin over many
  identities through the public API (``Limiter.hit`` / ``Limiter.acquire`` + ``release``, and
  ``limits``' ``hit``), then ``INFO commandstats``: the server time of the top-level commands
  (here only ``EVALSHA``) divided by the decisions. Commands a script runs inside are listed too;
  their time is already inside ``EVALSHA``'s. Repeated for ``--rounds`` rounds in rotating order;
  the median is reported. Measured as ``script_cost.py`` measures it (``_server_cost.py``).

Fills use a ``ManualClock`` (client time) so that a window can roll without waiting, and send the
exact script calls ``Limiter.hit`` would send, pipelined. Cost runs use the default server clock
(``TIME`` inside the script), as in production.

Run: ``.venv/bin/python benchmarks/algorithms.py [--rounds 5] [--decisions 20000] [--quick]``
Results: tables on stdout and ``benchmarks/results/algorithms.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness as harness
import limits
import limits.storage
import redis
import redis.utils
from _peers import STRATEGIES, Strategy
from _server_cost import Case, Cost, limiter_case, limits_case, measure
from rich.console import Console

from ratekeeper import Limiter, ManualClock, Policy
from ratekeeper._algorithms import ALGORITHMS
from ratekeeper._algorithms.policy import DEFAULT_MAX_LOG_ENTRIES
from ratekeeper._algorithms.scripts import load_script
from ratekeeper._engine.core import Call, Core

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "algorithms.json"

WINDOWED = ("sliding_log", "sliding_window", "fixed_window", "gcra")
LIMITS = (10, 10_000, 1_000_000)
HOUR = 3600.0
PIPELINE_BATCH = 500
ALL_SCRIPTS = sorted({algorithm.script for algorithm in ALGORITHMS.values()})

#: Epoch-aligned to the hour (and day) so fills start mid-window on purpose, not by accident.
BASE_TIME = float(int(time.time()) // 86_400 * 86_400)


# --------------------------------------------------------------------------------------------
# Memory.

#: One identity's fill: (seconds after its start, cost) per call, in time order.
Schedule = list[tuple[float, int]]


def log_schedule(policy: Policy) -> Schedule:
    """The sliding log's worst case: its largest limit in hits of 1, spread over 90% of the
    longest window, so the log holds one entry per admitted unit with distinct timestamps."""
    n = policy.max_limit
    step = 0.9 * policy.rates[-1].period / n
    return [(i * step, 1) for i in range(n)]


def counter_schedule(policy: Policy) -> Schedule:
    """O(1) algorithms: half the smallest limit in one hit, then 3 hits of 1 one longest period
    later (the window has rolled: sliding_window holds a previous and a current count)."""
    first = max(1, min(rate.limit for rate in policy.rates) // 2)
    later = policy.rates[-1].period
    return [(0.0, first), (later, 1), (later + 1, 1), (later + 2, 1)]


def gcra_schedule(policy: Policy) -> Schedule:
    """GCRA: half the burst at once, then 3 hits of 1 a second apart (a TAT in the future, so
    the key lives; an idle GCRA key expires once its TAT has passed)."""
    first = max(1, min(rate.limit for rate in policy.rates) // 2)
    return [(0.0, first), (1.0, 1), (2.0, 1), (3.0, 1)]


def schedule_for(policy: Policy) -> tuple[Schedule, str]:
    if policy.algorithm == "sliding_log":
        return log_schedule(policy), f"{policy.max_limit:,} hits over 0.9 x window"
    if policy.algorithm in ("gcra", "token_bucket"):
        first = gcra_schedule(policy)[0][1]
        return gcra_schedule(policy), f"1 hit of {first:,} + 3 hits"
    first = counter_schedule(policy)[0][1]
    return counter_schedule(policy), f"{first:,}, window rolls, +3 hits"


class Filler:
    """Sends the calls ``Limiter.hit``/``acquire`` would send at chosen client times, pipelined."""

    def __init__(self, server: harness.Server) -> None:
        self.client = named_client(server, FILL_CLIENT)
        self.clock = ManualClock(BASE_TIME)
        self.core = Core(clock=self.clock)
        self.limiter = Limiter.from_url(server.url, clock=self.clock)  # for keys()
        for name in ALL_SCRIPTS:  # loaded up front: the script cache is not in the measurements
            self.client.script_load(load_script(name).source)

    def run(self, calls: Iterable[Callable[[], Call]]) -> tuple[int, int]:
        """Build each call (the callable sets the clock first) and send them in batches.
        Returns (calls, allowed)."""
        pipe = self.client.pipeline(transaction=False)
        sent = allowed = pending = 0
        for make in calls:
            call = make()
            pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
            sent += 1
            pending += 1
            if pending >= PIPELINE_BATCH:
                allowed += sum(int(reply[0]) == 1 for reply in pipe.execute())
                pending = 0
        if pending:
            allowed += sum(int(reply[0]) == 1 for reply in pipe.execute())
        return sent, allowed

    def hits(self, policy: Policy, identities: list[str], schedule: Schedule) -> tuple[int, int]:
        def calls() -> Iterable[Callable[[], Call]]:
            for identity in identities:
                for offset, cost in schedule:

                    def make(o: float = offset, c: int = cost, i: str = identity) -> Call:
                        self.clock.set(BASE_TIME + 1800 + o)  # mid-hour: windows roll mid-fill
                        return self.core.hit_call(policy, i, c)

                    yield make

        return self.run(calls())

    def leases(self, policy: Policy, identities: list[str], k: int) -> tuple[int, int]:
        def calls() -> Iterable[Callable[[], Call]]:
            for identity in identities:
                for j in range(k):

                    def make(o: float = j * 0.001, i: str = identity) -> Call:
                        self.clock.set(BASE_TIME + o)
                        return self.core.acquire_call(policy, i, 1)

                    yield make

        return self.run(calls())

    def close(self) -> None:
        self.limiter.close()
        self.client.close()


#: The name of every connection that fills or reads keys in the memory runs (see ``disconnect``).
FILL_CLIENT = "bench-fill"


def named_client(server: harness.Server, name: str) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=10, client_name=name)


def flushall(client: redis.Redis) -> None:
    """FLUSHALL SYNC: freed before the reply. (redis-py's ``flushall(asynchronous=False)``
    sends a bare FLUSHALL, which Valkey 8 runs lazily by default, freeing memory in the
    background while the next case measures.)"""
    client.execute_command("FLUSHALL", "SYNC")


def used_memory(admin: redis.Redis) -> int:
    return int(admin.info("memory")["used_memory"])


def key_usage(admin: redis.Redis, keys: list[list[str]]) -> dict[str, Any]:
    """MEMORY USAGE SAMPLES 0 summed over each identity's keys; stats over identities."""
    pipe = admin.pipeline(transaction=False)
    for group in keys:
        for key in group:
            pipe.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0")
    replies = iter(pipe.execute())
    per_identity: list[int] = []
    missing = 0
    for group in keys:
        total = 0
        for _ in group:
            reply = next(replies)
            if reply is None:
                missing += 1
            else:
                total += int(reply)
        per_identity.append(total)
    first = keys[0][0]
    encoding = admin.object("encoding", first)
    return {
        "memory_usage_mean": statistics.fmean(per_identity),
        "memory_usage_min": min(per_identity),
        "memory_usage_max": max(per_identity),
        "missing_keys": missing,
        "encoding": encoding.decode() if isinstance(encoding, bytes) else encoding,
        "key_example": first,
        "key_length": len(first),
    }


@dataclass
class MemoryBench:
    """The memory measurements of one server. ``admin`` sends only FLUSHALL and INFO, so
    ``used_memory`` before and after a fill differ by the keyspace alone: the fill connections
    and ``reader`` (MEMORY USAGE, OBJECT) are closed before each reading, which frees their
    query and reply buffers (a server shrinks an idle client's buffers in the background, which
    would otherwise show up as negative deltas)."""

    admin: redis.Redis
    reader: redis.Redis
    fill_clients: list[redis.Redis]

    def disconnect(self) -> None:
        """Close the fill and reader connections, and wait until the server has freed them
        (it notices a closed socket on a later event-loop turn)."""
        for client in [*self.fill_clients, self.reader]:
            client.connection_pool.disconnect()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            names = [c.get("name") for c in self.admin.client_list()]
            if FILL_CLIENT not in names:
                return
            time.sleep(0.005)
        raise RuntimeError("the server kept the fill connections open")

    def measure(
        self,
        identities: list[str],
        fill: Callable[[list[str]], tuple[int, int]],
        keys_of: Callable[[str], list[str]],
    ) -> dict[str, Any]:
        # A first fill on a throwaway identity: the server's one-time allocations (a script's
        # first run grows cached argv arrays) are not charged to the measured identities.
        fill(["warm-up"])
        flushall(self.admin)
        self.disconnect()
        before = used_memory(self.admin)
        sent, allowed = fill(identities)
        self.disconnect()
        after = used_memory(self.admin)
        row = key_usage(self.reader, [keys_of(identity) for identity in identities])
        row.update(
            identities=len(identities),
            calls=sent,
            calls_denied=sent - allowed,
            used_memory_delta_per_identity=(after - before) / len(identities),
        )
        return row


def limits_memory_rows(
    console: Console, bench: MemoryBench, server: harness.Server, many: list[str], few: list[str]
) -> list[dict[str, Any]]:
    """limits' keys for comparison. The moving window is filled with one hit of cost = limit:
    a list entry is the same timestamp string whether or not the timestamps differ, so this is
    the size that `limit` separate hits leave."""
    rows = []
    for peer in STRATEGIES:
        name = peer.name
        storage = limits.storage.RedisStorage(
            f"redis://127.0.0.1:{server.port}", client_name=FILL_CLIENT
        )
        strategy = peer.sync(storage)
        bench.fill_clients.append(storage.get_connection())
        for limit in (10, 10_000):
            identities = few if limit > 100 else many
            item = limits.parse(f"{limit}/hour")
            first = limit if peer.log else max(1, limit // 2)
            costs = (first,) if peer.log else (first, 1, 1, 1)

            def fill(
                ids: list[str], s: Any = strategy, it: Any = item, cs: Any = costs
            ) -> tuple[int, int]:
                calls = allowed = 0
                for identity in ids:
                    for cost in cs:
                        calls += 1
                        allowed += bool(s.hit(it, identity, cost=cost))
                return calls, allowed

            def keys_of(identity: str, it: Any = item, n: str = name) -> list[str]:
                if n == "SlidingWindowCounter":  # the current window's key; see the fill text
                    return [f"LIMITS:{{{it.key_for(identity)}}}"]
                return [f"LIMITS:{it.key_for(identity)}"]

            row = bench.measure(identities, fill, keys_of)
            row.update(
                library="limits",
                algorithm=f"limits {name}",
                policy=f"{limit}/hour",
                rates=1,
                limit=limit,
                fill=(
                    f"1 hit of cost {first:,}"
                    if name == "MovingWindow"
                    else f"{first:,} + 3 hits, 1 window (1 key; 2 once it rolls)"
                    if name == "SlidingWindowCounter"
                    else f"{first:,} + 3 hits"
                ),
            )
            rows.append(row)
            console.print(
                f"  memory limits {name} {limit:,}/hour: {row['memory_usage_mean']:,.0f} B"
            )
    return rows


def memory_section(
    console: Console, server: harness.Server, args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    filler = Filler(server)
    bench = MemoryBench(
        named_client(server, "bench-admin"), named_client(server, FILL_CLIENT), [filler.client]
    )
    many = [f"user-{i:06d}" for i in range(args.identities)]
    few = many[: args.log_identities]
    out: dict[str, list[dict[str, Any]]] = {"single_rate": [], "two_rate": [], "leases": []}

    def ratekeeper_row(policy: Policy, identities: list[str]) -> dict[str, Any]:
        schedule, fill_text = schedule_for(policy)
        row = bench.measure(
            identities,
            lambda ids: filler.hits(policy, ids, schedule),
            lambda identity: list(filler.limiter.keys(policy, identity)),
        )
        row.update(
            library="ratekeeper",
            algorithm=policy.algorithm,
            policy=";".join(str(rate) for rate in policy.rates),
            rates=len(policy.rates),
            limit=policy.max_limit,
            fill=fill_text,
        )
        return row

    # Thrown away: a fresh server's first measurement carries one-time allocations.
    ratekeeper_row(Policy("api", "10/hour", "sliding_log"), few)
    for algorithm in WINDOWED:
        for limit in LIMITS:
            if algorithm == "sliding_log" and limit > DEFAULT_MAX_LOG_ENTRIES:
                continue  # refused by Policy: one sorted-set entry per unit
            policy = Policy("api", f"{limit}/hour", algorithm)
            identities = few if algorithm == "sliding_log" and limit > 100 else many
            row = ratekeeper_row(policy, identities)
            out["single_rate"].append(row)
            console.print(
                f"  memory {algorithm} {limit:,}/hour: {row['memory_usage_mean']:,.0f} B/identity"
            )
    out["single_rate"] += limits_memory_rows(console, bench, server, many, few)

    for algorithm in WINDOWED:
        for spec in ("10/minute", "10/minute;100/hour"):
            out["two_rate"].append(ratekeeper_row(Policy("api", spec, algorithm), many))

    for k in args.leases:
        policy = Policy("jobs", f"{max(args.leases)} per 5 minutes", "concurrency")
        identities = many if k <= 100 else few
        row = bench.measure(
            identities,
            lambda ids, p=policy, k=k: filler.leases(p, ids, k),
            lambda identity, p=policy: list(filler.limiter.keys(p, identity)),
        )
        row.update(
            library="ratekeeper",
            algorithm="concurrency",
            policy=str(policy.rates[0]),
            leases=k,
            fill=f"{k} leases held",
        )
        out["leases"].append(row)
        console.print(f"  memory concurrency {k} leases: {row['memory_usage_mean']:,.0f} B")
    filler.close()
    for client in [*bench.fill_clients, bench.reader, bench.admin]:
        client.close()
    return out


# --------------------------------------------------------------------------------------------
# Server cost per decision.


@dataclass(frozen=True)
class CostCase:
    """A case of ``_server_cost`` and what the results say of it."""

    case: Case
    library: str
    algorithm: str
    spec: str


# Every decision goes to the store (harness.store_only: no local deny cache, so each decision is
# one EVALSHA as with limits; errors raise; a loaded machine trips no timeout or breaker).


def ratekeeper_case(url: str, algorithm: str, spec: str, *, deny_cache: bool = False) -> CostCase:
    name = f"{algorithm} {spec}" + (" (deny cache on)" if deny_cache else "")
    case = limiter_case(url, Policy("api", spec, algorithm), name, deny_cache=deny_cache)
    return CostCase(case, "ratekeeper", algorithm, spec)


def concurrency_case(url: str, spec: str) -> CostCase:
    """acquire then release: one decision, two EVALSHA."""
    name = f"concurrency {spec} (acquire+release)"
    case = limiter_case(url, Policy("jobs", spec, "concurrency"), name)
    return CostCase(case, "ratekeeper", "concurrency", spec)


def peer_case(url: str, peer: Strategy, spec: str) -> CostCase:
    return CostCase(
        limits_case(url, peer, spec, f"{peer.label} {spec}"), "limits", peer.label, spec
    )


def cost_cases(server: harness.Server) -> list[CostCase]:
    cases = []
    for spec in ("100/minute", "10/minute", "100/minute;1000/hour"):
        cases += [ratekeeper_case(server.url, algorithm, spec) for algorithm in WINDOWED]
    cases += [
        ratekeeper_case(server.url, algorithm, "10/minute", deny_cache=True)
        for algorithm in ("sliding_log", "sliding_window")
    ]
    cases.append(concurrency_case(server.url, "100 per 30 seconds"))
    for spec in ("100/minute", "10/minute"):
        cases += [peer_case(server.url, peer, spec) for peer in STRATEGIES]
    return cases


def cost_sample(cost: Cost) -> dict[str, Any]:
    """One run, as the results keep it."""
    commands = {
        name: {
            **fields,
            "usec_per_call": fields["usec"] / fields["calls"] if fields["calls"] else 0.0,
        }
        for name, fields in cost.commands.items()
    }
    return {
        "decisions": cost.decisions,
        "admitted": cost.admitted,
        "top_level_calls": cost.script_calls,
        "server_usec_per_decision": cost.per_decision,
        "server_usec_per_call": cost.per_call,
        "failed_calls": cost.failed_calls,
        "client_usec_per_decision": cost.client_per_decision,
        "server_cpu_usec_per_decision": cost.cpu_per_decision,
        "commands": commands,
    }


def cost_section(
    console: Console, server: harness.Server, args: argparse.Namespace
) -> list[dict[str, Any]]:
    client = server.client()
    identities = [f"user-{i:06d}" for i in range(args.cost_identities)]
    costs = cost_cases(server)
    cases = [cost.case for cost in costs]
    runs: dict[str, list[dict[str, Any]]] = {case.name: [] for case in cases}
    for r, order in harness.rotations(cases, args.rounds):
        for case in order:
            runs[case.name].append(cost_sample(measure(client, case, args.decisions, identities)))
        shown = ", ".join(
            f"{c.name} {runs[c.name][-1]['server_usec_per_decision']:.1f}" for c in cases[:4]
        )
        console.print(f"  cost round {r + 1}/{args.rounds} (server us/decision): {shown}, ...")
    out = []
    for cost in costs:
        samples = runs[cost.case.name]
        per_decision = [s["server_usec_per_decision"] for s in samples]
        nested: dict[str, dict[str, float]] = {}
        total_decisions = sum(s["decisions"] for s in samples)
        for name in sorted({n for s in samples for n in s["commands"]}):
            calls = sum(s["commands"].get(name, {}).get("calls", 0) for s in samples)
            usec = sum(s["commands"].get(name, {}).get("usec", 0) for s in samples)
            nested[name] = {
                "calls_per_decision": calls / total_decisions,
                "usec_per_call": usec / calls if calls else 0.0,
            }
        out.append(
            {
                "case": cost.case.name,
                "library": cost.library,
                "algorithm": cost.algorithm,
                "policy": cost.spec,
                "decisions_per_round": args.decisions,
                "identities": args.cost_identities,
                "rounds": args.rounds,
                "calls_per_decision": statistics.fmean(
                    s["top_level_calls"] / s["decisions"] for s in samples
                ),
                "server_usec_per_decision_median": statistics.median(per_decision),
                "server_usec_per_decision_min": min(per_decision),
                "server_usec_per_decision_max": max(per_decision),
                "server_usec_per_decision_per_round": per_decision,
                "server_usec_per_call_median": statistics.median(
                    s["server_usec_per_call"] or 0.0 for s in samples
                ),
                "admitted_fraction": statistics.fmean(
                    s["admitted"] / s["decisions"] for s in samples
                ),
                "client_usec_per_decision_median": statistics.median(
                    s["client_usec_per_decision"] for s in samples
                ),
                "server_cpu_usec_per_decision_median": statistics.median(
                    s["server_cpu_usec_per_decision"] for s in samples
                ),
                "failed_calls": sum(s["failed_calls"] for s in samples),
                "commands": nested,
            }
        )
    for case in cases:
        case.close()
    client.close()
    return out


# --------------------------------------------------------------------------------------------
# Reporting.


def server_info(server: harness.Server) -> dict[str, Any]:
    client = server.client()
    return {
        **harness.server_facts(server),
        "mem_allocator": str(client.info("memory").get("mem_allocator", "")) or None,
        "zset_max_listpack_entries": client.config_get("zset-max-*-entries"),
        "hash_max_listpack_entries": client.config_get("hash-max-*-entries"),
        "list_max_listpack_size": client.config_get("list-max-*-size"),
    }


def print_memory(console: Console, title: str, memory: dict[str, list[dict[str, Any]]]) -> None:
    rows = [
        [
            row["algorithm"],
            row["policy"],
            row["fill"],
            str(row["identities"]),
            f"{row['memory_usage_mean']:,.0f}",
            f"{row['memory_usage_min']:,}-{row['memory_usage_max']:,}",
            f"{row['used_memory_delta_per_identity']:,.0f}",
            row["encoding"],
            f"{row['memory_usage_mean'] / row['limit']:.1f}"
            if row["algorithm"] in ("sliding_log", "limits MovingWindow")
            else "-",
        ]
        for row in memory["single_rate"]
    ]
    harness.print_table(
        console,
        f"{title}: memory per identity (bytes)",
        ("algorithm", "policy", "fill", "ids", "MEMORY USAGE\nmean", "min-max",
         "used_memory\ndelta", "encoding", "B/unit of limit"),
        rows,
    )  # fmt: skip
    pairs = zip(memory["two_rate"][::2], memory["two_rate"][1::2], strict=True)
    rows = [
        [
            one["algorithm"],
            f"{one['memory_usage_mean']:,.0f}",
            f"{two['memory_usage_mean']:,.0f}",
            f"{two['memory_usage_mean'] / 2:,.0f}",
            f"{two['memory_usage_mean'] - one['memory_usage_mean']:,.0f}",
            f"{one['used_memory_delta_per_identity']:,.0f} / "
            f"{two['used_memory_delta_per_identity']:,.0f}",
        ]
        for one, two in pairs
    ]
    harness.print_table(
        console,
        f"{title}: two-rate policy, bytes per identity per rate",
        ("algorithm", "1 rate: 10/minute", "2 rates: 10/minute;100/hour", "per rate (2-rate / 2)",
         "2nd rate adds", "used_memory delta (1 / 2 rates)"),
        rows,
    )  # fmt: skip
    rows = [
        [
            str(row["leases"]),
            str(row["identities"]),
            f"{row['memory_usage_mean']:,.0f}",
            f"{row['memory_usage_mean'] / row['leases']:,.1f}",
            f"{row['used_memory_delta_per_identity']:,.0f}",
            row["encoding"],
        ]
        for row in memory["leases"]
    ]
    harness.print_table(
        console,
        f"{title}: concurrency, memory per identity with k leases held",
        ("leases held", "ids", "MEMORY USAGE mean", "per lease", "used_memory delta", "encoding"),
        rows,
    )


def print_cost(console: Console, title: str, cost: list[dict[str, Any]], args: Any) -> None:
    rows = [
        [
            row["case"],
            f"{row['admitted_fraction']:.0%}",
            f"{row['server_usec_per_decision_median']:.2f}",
            f"{row['server_usec_per_decision_min']:.1f}-{row['server_usec_per_decision_max']:.1f}",
            f"{row['calls_per_decision']:.2f}",
            f"{row['server_usec_per_call_median']:.2f}",
            f"{row['server_cpu_usec_per_decision_median']:.0f}",
            f"{row['client_usec_per_decision_median']:.0f}",
        ]
        for row in cost
    ]
    harness.print_table(
        console,
        f"{title}: server time per decision (INFO commandstats), {args.decisions:,} decisions "
        f"over {args.cost_identities:,} identities, median of {args.rounds} rounds",
        ("case", "admitted", "server us/decision\nmedian", "min-max", "EVALSHA per\ndecision",
         "us per\nEVALSHA", "server CPU\nus/decision", "client wall\nus/decision"),
        rows,
    )  # fmt: skip
    rows = [
        [
            row["case"],
            ", ".join(
                f"{name} {c['calls_per_decision']:.2g}x{c['usec_per_call']:.2f}"
                for name, c in row["commands"].items()
            ),
        ]
        for row in cost
    ]
    harness.print_table(
        console,
        f"{title}: commands per decision x us each (all rounds); the ones inside a script are "
        "part of its EVALSHA time",
        ("case", "commands"),
        rows,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--identities", type=int, default=200, help="identities per memory case")
    parser.add_argument(
        "--log-identities",
        type=int,
        default=20,
        help="identities for the big sliding-log and lease cases (10,000 hits each)",
    )
    parser.add_argument("--leases", type=int, nargs="+", default=[1, 10, 100, 1000])
    parser.add_argument("--decisions", type=int, default=20_000, help="decisions per cost run")
    parser.add_argument("--cost-identities", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=5, help="cost rounds (median reported)")
    parser.add_argument("--server", choices=("all", "redis", "valkey"), default="all")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small counts")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.identities, args.log_identities, args.decisions, args.rounds = 20, 2, 2_000, 1
        args.cost_identities = 100
    if min(args.identities, args.log_identities, args.decisions, args.rounds) < 1:
        parser.error("counts must be positive")
    args.log_identities = min(args.log_identities, args.identities)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = harness.console()
    binaries = [b for b in harness.find_binaries() if args.server in ("all", b.flavor)]
    machine = harness.machine_info(None, "limits")
    console.print(
        f"{machine['cpu_count']} CPUs ({machine['cpu_model']}), Python {machine['python']}, "
        f"ratekeeper {machine['ratekeeper']}, redis-py {machine['redis_py']} "
        f"(hiredis {machine['hiredis']}), limits {machine['limits']}"
    )
    started = time.perf_counter()
    load_before = os.getloadavg()
    servers = []
    for binary in binaries:
        title = f"{binary.flavor} {binary.version}"
        console.print(f"[bold]{title}[/bold] ({binary.path})")
        t0 = time.perf_counter()
        with harness.Server(binary) as server:
            info = server_info(server)
            memory = memory_section(console, server, args)
            t1 = time.perf_counter()
            cost = cost_section(console, server, args)
        t2 = time.perf_counter()
        print_memory(console, title, memory)
        print_cost(console, title, cost, args)
        servers.append(
            {
                "server": info,
                "memory": memory,
                "cost": cost,
                "seconds": {"memory": t1 - t0, "cost": t2 - t1},
            }
        )
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    console.print(
        f"total {elapsed:.0f} s; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after (other processes on this machine add noise to the cost runs)"
    )
    results = {
        "benchmark": "algorithms",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "seconds": elapsed,
        "load_average_1min": {"before": load_before[0], "after": load_after[0]},
        "servers": servers,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
