"""Server time per decision of each ratekeeper script, next to its nearest ``limits`` peer.

On a private server on a free loopback port (never 6379), every case runs once per round on an
empty store (``_server_cost.measure``): ``FLUSHALL``, a warm-up call (which loads the script),
``CONFIG RESETSTAT``, ``--hits`` decisions round-robin over ``--identities`` identities, then
``INFO commandstats`` and ``INFO cpu``. The case order rotates between rounds. Reported per
case, as the median over ``--rounds`` rounds:

* ``us/call``: ``usec`` over ``calls`` of the commands a client sends (``EVALSHA``: one per
  hit for both libraries; ratekeeper's concurrency sends an acquire and a release);
* ``us/dec``: the same ``usec`` divided by the decisions, the figure that is compared;
* ``cpu/dec``: the server main thread's CPU time per decision (``INFO cpu``), which adds reading
  and answering the requests but not the time the server waited for a core;
* ``vs peer`` and ``vs base``: the median over rounds of the per-round ratio of ``us/dec`` to
  the peer's (or the baseline's) in the same round: on a shared machine only ratios taken
  close together in time mean much;
* the commands each script ran inside, per decision (their time is inside ``EVALSHA``'s).

Cases, all under ``--spec`` (default ``100/minute``, so with the default 2 hits per identity all
are admitted): ratekeeper's ``Limiter.hit`` for each algorithm (``failure_mode="raise"``,
``deny_cache=0``, the default key prefix, the server's clock), ``acquire`` + ``release`` for
``concurrency``, and ``limits``' ``hit`` for MovingWindow, FixedWindow and
SlidingWindowCounter. Peers: sliding_log - MovingWindow, sliding_window - SlidingWindowCounter,
fixed_window and gcra - FixedWindow (the cheapest ``limits`` hit, a reference point);
concurrency has none.

By default the calls are built as those methods build them (ratekeeper's core; ``limits``' keys
and ARGV, as ``limits/storage/redis.py`` makes them) and sent pipelined, 200 at a time: the
server runs the same commands, only the client is faster, and a run takes about 30 s.
``--through-api`` calls the methods themselves, one at a time (several times slower).
``--baseline DIR`` adds each ratekeeper algorithm once more with the scripts in ``DIR`` (a copy
of ``src/ratekeeper/_algorithms/lua`` from before a change; same keys and ARGV), for
before/after ratios in one run.

Run: ``.venv/bin/python benchmarks/script_cost.py [--hits 20000] [--identities 10000]
[--rounds 5] [--spec 100/minute] [--flavor redis|valkey] [--baseline DIR] [--through-api]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from hashlib import sha1
from pathlib import Path
from typing import Any

import limits
import limits.storage
import redis
from _harness import Server, console, find_binary, print_table, rotations, store_only
from _peers import FIXED_WINDOW, MOVING_WINDOW, PEERS, Strategy
from _server_cost import Case, Cost, limiter_case, limits_case, measure
from rich.console import Console

from ratekeeper import Decision, Limiter, Policy
from ratekeeper._algorithms.scripts import Script, load_script
from ratekeeper._engine.core import Call, Core

ALGORITHMS = ("sliding_log", "sliding_window", "fixed_window", "gcra", "concurrency")
#: Calls per pipeline in the default mode.
BATCH = 200

#: Queues one decision's commands on a pipeline and returns, per command queued, how to tell
#: from its reply whether the decision admitted (None: the reply does not say).
Adder = Callable[[Any, str], list[Callable[[Any], bool] | None]]


def pipelined(client: Any, add: Adder) -> Callable[[int, list[str]], int]:
    """A runner that sends what ``add`` queues, BATCH decisions per pipeline."""

    def run(n: int, identities: list[str]) -> int:
        k, admitted = len(identities), 0
        for low in range(0, n, BATCH):
            pipe = client.pipeline(transaction=False)
            judges: list[Callable[[Any], bool] | None] = []
            for i in range(low, min(low + BATCH, n)):
                judges += add(pipe, identities[i % k])
            replies = pipe.execute()
            admitted += sum(judge(r) for judge, r in zip(judges, replies, strict=True) if judge)
        return admitted

    return run


def baseline_scripts(folder: Path) -> dict[str, Script]:
    """The scripts in ``folder`` as ``load_script`` builds them (the prelude in front)."""
    prelude = (folder / "_prelude.lua").read_bytes()
    out = {}
    for name in ALGORITHMS:
        source = prelude + (folder / f"{name}.lua").read_bytes()
        out[name] = Script(name, source, sha1(source).hexdigest())
    return out


def ratekeeper_case(
    url: str, algorithm: str, spec: str, *, api: bool, script: Script | None = None
) -> Case:
    """``Limiter.hit`` (``acquire`` + ``release`` for concurrency), optionally with the calls'
    script replaced by ``script``."""
    policy = Policy("api", spec, algorithm)
    name = algorithm if script is None else f"{algorithm} (baseline)"
    if api and script is None:
        return limiter_case(url, policy, name)
    limiter = Limiter.from_url(url, **store_only())
    core = limiter._core

    def calls(identity: str) -> list[Call]:
        """The calls of one decision: a hit, or an acquire and its release."""
        if algorithm == "concurrency":
            acquired = core.acquire_call(policy, identity, 1)
            made = [acquired, core.release_call(acquired, identity)]
        else:
            made = [core.hit_call(policy, identity, 1)]
        return made if script is None else [replace(call, script=script) for call in made]

    if api:  # the same calls through the limiter's own path, with the baseline script

        def run(n: int, identities: list[str]) -> int:
            drive, path = limiter._drive, limiter._path
            k, admitted = len(identities), 0

            def decide(call: Call) -> Decision:
                return drive(path.steps_of(call))  # type: ignore[no-any-return]

            for i in range(n):
                first, *rest = calls(identities[i % k])
                admitted += decide(first).allowed
                for call in rest:
                    decide(call)
            return admitted

        return Case(name, run, limiter.close)

    client = redis.Redis.from_url(url)
    client.script_load((script or load_script(algorithm)).source)

    def add(pipe: Any, identity: str) -> list[Callable[[Any], bool] | None]:
        made = calls(identity)
        for call in made:
            pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
        first = made[0]
        return [lambda reply: Core.decision_of(first, reply).allowed] + [None] * (len(made) - 1)

    def close() -> None:
        client.close()
        limiter.close()

    return Case(name, pipelined(client, add), close)


def limits_peer_case(url: str, strategy: Strategy, spec: str, *, api: bool) -> Case:
    """``limits``' ``hit`` with ``strategy``."""
    if api:
        return limits_case(url, strategy, spec, strategy.label)
    storage = limits.storage.RedisStorage(url)
    item = limits.parse(spec)
    expiry = item.get_expiry()

    def add(pipe: Any, identity: str) -> list[Callable[[Any], bool] | None]:
        # The script calls of limits' RedisStorage.acquire_entry, incr and
        # acquire_sliding_window_entry, with the keys and ARGV they build.
        key = item.key_for(identity)
        if strategy is MOVING_WINDOW:
            argv = [time.time(), item.amount, expiry, 1]
            storage.lua_acquire_moving_window([storage.prefixed_key(key)], argv, client=pipe)
            return [bool]
        if strategy is FIXED_WINDOW:
            storage.lua_incr_expire([storage.prefixed_key(key)], [expiry, 1], client=pipe)
            return [lambda reply: int(reply) <= item.amount]
        keys = [
            storage.prefixed_key(storage._previous_window_key(key)),
            storage.prefixed_key(storage._current_window_key(key)),
        ]
        storage.lua_acquire_sliding_window(keys, [item.amount, expiry, 1], client=pipe)
        return [bool]

    connection = storage.get_connection()
    return Case(strategy.label, pipelined(connection, add), connection.close)


def build_cases(server: Server, args: argparse.Namespace) -> list[Case]:
    chosen = args.only.split(",") if args.only else list(ALGORITHMS)
    api = args.through_api
    cases = [ratekeeper_case(server.url, a, args.spec, api=api) for a in chosen]
    if args.baseline:
        old = baseline_scripts(args.baseline)
        cases += [ratekeeper_case(server.url, a, args.spec, api=api, script=old[a]) for a in chosen]
    peers = {PEERS[a] for a in chosen if a in PEERS}
    for peer in sorted(peers, key=lambda strategy: strategy.label):
        cases.append(limits_peer_case(server.url, peer, args.spec, api=api))
    return cases


def report(console: Console, cases: list[Case], samples: dict[str, list[Cost]]) -> None:
    by_name = {case.name: case for case in cases}

    def median(case: Case, metric: Callable[[Cost], float]) -> float:
        return statistics.median(metric(sample) for sample in samples[case.name])

    def ratio(a: Case, b: Case) -> str:
        pairs = zip(samples[a.name], samples[b.name], strict=True)
        return f"{statistics.median(x.per_decision / y.per_decision for x, y in pairs):.2f}"

    rows = []
    for case in cases:
        algorithm = case.name.split()[0]
        peer = by_name.get(PEERS[algorithm].label) if algorithm in PEERS else None
        base = by_name.get(f"{algorithm} (baseline)")
        rows.append(
            [
                case.name,
                f"{median(case, lambda c: c.per_call or 0.0):.2f}",
                f"{median(case, lambda c: c.per_decision):.2f}",
                f"{median(case, lambda c: c.cpu_per_decision):.2f}",
                f"{median(case, lambda c: c.admitted / c.decisions):.2f}",
                f"{ratio(case, peer)} x {peer.name.split()[1]}" if peer else "-",
                ratio(case, base) if base is not None and base is not case else "-",
            ]
        )
    headers = ("case", "us/call", "us/dec", "cpu/dec", "admit", "vs peer", "vs base")
    print_table(console, "server time per decision, medians over rounds", headers, rows)
    rows = [
        [case.name, ", ".join(f"{c} {v:.2f}" for c, v in samples[case.name][-1].inside.items())]
        for case in cases
    ]
    print_table(console, "commands run inside the scripts, per decision (last round)",
                ("case", "commands"), rows)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hits", type=int, default=20_000, help="decisions per case and round")
    parser.add_argument("--identities", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spec", default="100/minute", help="the rate of every case")
    parser.add_argument("--flavor", choices=("redis", "valkey"), help="default: the first found")
    parser.add_argument("--only", help="comma-separated ratekeeper algorithms (default: all)")
    parser.add_argument("--baseline", type=Path, help="a folder of older lua/*.lua to compare")
    parser.add_argument(
        "--through-api", action="store_true", help="call the APIs one at a time, unpipelined"
    )
    args = parser.parse_args(argv)

    binary = find_binary(args.flavor)
    identities = [f"user-{i:06d}" for i in range(args.identities)]
    with Server(binary) as server:
        admin = server.client()
        cases = build_cases(server, args)
        mode = "one at a time through the APIs" if args.through_api else "pipelined"
        print(
            f"{binary.flavor} {binary.version}: {args.spec}, {args.hits:,} hits over "
            f"{args.identities:,} identities per case, {args.rounds} rounds, {mode}"
        )
        samples: dict[str, list[Cost]] = {case.name: [] for case in cases}
        for r, order in rotations(cases, args.rounds):
            for case in order:
                samples[case.name].append(measure(admin, case, args.hits, identities))
            shown = ", ".join(f"{c.name} {samples[c.name][-1].per_decision:.1f}" for c in cases)
            print(f"  round {r + 1}, us/dec: {shown}")
        for case in cases:
            case.close()
        admin.close()
    report(console(), cases, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
