"""Top offenders (``ratekeeper._engine.top``): each limiter counts whom it denies in a bounded
summary and merges it into the store; ``Limiter.top`` and ``ratekeeper top`` read the fleet's
list. The store script is held to its Python reference on real servers, the summary to its
error bound, the store's memory to its bound, and the counts of several processes add up.
Two uvicorn workers under Zipf traffic, read by the CLI, are in ``test_web_servers.py``."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import subprocess
import sys
from collections import Counter
from hashlib import blake2b
from pathlib import Path

import pytest
import redis

from ratekeeper import AsyncLimiter, ConfigError, Limiter, ManualClock, Policy
from ratekeeper._algorithms.keyspace import Keyspace
from ratekeeper._engine.top import KEPT_FACTOR, RETENTION, TopOffenders, _Summary
from ratekeeper._storage.memory import MemoryStorage

from ..support.servers import RedisServer

START = 1_700_000_000.0
CLI = str(Path(sys.executable).parent / "ratekeeper")
API = Policy("api", "2/minute")


def _flood(limiter: Limiter, counts: dict[str, int], policy: Policy = API) -> None:
    for identity, n in counts.items():
        for _ in range(n):
            limiter.hit(policy, identity)


# --- the summary ---------------------------------------------------------------------------


def test_the_summary_is_exact_while_it_has_room_and_within_its_bound_past_it() -> None:
    exact = _Summary(8)
    for member, n in {"a": 5, "b": 3, "c": 1}.items():
        for _ in range(n):
            exact.add(member, 1)
    assert exact.counts == {"a": 5, "b": 3, "c": 1}

    rng = random.Random(7)
    stream = [f"id{min(int(rng.paretovariate(1.1)), 500)}" for _ in range(20_000)]
    summary = _Summary(16)
    for member in stream:
        summary.add(member, 1)
    truth = Counter(stream)
    bound = len(stream) / 16
    assert len(summary.counts) == 16
    for member, count in summary.counts.items():
        assert truth[member] <= count <= truth[member] + bound  # never under, at most N/k over
    # Every identity above the bound is held.
    assert {m for m, n in truth.items() if n > bound} <= set(summary.counts)


# --- the store script equals its reference ---------------------------------------------------


def test_the_script_equals_its_reference(servers: dict[str, RedisServer]) -> None:
    """Merges of random summaries (more members than are kept, so trims happen) and reads
    over several minutes: the same replies from every server and from the memory backend."""
    rng = random.Random(11)
    clock = ManualClock(START)
    memory = MemoryStorage(clock=clock)
    clients = {name: redis.Redis.from_url(s.url) for name, s in servers.items()}
    top = TopOffenders(f"ref{rng.randrange(10**9)}", 4, clock=clock)
    try:
        for minute in range(3):
            clock.set(START + 60 * minute)
            for _ in range(5):
                for i in range(rng.randrange(1, 12)):
                    top.record(API, f"id{rng.randrange(30)}", rng.randrange(1, 5))
                    top.record(Policy("other", "1/second"), f"o{i}", 1)
                for script, keys, args in top.drain():
                    expected = memory.run(script, keys, args)
                    for client in clients.values():
                        got = client.eval(script.source, len(keys), *keys, *args)
                        assert got == expected
            for since in (60, 120, 180):
                for limit in (1, 3, 50):
                    script, keys, args = top.read_call("api", since, limit)
                    expected = memory.run(script, keys, args)
                    for client in clients.values():
                        got = client.eval(script.source, len(keys), *keys, *args)
                        decoded = [x.decode() if isinstance(x, bytes) else x for x in got]
                        assert decoded == expected
                    assert len(expected) <= 1 + 2 * limit
    finally:
        for client in clients.values():
            client.close()


def test_the_store_keeps_a_bounded_summary_with_a_ttl(server: RedisServer) -> None:
    """10,000 identities denied (many more than the counters): each minute's sorted set keeps
    at most KEPT_FACTOR x capacity members, every key has a TTL, and the memory does not grow
    with the identities."""
    prefix = f"bound{random.randrange(10**9)}"
    limiter = Limiter.from_url(server.url, key_prefix=prefix, top_offenders=8, deny_cache=0)
    client = redis.Redis.from_url(server.url)
    try:
        policy = Policy("flood", "1/hour")
        for i in range(10_000):
            limiter.hit(policy, f"bot-{i}")
            limiter.hit(policy, f"bot-{i}")  # denied
            if i % 1000 == 999:
                limiter.merge_top()
        limiter.merge_top()
        keys = sorted(k.decode() for k in client.scan_iter(f"{prefix}:top:*"))
        assert keys, "nothing merged"
        for key in keys:
            assert 0 < client.pttl(key) <= (RETENTION + 60) * 1000
            if key.endswith(":denied"):
                assert client.zcard(key) <= KEPT_FACTOR * 8
        found = limiter.top(policy)
        assert found.total == 10_000
        assert found.error == 10_000 // 8
        assert all(o.denied <= 1 + found.error for o in found.offenders)
    finally:
        limiter.close()
        client.close()


# --- limiters ------------------------------------------------------------------------------


@pytest.mark.parametrize("cached", [True, False], ids=["deny-cache", "no-deny-cache"])
def test_a_limiter_lists_whom_it_denied_most(backend: str, key_prefix: str, cached: bool) -> None:
    limiter = Limiter.from_url(backend, key_prefix=key_prefix, deny_cache=10_000 if cached else 0)
    try:
        _flood(limiter, {"alice": 12, "bob": 7, "carol": 4, "dave": 2, "erin": 1})
        found = limiter.top(API, limit=3)
        assert found.policy == "api"
        assert found.total == 10 + 5 + 2
        assert [(o.identity, o.denied) for o in found.offenders] == [
            ("alice", 10),
            ("bob", 5),
            ("carol", 2),
        ]
        assert found.error == 0  # 17 denials, 64 counters: exact
        assert limiter.top(Policy("quiet", "1/second")).offenders == ()
    finally:
        limiter.close()


def test_the_asyncio_limiter_merges_on_its_own_and_on_close(backend: str, key_prefix: str) -> None:
    async def main() -> None:
        limiter = AsyncLimiter.from_url(backend, key_prefix=key_prefix)
        for identity, n in {"alice": 5, "bob": 3}.items():
            for _ in range(n):
                await limiter.hit(API, identity)
        assert limiter._merge_timer is not None  # a merge is due in FLUSH_EVERY seconds
        found = await limiter.top("api")
        assert [(o.identity, o.denied) for o in found.offenders] == [("alice", 3), ("bob", 1)]
        await limiter.hit(API, "carol")
        await limiter.hit(API, "carol")
        await limiter.hit(API, "carol")
        await limiter.close()  # merges what is left
        if backend != "memory://":
            again = AsyncLimiter.from_url(backend, key_prefix=key_prefix)
            found = await again.top("api")
            assert ("carol", 1) in [(o.identity, o.denied) for o in found.offenders]
            await again.close()

    asyncio.run(main())


def test_hashed_identities_and_long_ones() -> None:
    key = b"operator-secret"
    limiter = Limiter.from_url("memory://", top_hash_key=key)
    _flood(limiter, {"alice": 3})
    (listed,) = limiter.top(API).offenders
    assert listed.identity == "h:" + blake2b(b"alice", key=key, digest_size=16).hexdigest()
    plain = Limiter.from_url("memory://")
    long = "x" * 500
    _flood(plain, {long: 3})
    (listed,) = plain.top(API).offenders
    assert listed.identity == "d:" + blake2b(long.encode(), digest_size=16).hexdigest()


def test_bad_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="top_offenders must be an int >= 1"):
        Limiter.from_url("memory://", top_offenders=-1)
    with pytest.raises(ConfigError, match="top_hash_key needs top_offenders"):
        Limiter.from_url("memory://", top_offenders=0, top_hash_key=b"k")
    off = Limiter.from_url("memory://", top_offenders=0)
    _flood(off, {"alice": 3})
    with pytest.raises(ConfigError, match="counts no top offenders"):
        off.top(API)
    on = Limiter.from_url("memory://")
    with pytest.raises(ConfigError, match="since must be seconds"):
        on.top(API, since=RETENTION + 1)
    with pytest.raises(ConfigError, match="limit must be an int >= 1"):
        on.top(API, limit=0)


def _deny_in_a_process(url: str, prefix: str, counts: dict[str, int]) -> None:
    limiter = Limiter.from_url(url, key_prefix=prefix, deny_cache=0)
    _flood(limiter, counts)
    limiter.close()  # merges


def test_the_counts_of_several_processes_add_up(server: RedisServer) -> None:
    """4 processes deny their own share of the same identities; the fleet's list, read by
    the CLI, holds the sums, exactly."""
    prefix = f"fleet{random.randrange(10**9)}"
    shares = [{"alice": 2 + 4 * p, "bob": 2 + p, "carol": 3} for p in range(4)]
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_deny_in_a_process, args=(server.url, prefix, share))
        for share in shares
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    # Each process's first 2 hits of an identity were admitted... by the shared store: only
    # the first 2 of all processes together are.
    sent = Counter[str]()
    for share in shares:
        sent.update(share)
    expected = {identity: n - 2 for identity, n in sent.items()}
    result = subprocess.run(
        [CLI, "top", "--storage", server.url, "--policy", "api",
         "--key-prefix", prefix, "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    (found,) = json.loads(result.stdout)
    assert found["total"] == sum(expected.values())
    assert found["error"] == 0
    listed = {o["identity"]: o["denied"] for o in found["offenders"]}
    assert listed == expected
    assert [o["identity"] for o in found["offenders"]] == ["alice", "bob", "carol"]


def test_the_cli_refuses_memory_and_bad_since() -> None:
    for args, message in (
        (["--storage", "memory://", "--policy", "api"], "memory:// keeps its state"),
        (["--storage", "redis://127.0.0.1:1", "--policy", "api", "--since", "2h"], "--since"),
    ):
        result = subprocess.run([CLI, "top", *args], check=False, capture_output=True, text=True)
        assert result.returncode == 2
        assert message in result.stderr


def test_keyspace_reference_trims_like_redis() -> None:
    """The reference drops the lowest counts, ties by member, as ZREMRANGEBYRANK does."""
    from ratekeeper._algorithms.top import MERGE, reference

    keyspace = Keyspace()
    args = (1, 0, MERGE, "", 0, 0, 60_000, 2, 4, "b", 1, "a", 1, "c", 2)
    assert reference(keyspace, ("z", "t"), args, 1) == [2]
    assert keyspace.get("z", 1) == {"b": 1, "c": 2}
