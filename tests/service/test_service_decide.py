"""The Decider's ``current_limit``: built once per configured rule and copied into each status;
with several limits, the limit that decided; an override's own; a reload's new value at once.
Then upstream's wire behaviour: whole-second durations (a fresh fixed window's end from the
clock), global shadow mode, response dynamic metadata and charged denials."""

from __future__ import annotations

import asyncio
import logging
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from ratekeeper import AsyncLimiter, StorageError
from ratekeeper.service._decide import Decider, set_duration
from ratekeeper.service._loader import load_config
from ratekeeper.service._tokens import TokenRefused, Tokens
from ratekeeper.service.rls_pb2 import RateLimitDescriptor, RateLimitRequest, RateLimitResponse
from ratekeeper.testing import AsyncFlakyStorage

from ..support.servers import RedisServer

CONFIG = """
domain: d
descriptors:
  - key: multi
    rate_limit:
      limits:
        - {unit: second, requests_per_unit: 1000}
        - {unit: minute, requests_per_unit: 5}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: LIMIT, name: per-user}
  - key: other
    rate_limit: {unit: day, requests_per_unit: 7}
"""


@pytest.fixture
def redis_url(servers: dict[str, RedisServer]) -> str:
    return next(iter(servers.values())).url


def request(*entries: tuple[str, str], limit: tuple[int, str] | None = None) -> RateLimitRequest:
    message = RateLimitRequest(domain="d")
    for key, value in entries:
        descriptor = message.descriptors.add()
        descriptor.entries.add(key=key, value=value)
        if limit is not None:
            descriptor.limit.requests_per_unit = limit[0]
            descriptor.limit.unit = RateLimitDescriptor.RateLimitUnit.Value(limit[1])  # type: ignore[assignment]
    return message


def limits(response: RateLimitResponse) -> list[tuple[str, int, str]]:
    unit = RateLimitResponse.RateLimit.Unit.Name
    return [
        (s.current_limit.name, s.current_limit.requests_per_unit, unit(s.current_limit.unit))
        for s in response.statuses
    ]


def test_current_limit_per_rule_override_and_reload(tmp_path: Path, redis_url: str) -> None:
    path = tmp_path / "config.yaml"

    def config(limit: int) -> object:
        path.write_text(textwrap.dedent(CONFIG).replace("LIMIT", str(limit)), encoding="utf-8")
        return load_config(path)

    async def run() -> None:
        async with AsyncLimiter.from_url(redis_url, key_prefix="decide") as limiter:
            decider = Decider(limiter, config(3))  # type: ignore[arg-type]
            both = request(("user", "a"), ("other", "b"), ("multi", "c"))
            for _ in range(2):  # the second answer comes from the cached messages
                answer = await decider.should_rate_limit(both)
                assert limits(answer) == [
                    ("per-user", 3, "HOUR"),
                    ("", 7, "DAY"),
                    ("", 5, "MINUTE"),  # the limit that decided: fewest left
                ]
            # an override is its own limit, not the configured rule's cached one
            overridden = await decider.should_rate_limit(
                request(("user", "a"), limit=(9, "SECOND"))
            )
            assert limits(overridden) == [("", 9, "SECOND")]
            again = await decider.should_rate_limit(request(("user", "a")))
            assert limits(again) == [("per-user", 3, "HOUR")]
            decider.config = config(4)  # a reload: the new limit in the next answer
            reloaded = await decider.should_rate_limit(request(("user", "a")))
            assert limits(reloaded) == [("per-user", 4, "HOUR")]
            assert reloaded.statuses[0].duration_until_reset.seconds <= 3600

    asyncio.run(run())


# --- upstream on the wire: durations, shadow mode, dynamic metadata, charged denials ----------

WIRE = """
domain: w
descriptors:
  - key: fixed
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: second
    rate_limit: {unit: second, requests_per_unit: 1000}
  - key: zero
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: charged
    rate_limit: {unit: hour, requests_per_unit: 3, charge_over_limit: true}
  - key: tagged
    value: a
    metadata: {team: {name: a, tier: 1}, owner: first}
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: tagged
    value: b
    metadata: {team: {region: eu, tier: 2}, owner: second}
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: tagged
    value: over
    metadata: {never: shown}
    rate_limit: {unit: hour, requests_per_unit: 0}
"""


def wire_request(*descriptors: dict[str, object], hits: int = 0) -> RateLimitRequest:
    """A request for domain ``w``: each descriptor ``{"entries": [(k, v)], "hits": n,
    "limit": (n, unit)}`` (hits and limit optional)."""
    message = RateLimitRequest(domain="w", hits_addend=hits)
    for spec in descriptors:
        descriptor = message.descriptors.add()
        for key, value in spec["entries"]:  # type: ignore[attr-defined]
            descriptor.entries.add(key=key, value=value)
        if "hits" in spec:
            descriptor.hits_addend.value = spec["hits"]  # type: ignore[assignment]
        if "limit" in spec:
            requests, unit = spec["limit"]  # type: ignore[misc]
            descriptor.limit.requests_per_unit = requests
            descriptor.limit.unit = RateLimitDescriptor.RateLimitUnit.Value(unit)
    return message


def decide(
    tmp_path: Path, redis_url: str, test: Callable[[Decider], Awaitable[None]], **options: Any
) -> None:
    path = tmp_path / "wire.yaml"
    path.write_text(textwrap.dedent(WIRE), encoding="utf-8")

    async def run() -> None:
        prefix = f"wire{time.monotonic_ns()}"
        async with AsyncLimiter.from_url(redis_url, key_prefix=prefix, timeout=2.0) as limiter:
            await test(Decider(limiter, load_config(path), **options))

    asyncio.run(run())


def test_duration_rounding_is_upstreams() -> None:
    """Whole seconds rounded up: upstream's ``unit - now % unit`` on a clock of whole seconds
    is the time to the window's end rounded up (0.001 s before the end: 1, not 0)."""
    status = RateLimitResponse.DescriptorStatus()
    for seconds, whole in [(0.001, 1), (0.999, 1), (1.0, 1), (59.2, 60), (60.0, 60), (3.0, 3)]:
        set_duration(status, seconds, exact=False)
        assert (status.duration_until_reset.seconds, status.duration_until_reset.nanos) == (
            whole,
            0,
        )
    set_duration(status, 12.25, exact=True)
    assert (status.duration_until_reset.seconds, status.duration_until_reset.nanos) == (
        12,
        250_000_000,
    )


def test_durations_whole_seconds_and_fixed_window_ends(tmp_path: Path, redis_url: str) -> None:
    """On the store: whole seconds by default (a per-second rule says 1, never 0); a peek of a
    fresh fixed window and a rule that denies all say when the window ends on the clock, as
    upstream (which computes every duration from the clock and the unit)."""
    now = 3600 * 277_778 + 45.25  # 45.25 s into a minute and into an hour (in 2001)

    async def test(decider: Decider) -> None:
        for _ in range(3):
            second = await decider.should_rate_limit(wire_request({"entries": [("second", "s")]}))
            assert second.statuses[0].duration_until_reset.seconds == 1
            assert second.statuses[0].duration_until_reset.nanos == 0
        counted = await decider.should_rate_limit(wire_request({"entries": [("fixed", "f")]}))
        until = counted.statuses[0].duration_until_reset
        assert 1 <= until.seconds <= 60
        assert until.nanos == 0
        # nothing counted yet: the store says 0, the clock says when the window ends
        peek = await decider.should_rate_limit(
            wire_request({"entries": [("fixed", "new")], "hits": 0})
        )
        assert peek.statuses[0].duration_until_reset.seconds == 15  # 14.75 rounded up
        assert peek.statuses[0].limit_remaining == 3
        zero = await decider.should_rate_limit(wire_request({"entries": [("zero", "z")]}))
        assert zero.overall_code == RateLimitResponse.OVER_LIMIT
        assert zero.statuses[0].duration_until_reset.seconds == 3555  # 3554.75 rounded up
        decider.exact_durations = True
        peek = await decider.should_rate_limit(
            wire_request({"entries": [("fixed", "new")], "hits": 0})
        )
        exact = peek.statuses[0].duration_until_reset
        assert (exact.seconds, exact.nanos) == (14, 750_000_000)
        counted = await decider.should_rate_limit(wire_request({"entries": [("fixed", "f")]}))
        assert 0 < counted.statuses[0].duration_until_reset.ToNanoseconds() <= 60 * 10**9

    decide(tmp_path, redis_url, test, clock=lambda: now)


def test_global_shadow_mode(tmp_path: Path, redis_url: str) -> None:
    """Upstream's SHADOW_MODE: OK overall, the statuses still say which descriptor is over."""

    async def test(decider: Decider) -> None:
        over = wire_request({"entries": [("fixed", "g")], "hits": 4}, {"entries": [("fixed", "h")]})
        answer = await decider.should_rate_limit(over)
        assert answer.overall_code == RateLimitResponse.OK
        assert [s.code for s in answer.statuses] == [
            RateLimitResponse.OVER_LIMIT,
            RateLimitResponse.OK,
        ]
        decider.shadow_mode = False
        assert (await decider.should_rate_limit(over)).overall_code == RateLimitResponse.OVER_LIMIT

    decide(tmp_path, redis_url, test, shadow_mode=True)


def test_response_dynamic_metadata(tmp_path: Path, redis_url: str) -> None:
    """Upstream's RESPONSE_DYNAMIC_METADATA: the domain, each descriptor as sent, the request's
    hits, and the metadata of the rules that passed, merged (the first value of a key wins,
    mappings merge); an over-limit rule's metadata is left out."""

    async def test(decider: Decider) -> None:
        request = wire_request(
            {"entries": [("tagged", "a")]},
            {"entries": [("tagged", "b")], "hits": 2, "limit": (9, "HOUR")},
            {"entries": [("tagged", "over")]},
            {"entries": [("nothing", "x"), ("k", "v")]},
            hits=3,
        )
        answer = await decider.should_rate_limit(request)
        assert answer.overall_code == RateLimitResponse.OVER_LIMIT
        assert json_format.MessageToDict(answer.dynamic_metadata) == {
            "domain": "w",
            "descriptors": [
                {"entries": ["tagged=a"]},
                {
                    "entries": ["tagged=b"],
                    "limit": "requests_per_unit:9 unit:HOUR",
                    "hitsAddend": 2.0,
                },
                {"entries": ["tagged=over"]},
                {"entries": ["nothing=x", "k=v"]},
            ],
            "hitsAddend": 3.0,
            # the override of tagged=b replaces its rule (and metadata), as upstream
            "metadata": {"team": {"name": "a", "tier": 1.0}, "owner": "first"},
        }
        both = await decider.should_rate_limit(
            wire_request({"entries": [("tagged", "a")]}, {"entries": [("tagged", "b")]})
        )
        assert json_format.MessageToDict(both.dynamic_metadata)["metadata"] == {
            "team": {"name": "a", "tier": 1.0, "region": "eu"},
            "owner": "first",
        }
        decider.dynamic_metadata = False
        plain = await decider.should_rate_limit(request)
        assert not plain.HasField("dynamic_metadata")

    decide(tmp_path, redis_url, test, dynamic_metadata=True)


def remaining(answer: RateLimitResponse) -> list[tuple[str, int]]:
    name = RateLimitResponse.Code.Name
    return [(name(s.code), s.limit_remaining) for s in answer.statuses]


def test_charged_denials_count_as_upstream(tmp_path: Path, redis_url: str) -> None:
    """charge_over_limit (a rule's, or the Decider's for every rule): a denied call's hits are
    counted, as upstream increments whatever the answer; the answer is upstream's (OVER_LIMIT
    only when the hits do not fit: filling the limit exactly is OK). Without it a denial counts
    nothing."""

    async def test(decider: Decider) -> None:
        async def send(key: str, hits: int) -> list[tuple[str, int]]:
            return remaining(
                await decider.should_rate_limit(
                    wire_request({"entries": [(key, "u")], "hits": hits})
                )
            )

        assert await send("charged", 2) == [("OK", 1)]
        assert await send("charged", 1) == [("OK", 0)]  # exactly the limit: OK, as upstream
        assert await send("charged", 2) == [("OVER_LIMIT", 0)]  # denied, and counted: 5
        assert await send("charged", 0) == [("OK", 0)]  # a peek: nothing left
        # not charged by default: a denial counts nothing
        assert await send("fixed", 2) == [("OK", 1)]
        assert await send("fixed", 2) == [("OVER_LIMIT", 0)]
        assert await send("fixed", 1) == [("OK", 0)]
        decider.charge_over_limit = True  # every rule, as upstream
        assert await send("fixed", 1) == [("OVER_LIMIT", 0)]
        other = await decider.should_rate_limit(
            wire_request({"entries": [("fixed", "v")], "hits": 4}, {"entries": [("fixed", "w")]})
        )
        assert remaining(other) == [("OVER_LIMIT", 0), ("OK", 2)]
        # 4 were counted although refused: the next hit is refused too
        assert remaining(
            await decider.should_rate_limit(wire_request({"entries": [("fixed", "v")]}))
        ) == [("OVER_LIMIT", 0)]

    decide(tmp_path, redis_url, test)


# --- reservations: a token settles once, whatever the failure mode; bounded cancels --------

RESERVE_CONFIG = """
domain: d
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: tight
    rate_limit: {unit: hour, requests_per_unit: 1}
"""


def flaky_decider(tmp_path: Path, failure_mode: str, **limiter: Any) -> tuple[Any, Decider]:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(RESERVE_CONFIG), encoding="utf-8")
    store = AsyncFlakyStorage()
    limiter_ = AsyncLimiter(store, clock=store.clock, failure_mode=failure_mode, **limiter)  # type: ignore[arg-type]
    tokens = Tokens(b"k" * 32, 60)
    return store, Decider(limiter_, load_config(path), tokens=tokens)  # type: ignore[arg-type]


def reserve_request(*entries: tuple[str, str], hits: int) -> RateLimitRequest:
    """``entries``, each its own descriptor, for ``hits`` each (0: a peek)."""
    message = request(*entries)
    for descriptor in message.descriptors:
        descriptor.hits_addend.value = hits
    return message


@pytest.mark.parametrize("failure_mode", ["open", "local", "closed", "raise"])
def test_a_settle_whose_mark_the_store_did_not_answer_changes_nothing(
    tmp_path: Path, failure_mode: str
) -> None:
    """Reserve 10 of 100, settle for 0 while the store fails: under every failure mode each
    of 4 settles is refused with StorageError (HTTP 503) and refunds nothing (before issue
    #32, open and local refunded every replay: the degraded mark read as "not settled yet").
    Once the store is back, the token settles once, then 409."""
    store, decider = flaky_decider(tmp_path, failure_mode)

    async def remaining() -> int:
        answer = await decider.should_rate_limit(reserve_request(("user", "u"), hits=0))
        return answer.statuses[0].limit_remaining

    async def run() -> None:
        _, tokens = await decider.reserve(reserve_request(("user", "u"), hits=10))
        token = tokens[0]
        assert await remaining() == 90
        store.sync.down = True
        for _ in range(4):
            with pytest.raises(StorageError):
                await decider.settle(token, 0)
        store.sync.down = False
        assert await remaining() == 90  # nothing refunded
        settled = await decider.settle(token, 0)
        assert settled.statuses[0].limit_remaining == 100
        for actual in (0, None):
            with pytest.raises(TokenRefused) as refused:
                await decider.settle(token, actual)
            assert refused.value.status == 409
        assert await remaining() == 100

    asyncio.run(run())


def test_a_settle_with_the_breaker_open_changes_nothing(tmp_path: Path) -> None:
    """The breaker opens while the store is down: its answers are degraded too, so 503."""
    store, decider = flaky_decider(tmp_path, "open")

    async def run() -> None:
        _, tokens = await decider.reserve(reserve_request(("user", "b"), hits=5))
        store.sync.down = True
        for _ in range(20):  # enough failures to open it
            await decider.should_rate_limit(reserve_request(("user", "other"), hits=1))
        calls = store.sync.calls
        with pytest.raises(StorageError, match="could not mark the reservation settled"):
            await decider.settle(tokens[0], 0)
        assert store.sync.calls == calls  # answered by the open breaker, not the store

    asyncio.run(run())


class _FailsAfter(AsyncFlakyStorage):
    """Goes down once ``after`` script calls reached it (the reserves of a request)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        run = self.sync.run

        def counted(script: Any, keys: Any, args: Any) -> list[int]:
            if self.sync.calls >= self.after:
                self.sync.down = True
            return run(script, keys, args)

        self.sync.run = counted  # type: ignore[method-assign]


@pytest.mark.parametrize("failure_mode", ["raise", "open"])
def test_a_refused_request_cancels_in_rounds_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, failure_mode: str
) -> None:
    """3,000 descriptors and one over its limit: every reservation is cancelled, 64 at a
    time; when the store fails for the cancels, one WARNING for the request (counts and the
    first failure), not one per descriptor."""
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(RESERVE_CONFIG), encoding="utf-8")
    many = 3_000
    big = reserve_request(*[("user", f"u{n}") for n in range(many)], ("tight", "t"), hits=1)

    async def run(store: AsyncFlakyStorage, *, fails: bool) -> None:
        limiter = AsyncLimiter(store, clock=store.clock, failure_mode=failure_mode)  # type: ignore[arg-type]
        decider = Decider(limiter, load_config(path))  # type: ignore[arg-type]
        await decider.should_rate_limit(reserve_request(("tight", "t"), hits=1))
        store.sync.calls = 0
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ratekeeper"):
            response, tokens = await decider.reserve(big)
        assert response.overall_code == RateLimitResponse.OVER_LIMIT
        assert tokens == {}
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        if fails:  # the request's line; the limiter's own, rate-limited per reason
            assert len(warnings) <= 5, [r.getMessage() for r in warnings]
            (warning,) = [r for r in warnings if r.name == "ratekeeper.service"]
            assert f"could not cancel {many} of the {many} reservations" in warning.getMessage()
        else:
            assert warnings == []
            store.sync.down = False
            peeks = await decider.should_rate_limit(
                reserve_request(*[("user", f"u{n}") for n in range(0, many, 6)], hits=0)
            )
            assert {s.limit_remaining for s in peeks.statuses} == {100}  # all cancelled
            assert {s.limit_remaining for s in response.statuses[:many]} == {100}

    asyncio.run(run(AsyncFlakyStorage(), fails=False))
    asyncio.run(run(_FailsAfter(many + 1), fails=True))
