"""Where one ``Limiter.hit`` spends its time on the client: cProfile plus I/O-free micro-timings.

Run: ``.venv/bin/python benchmarks/profile_hit.py [--calls N] [--top T]``

1. cProfile over N ``limiter.hit`` calls against a private server (top T by cumulative time,
   then by own time);
2. timeit of the pure-Python pieces of a hit, without any I/O: ``Core.hit_call`` (key hashing,
   argument encoding, token), ``Core.decision_of`` on a canned reply, and redis-py's command
   packing;
3. the same N calls three ways, no profiler: ``limiter.hit``, ``storage.run`` with precomputed
   calls, and ``client.execute_command('EVALSHA', ...)`` with the same precomputed arguments.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import timeit
from collections.abc import Callable

import redis
from _harness import Server, find_binary, store_only

from ratekeeper import Limiter, Policy
from ratekeeper._engine.core import Call, Core
from ratekeeper._storage.redis import RedisStorage


def profile_hits(limiter: Limiter, policy: Policy, identities: list[str], n: int, top: int) -> None:
    hit = limiter.hit
    k = len(identities)
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(n):
        hit(policy, identities[i % k])
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    print(f"cProfile, {n} hits (the profiler inflates Python-heavy entries)")
    print(out.getvalue())


def time_pieces(storage: RedisStorage, policy: Policy) -> None:
    core = Core()
    call = core.hit_call(policy, "user:1", 1)
    reply = storage.run(call.script, call.keys, call.args)
    pool = storage.client.connection_pool
    connection = pool.get_connection()
    try:
        command = ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
        pieces: dict[str, Callable[[], object]] = {
            "Core.hit_call (keys + args + token)": lambda: core.hit_call(policy, "user:1", 1),
            "KeyBuilder.tag (blake2b + b64)": lambda: core.keys.tag("bench", "user:1"),
            "Core.decision_of (reply -> Decision)": lambda: core.decision_of(call, reply),
            "redis-py pack_command": lambda: connection.pack_command(*command),
        }
        print("I/O-free pieces, best of 5, us per call:")
        for label, fn in pieces.items():
            number = 20_000
            best = min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6
            print(f"  {label:36s} {best:6.2f}")
    finally:
        pool.release(connection)


def three_ways(limiter: Limiter, policy: Policy, identities: list[str], n: int) -> None:
    """Precomputed calls are made fresh per repeat, outside the timing, so every token stays
    unique and the server does the same work each way."""
    storage = limiter.storage
    assert isinstance(storage, RedisStorage)
    client: redis.Redis = storage.client
    core = Core()
    k = len(identities)
    hit = limiter.hit
    run = storage.run
    execute = client.execute_command

    def via_hit(_: list[Call]) -> None:
        for i in range(n):
            hit(policy, identities[i % k])

    def via_run(calls: list[Call]) -> None:
        for c in calls:
            run(c.script, c.keys, c.args)

    def via_execute(calls: list[Call]) -> None:
        for c in calls:
            execute("EVALSHA", c.script.sha, 1, *c.keys, *c.args)

    ways = {
        "limiter.hit": via_hit,
        "storage.run (precomputed calls)": via_run,
        "client.execute_command EVALSHA": via_execute,
    }
    print(f"\nsame {n} calls, three ways, 3 interleaved repeats, us per call:")
    results: dict[str, list[float]] = {label: [] for label in ways}
    for _ in range(3):
        for label, fn in ways.items():
            calls = [core.hit_call(policy, identities[i % k], 1) for i in range(n)]
            t0 = time.perf_counter()
            fn(calls)
            results[label].append((time.perf_counter() - t0) / n * 1e6)
    for label, values in results.items():
        print(f"  {label:36s} " + " ".join(f"{v:6.1f}" for v in values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--identities", type=int, default=10_000)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args(argv)

    binary = find_binary()
    print(f"server: {binary.flavor} {binary.version} ({binary.path})")
    policy = Policy("bench", "1000/minute", algorithm="sliding_log")
    identities = [f"user:{i}" for i in range(args.identities)]

    with (
        Server(binary) as server,
        Limiter.from_url(server.url, **store_only()) as limiter,
    ):
        storage = limiter.storage
        assert isinstance(storage, RedisStorage)
        for i in range(2_000):  # warm up: connection, script cache
            limiter.hit(policy, identities[i % len(identities)])
        profile_hits(limiter, policy, identities, args.calls, args.top)
        time_pieces(storage, policy)
        three_ways(limiter, policy, identities, args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
