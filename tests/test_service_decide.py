"""The Decider's ``current_limit``: built once per configured rule and copied into each status;
with several limits, the limit that decided; an override's own; a reload's new value at once."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from ratekeeper import AsyncLimiter
from ratekeeper.service._decide import Decider
from ratekeeper.service._loader import load_config
from ratekeeper.service.rls_pb2 import RateLimitDescriptor, RateLimitRequest, RateLimitResponse

from .servers import RedisServer

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
