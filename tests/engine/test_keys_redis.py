"""What ratekeeper leaves in Redis / Valkey: key names, slots, lifetimes, and no stray writes."""

from __future__ import annotations

import asyncio
import base64
import random
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from ratekeeper import AsyncLimiter, Limiter, Policy, Rate
from ratekeeper._engine.core import TTL_MARGIN_MS

from ..support.servers import RedisServer, command_calls

_TAG = r"[A-Za-z0-9_-]{22}"


def _canonical(identity: str | bytes | int) -> bytes:
    """The documented identity equivalence: str as UTF-8 (surrogates kept), int as decimal."""
    if isinstance(identity, str):
        return identity.encode("utf-8", "surrogatepass")
    if isinstance(identity, int):
        return str(identity).encode("ascii")
    return identity


def _scan(client: redis.Redis, key_prefix: str | None = None) -> list[bytes]:
    match = None if key_prefix is None else f"{key_prefix}:*"
    return sorted(client.scan_iter(match=match, count=1000))


# --- lifetimes -----------------------------------------------------------------------------------

MIXED_POLICIES = [
    Policy("single", "10/minute"),
    Policy("multi", "3/second;20/hour"),
    Policy("multi-unsorted", [Rate(4, 86_400), Rate(2, 10), Rate(3, 60)]),
    Policy("long", "1000 per 2 days"),
]


def test_every_key_expires_after_its_longest_window_plus_the_margin(
    server: RedisServer, admin: redis.Redis, key_prefix: str
):
    """After a mixed run every key has a TTL; it outlives the policy's longest window (so no
    state is forgotten early) and by no more than the margin (so nothing lingers)."""
    rng = random.Random(0)
    identities: list[str | bytes | int] = ["alice", b"bob", 42, "carol", "dave"]
    live: set[str] = set()  # keys that must exist at the end
    admitted = denied = 0
    started = time.monotonic()
    with Limiter.from_url(server.url, key_prefix=key_prefix, timeout=5) as limiter:
        for _ in range(400):
            policy = rng.choice(MIXED_POLICIES)
            identity = rng.choice(identities)
            (key,) = limiter.keys(policy, identity)
            op = rng.random()
            if op < 0.65:
                cost = rng.choice((1, 1, 1, 2, 3, 50))  # 50 exceeds the short limits
                if limiter.hit(policy, identity, cost).allowed:
                    admitted += 1
                    live.add(key)
                else:
                    denied += 1
            elif op < 0.9:
                limiter.peek(policy, identity, rng.choice((1, 2, 5000)))
            else:
                limiter.reset(policy, identity)
                live.discard(key)
        # Peeks and a never-admissible hit on identities never hit create nothing.
        for policy in MIXED_POLICIES:
            assert not limiter.peek(policy, "ghost", 5000).allowed
            assert not limiter.hit(policy, "ghost", 5000).allowed
            assert limiter.peek(policy, "ghost").allowed

        assert admitted > 50
        assert denied > 20
        client = admin
        keys = _scan(client, key_prefix)
        assert {key.decode() for key in keys} == live
        elapsed_ms = (time.monotonic() - started) * 1000
        by_name = {policy.name: policy for policy in MIXED_POLICIES}
        longest_ms = max(policy.max_period_ms for policy in MIXED_POLICIES)
        for key in keys:
            policy = by_name[key.decode().split(":")[1]]
            ttl = policy.max_period_ms + TTL_MARGIN_MS
            pttl = client.pttl(key)
            assert 0 < pttl <= longest_ms + TTL_MARGIN_MS
            assert pttl <= ttl
            assert pttl >= ttl - elapsed_ms - 5, (key, pttl, ttl)


def test_async_hits_set_the_same_lifetime(server: RedisServer, admin: redis.Redis, key_prefix: str):
    policy = Policy("async-ttl", "3/second;20/hour")

    async def main() -> None:
        limiter = AsyncLimiter.from_url(server.url, key_prefix=key_prefix, timeout=5)
        try:
            assert (await limiter.hit(policy, "a", 2)).allowed
        finally:
            await limiter.close()

    asyncio.run(main())
    (key,) = _scan(admin, key_prefix)
    assert 0.9 * policy.max_period_ms < admin.pttl(key) <= policy.max_period_ms + TTL_MARGIN_MS


# --- a denial writes nothing ---------------------------------------------------------------------


@pytest.fixture
def quiet(own_server: RedisServer) -> Iterator[tuple[RedisServer, redis.Redis]]:
    """One of the module's own servers (command statistics and DBSIZE count this module's
    calls only), and a client of the test's own on it."""
    with own_server.client() as client:
        yield own_server, client


WRITES = ("rpush", "lpush", "ltrim", "lpop", "rpop", "pexpire", "expire", "del")


def _writes(client: redis.Redis) -> dict[str, int]:
    return {name: command_calls(client, name) for name in WRITES}


def _keyspace(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """Keys and keys with a TTL per database, from INFO keyspace (avg_ttl is a sampled
    estimate that moves on its own, so it is left out)."""
    info: dict[str, Any] = client.info("keyspace")
    return {db: (int(v["keys"]), int(v["expires"])) for db, v in info.items()}


def _state(client: redis.Redis, key: str) -> tuple[Any, ...]:
    return (
        client.dump(key),
        client.lrange(key, 0, -1),
        client.object("encoding", key),
    )


@pytest.mark.parametrize(
    "rates",
    ["3/minute", "3/minute;100/day"],  # the second: denied by one rate, admitted by the other
)
def test_a_denial_and_a_peek_write_nothing(
    quiet: tuple[RedisServer, redis.Redis], key_prefix: str, rates: str
):
    server, client = quiet
    policy = Policy("deny", rates)
    with Limiter.from_url(server.url, key_prefix=key_prefix, timeout=5) as limiter:
        (key,) = limiter.keys(policy, "a")
        assert limiter.hit(policy, "a").allowed
        # An admitting peek on a partly used log writes nothing either.
        before, writes = _state(client, key), _writes(client)
        assert limiter.peek(policy, "a", 2).allowed
        assert _state(client, key) == before
        assert _writes(client) == writes

        assert [limiter.hit(policy, "a").allowed for _ in range(3)] == [True, True, False]
        before, writes, pttl = _state(client, key), _writes(client), client.pttl(key)
        assert client.llen(key) == 3
        decisions = [
            limiter.hit(policy, "a"),
            limiter.hit(policy, "a", 2),
            limiter.hit(policy, "a", 4),  # can never fit
            limiter.peek(policy, "a"),
            limiter.peek(policy, "a", 4),
        ]
        assert not any(decision.allowed for decision in decisions)
        assert _state(client, key) == before
        assert _writes(client) == writes  # no write at all, not even a no-op one
        assert client.pttl(key) <= pttl  # the TTL was not refreshed


def test_first_hit_denied_by_cost_leaves_the_database_unchanged(
    quiet: tuple[RedisServer, redis.Redis], key_prefix: str
):
    server, client = quiet
    policies = [Policy("too-big", "10/minute"), Policy("too-big-2", "10/second;1000/hour")]
    with Limiter.from_url(server.url, key_prefix=key_prefix, timeout=5) as limiter:
        dbsize, keyspace, writes = client.dbsize(), _keyspace(client), _writes(client)
        for policy in policies:
            decision = limiter.hit(policy, "first", cost=11)
            assert not decision.allowed
            assert decision.retry_after == float("inf")
            assert not limiter.peek(policy, "first", cost=11).allowed
            assert limiter.peek(policy, "first").allowed
            (key,) = limiter.keys(policy, "first")
            assert client.exists(key) == 0
        assert client.dbsize() == dbsize
        assert _keyspace(client) == keyspace
        assert _writes(client) == writes
        assert _scan(client, key_prefix) == []


# --- crafted identities --------------------------------------------------------------------------


def _crafted_identities() -> list[str | bytes | int]:
    """At least 2,000 identities, many built to confuse a key format or a hash-tag parser."""
    special: list[str | bytes | int] = [
        "", "{", "}", "{}", "}{", "{{", "}}", "{{}}", "}}{{", "a}b{c", "a{b}c", "{a}", "{}{}",
        "{" * 1000, "}" * 1000, "\x00", "a\x00b", "\n", "\r\n", " ", "\t", ":", "::", "*", "?",
        "[a-z]", "\\", "%", "ratekeeper:x:{AAAAAAAAAAAAAAAAAAAAAA}:log",
        "x" * 1_000_000, "x" * 1_000_000 + "!", "x" * 999_999, "{" + "y" * 1_000_000 + "}",
        "a" * 100 + "1", "a" * 100 + "2", b"a" * 100 + b"\x00",
        # With policies "api" and "api2": ("api", "2x") must not run into ("api2", "x").
        "2", "2x", "x", "2{", "{", b"2\x00", b"\x00",
        "ünïcødé", "日本語", "🙂", "\u200b", "\ufeff", "\ud800", "\udfff", "e\u0301", "\u00e9",
        b"", b"{", b"}", b"{}", b"\x00", b"\xff\xfe\xfd", b"\x80", bytes(range(256)),
        0, 1, -1, 42, "42", b"42", 2**64, -(2**63), 10**100,
    ]  # fmt: skip
    rng = random.Random(0)
    alphabet = "{}:\x00\n ab\u00e9\u65e5\U0001f642\ud800"
    randoms: list[str | bytes | int] = []
    for _ in range(900):
        randoms.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40))))
    for _ in range(900):
        randoms.append(rng.randbytes(rng.randrange(0, 64)))
    for _ in range(300):
        randoms.append(rng.randrange(-(2**70), 2**70))
    return special + randoms


CRAFTED = _crafted_identities()


def _check_keys(keys: tuple[str, ...], key_prefix: str, policy: Policy) -> str:
    """Every key of one decision has the expected shape and lies in its tag's slot; return the
    tag."""
    assert keys
    pattern = re.compile(
        rf"{re.escape(key_prefix)}:{re.escape(policy.name)}:\{{(?P<tag>{_TAG})\}}:[a-z_]+"
    )
    tags = set()
    for key in keys:
        match = pattern.fullmatch(key)
        assert match is not None, key
        tags.add(match["tag"])
        assert key.count("{") == 1
        assert key.count("}") == 1
    assert len(tags) == 1
    (tag,) = tags
    assert len(base64.urlsafe_b64decode(tag + "==")) == 16  # a 128-bit digest
    slots = {key_slot(key.encode()) for key in keys}
    assert slots == {key_slot(tag.encode())}
    return tag


def test_crafted_identities_yield_single_slot_keys():
    assert len(CRAFTED) >= 2000
    policies = [Policy("api", "5/minute"), Policy("api2", "5/minute")]
    with Limiter.from_url("memory://", key_prefix="kp") as limiter:
        tags: dict[tuple[str, bytes], str] = {}
        for identity in CRAFTED:
            for policy in policies:
                tag = _check_keys(limiter.keys(policy, identity), "kp", policy)
                known = tags.setdefault((policy.name, _canonical(identity)), tag)
                assert known == tag  # equivalent identities (42, "42", b"42") share a tag
    # Distinct (policy, identity) pairs never share a tag.
    assert len(set(tags.values())) == len(tags)
    assert len({identity for _, identity in tags}) > 1900


@settings(max_examples=300, deadline=None)
@given(
    identity=st.one_of(st.text(), st.binary(), st.integers()),
    name=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,20}", fullmatch=True),
)
def test_any_identity_yields_single_slot_keys(identity: str | bytes | int, name: str):
    policy = Policy(name, "5/minute")
    with Limiter.from_url("memory://", key_prefix="p.q:r") as limiter:
        keys = limiter.keys(policy, identity)
        _check_keys(keys, "p.q:r", policy)
        assert keys == limiter.keys(policy, _canonical(identity))


def test_crafted_identities_work_on_a_server(
    server: RedisServer, admin: redis.Redis, key_prefix: str
):
    policy = Policy("crafted", "5/minute")
    with Limiter.from_url(server.url, key_prefix=key_prefix, timeout=5) as limiter:
        expected: dict[bytes, int] = {}
        for identity in CRAFTED:
            canonical = _canonical(identity)
            expected[canonical] = expected.get(canonical, 0) + 1
            decision = limiter.hit(policy, identity)
            # Short random identities repeat (the empty one often): the sixth hit is denied.
            assert decision.allowed == (expected[canonical] <= 5)
            assert decision.remaining == max(5 - expected[canonical], 0)
        client = admin
        keys = _scan(client, key_prefix)
        assert len(expected) > 1900
        assert len(keys) == len(expected)
        for key in keys:
            assert len(key) < 100
            assert client.type(key) == b"list"


# --- identities never appear raw -----------------------------------------------------------------


def test_keys_never_contain_the_raw_identity(
    server: RedisServer, admin: redis.Redis, key_prefix: str
):
    secret = "secret-api-key-123"
    policies = [Policy("auth", "3/minute"), Policy("auth-multi", "2/second;10/hour")]
    with Limiter.from_url(server.url, key_prefix=key_prefix, timeout=5) as limiter:
        for policy in policies:
            for identity in (secret, secret.encode(), f"{{{secret}}}", f"user:{secret}"):
                for _ in range(4):  # admitted, then denied
                    limiter.hit(policy, identity)
                limiter.peek(policy, identity)
                for key in limiter.keys(policy, identity):
                    assert secret not in key
        client = admin
        mine = _scan(client, key_prefix)
        assert len(mine) == 2 * 3  # secret and its bytes form are the same identity
        for key in _scan(client):  # every key on the server, whoever wrote it
            assert secret.encode() not in key
        for key in mine:
            for member in client.lrange(key, 0, -1):
                assert secret.encode() not in member
            assert secret.encode() not in client.dump(key)
