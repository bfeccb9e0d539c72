"""envoyproxy/ratelimit's documented behaviours, as this project's own files and cases.

Each test restates one example of upstream's README ("Configuration" > "Examples" 1-9) or of its
``basic_config`` and ``wildcard`` test configurations, written here in our own words: the rule
each descriptor lands on (``ServiceConfig.resolve``), and the statuses a run of requests gets
when those rules are charged on a real store (the shared Redis/Valkey) with a manual clock
(the limiter's client time). The status logic below
is upstream's, stated as a test oracle: no rule is OK with no limit, ``unlimited`` is OK with
remaining 4294967295, ``requests_per_unit: 0`` is always over the limit, shadow mode turns an
over-limit status into OK, and the request is over the limit when any descriptor is.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ratekeeper import Limiter, ManualClock, Rate
from ratekeeper.service._config import LimitRule, ServiceConfig
from ratekeeper.service._loader import load_config

from ..support.servers import RedisServer

Entries = list[tuple[str, str]]
UNLIMITED_REMAINING = 2**32 - 1


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_800_000_000.0)  # moved by hand: no test sleeps


@pytest.fixture
def limiter(clock: ManualClock, servers: dict[str, RedisServer]) -> Iterator[Limiter]:
    url = next(iter(servers.values())).url
    prefix = f"examples{time.monotonic_ns()}"  # counters of their own, whatever ran before
    limiter = Limiter.from_url(
        url, clock=clock, key_prefix=prefix, timeout=2.0, failure_mode="raise"
    )
    yield limiter
    limiter.close()


def load(tmp_path: Path, text: str) -> ServiceConfig:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return load_config(path, portable=True)  # every example is upstream's own format


def statuses(
    limiter: Limiter, config: ServiceConfig, domain: str, descriptors: list[Entries]
) -> tuple[str, list[tuple[str, int | None]]]:
    """(overall code, [(code, limit_remaining or None when no limit applies), ...])."""
    out: list[tuple[str, int | None]] = []
    for entries, rule in zip(descriptors, config.resolve(domain, descriptors), strict=True):
        if rule is None:
            out.append(("OK", None))
        elif rule.unlimited:
            out.append(("OK", UNLIMITED_REMAINING))
        elif rule.denies_all:
            out.append(("OVER_LIMIT", 0))
        else:
            assert rule.policy is not None
            decision = limiter.hit(rule.policy, rule.identity_for(entries))
            code = "OK" if decision.allowed or rule.shadow_mode else "OVER_LIMIT"
            out.append((code, decision.remaining))
    overall = "OVER_LIMIT" if any(code == "OVER_LIMIT" for code, _ in out) else "OK"
    return overall, out


def codes(limiter: Limiter, config: ServiceConfig, domain: str, entries: Entries, n: int) -> str:
    """The overall codes of ``n`` requests with one descriptor, as a string of . (OK) and X."""
    return "".join(
        "." if statuses(limiter, config, domain, [entries])[0] == "OK" else "X" for _ in range(n)
    )


def the_rule(config: ServiceConfig, domain: str, entries: Entries) -> LimitRule:
    (found,) = config.resolve(domain, [entries])
    assert found is not None
    return found


def test_example_1_two_values_of_one_key(
    tmp_path: Path, limiter: Limiter, clock: ManualClock
) -> None:
    config = load(
        tmp_path,
        """
        domain: mongo_cps
        descriptors:
          - key: database
            value: users
            rate_limit: {unit: second, requests_per_unit: 500}
          - key: database
            value: default
            rate_limit: {unit: second, requests_per_unit: 500}
        """,
    )
    users = [("database", "users")]
    rule = the_rule(config, "mongo_cps", users)
    assert (rule.requests_per_unit, rule.unit) == (500, "SECOND")
    assert config.resolve("mongo_cps", [[("database", "orders")]]) == [None]
    assert codes(limiter, config, "mongo_cps", users, 501) == "." * 500 + "X"
    # The other value counts on its own.
    assert codes(limiter, config, "mongo_cps", [("database", "default")], 1) == "."
    clock.advance(1)
    assert codes(limiter, config, "mongo_cps", users, 1) == "."


MESSAGING = """
domain: messaging
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: {unit: day, requests_per_unit: 5}
  - key: to_number
    rate_limit: {unit: day, requests_per_unit: 100}
"""


def test_example_2_nested_descriptors_and_several_per_request(
    tmp_path: Path, limiter: Limiter
) -> None:
    config = load(tmp_path, MESSAGING)
    marketing = [("message_type", "marketing"), ("to_number", "2061111111")]
    number = [("to_number", "2061111111")]
    assert the_rule(config, "messaging", marketing).requests_per_unit == 5
    assert the_rule(config, "messaging", number).requests_per_unit == 100
    assert config.resolve("messaging", [[("message_type", "marketing")]]) == [None]
    assert config.resolve("messaging", [[("message_type", "alert"), number[0]]]) == [None]
    # Both descriptors in one request: the logical OR of the two decisions.
    for sent in range(1, 6):
        overall, each = statuses(limiter, config, "messaging", [marketing, number])
        assert (overall, each) == ("OK", [("OK", 5 - sent), ("OK", 100 - sent)])
    overall, each = statuses(limiter, config, "messaging", [marketing, number])
    assert (overall, each) == ("OVER_LIMIT", [("OVER_LIMIT", 0), ("OK", 94)])
    # Every phone number has its own 5 per day.
    other = [("message_type", "marketing"), ("to_number", "2062222222")]
    assert codes(limiter, config, "messaging", other, 6) == ".....X"


def test_example_3_the_most_specific_match_and_a_blocked_value(
    tmp_path: Path, limiter: Limiter
) -> None:
    config = load(
        tmp_path,
        """
        domain: edge_proxy_per_ip
        descriptors:
          - key: remote_address
            rate_limit: {unit: second, requests_per_unit: 10}
          - key: remote_address
            value: 50.0.0.5
            rate_limit: {unit: second, requests_per_unit: 0}
        """,
    )
    assert codes(limiter, config, "edge_proxy_per_ip", [("remote_address", "50.0.0.1")], 11) == (
        "." * 10 + "X"
    )
    assert codes(limiter, config, "edge_proxy_per_ip", [("remote_address", "50.0.0.2")], 10) == (
        "." * 10
    )
    blocked = [("remote_address", "50.0.0.5")]
    assert the_rule(config, "edge_proxy_per_ip", blocked).denies_all
    assert codes(limiter, config, "edge_proxy_per_ip", blocked, 3) == "XXX"


def test_example_4_the_request_depth_must_be_the_configured_depth(
    tmp_path: Path, limiter: Limiter
) -> None:
    request = [("key", "value"), ("subkey", "subvalue")]
    shallow = load(
        tmp_path,
        """
        domain: example4
        descriptors:
          - key: key
            value: value
            rate_limit: {requests_per_unit: 300, unit: second}
        """,
    )
    assert shallow.resolve("example4", [request]) == [None]
    assert statuses(limiter, shallow, "example4", [request]) == ("OK", [("OK", None)])
    deep = load(
        tmp_path,
        """
        domain: example4
        descriptors:
          - key: key
            value: value
            descriptors:
              - key: subkey
                rate_limit: {requests_per_unit: 300, unit: second}
        """,
    )
    assert the_rule(deep, "example4", request).requests_per_unit == 300
    assert statuses(limiter, deep, "example4", [request]) == ("OK", [("OK", 299)])


def test_example_5_unlimited(tmp_path: Path, limiter: Limiter) -> None:
    config = load(
        tmp_path,
        """
        domain: internal
        descriptors:
          - key: ldap
            rate_limit:
              unlimited: true
          - key: azure
            rate_limit: {unit: minute, requests_per_unit: 100}
        """,
    )
    ldap = the_rule(config, "internal", [("ldap", "x")])
    assert (ldap.unlimited, ldap.policy) == (True, None)
    for _ in range(3):
        assert statuses(limiter, config, "internal", [[("ldap", "x")]]) == (
            "OK",
            [("OK", UNLIMITED_REMAINING)],
        )
    assert statuses(limiter, config, "internal", [[("azure", "x")]]) == ("OK", [("OK", 99)])
    # Unknown to the file: OK with no limit at all, unlike unlimited.
    assert statuses(limiter, config, "internal", [[("aws", "x")]]) == ("OK", [("OK", None)])


def test_example_6_shadow_mode(tmp_path: Path, limiter: Limiter) -> None:
    config = load(
        tmp_path,
        """
        domain: example6
        descriptors:
          - key: service
            descriptors:
              - key: user
                value: user-a
                rate_limit: {requests_per_unit: 10, unit: second}
                shadow_mode: true
              - key: user
                value: user-b
                rate_limit: {requests_per_unit: 20, unit: second}
        """,
    )
    user_a = [("service", "auth-service"), ("user", "user-a")]
    user_b = [("service", "auth-service"), ("user", "user-b")]
    assert the_rule(config, "example6", user_a).shadow_mode
    assert not the_rule(config, "example6", user_b).shadow_mode
    assert codes(limiter, config, "example6", user_a, 30) == "." * 30
    # ... though the limit was counted: the 11th request was over it.
    rule = the_rule(config, "example6", user_a)
    assert rule.policy is not None
    assert not limiter.peek(rule.policy, rule.identity_for(user_a)).allowed
    assert codes(limiter, config, "example6", user_b, 21) == "." * 20 + "X"


def test_example_7_replaces(tmp_path: Path, limiter: Limiter) -> None:
    config = load(
        tmp_path,
        """
        domain: example7
        descriptors:
          - key: key_1
            value: value_1
            descriptors:
              - key: user
                value: bkthomps
                rate_limit:
                  name: specific_limit
                  requests_per_unit: 5
                  unit: second
          - key: key_2
            value: value_2
            descriptors:
              - key: user
                value: bkthomps
                rate_limit:
                  replaces:
                    - name: specific_limit
                  requests_per_unit: 10
                  unit: second
        """,
    )
    one = [("key_1", "value_1"), ("user", "bkthomps")]
    two = [("key_2", "value_2"), ("user", "bkthomps")]
    assert the_rule(config, "example7", one).requests_per_unit == 5
    assert the_rule(config, "example7", two).requests_per_unit == 10
    both = config.resolve("example7", [one, two])
    assert both[0] is None
    assert both[1] is not None
    assert both[1].requests_per_unit == 10
    # Together: 10 per second, and the replaced 5-per-second counter is not charged.
    for sent in range(1, 11):
        assert statuses(limiter, config, "example7", [one, two]) == (
            "OK",
            [("OK", None), ("OK", 10 - sent)],
        )
    assert statuses(limiter, config, "example7", [one, two])[0] == "OVER_LIMIT"
    assert codes(limiter, config, "example7", one, 6) == ".....X"


def test_example_8_detailed_metric(tmp_path: Path, limiter: Limiter) -> None:
    config = load(
        tmp_path,
        """
        domain: example8
        descriptors:
          - key: key1
            detailed_metric: true
            rate_limit: {unit: minute, requests_per_unit: 10}
          - key: key1
            value: value1
            rate_limit: {unit: minute, requests_per_unit: 20}
        """,
    )
    for value in ("unspecified_value", "unspecified_value2"):
        entries = [("key1", value)]
        rule = the_rule(config, "example8", entries)
        assert (rule.requests_per_unit, rule.unit, rule.detailed_metric) == (10, "MINUTE", True)
        assert rule.stat_key_for(entries) == f"example8.key1_{value}"
        assert codes(limiter, config, "example8", entries, 11) == "." * 10 + "X"
    value1 = the_rule(config, "example8", [("key1", "value1")])
    assert value1.requests_per_unit == 20
    assert value1.stat_key_for([("key1", "value1")]) == "example8.key1_value1"


def test_example_9_wildcards(tmp_path: Path, limiter: Limiter) -> None:
    config = load(
        tmp_path,
        """
        domain: example9
        descriptors:
          - key: key1
            value: value*
            rate_limit: {unit: minute, requests_per_unit: 20}
          - key: path
            value: /api/*/action
            rate_limit: {unit: minute, requests_per_unit: 21}
          - key: route
            value: /api/*/resource/*/action
            rate_limit: {unit: minute, requests_per_unit: 22}
        """,
    )
    matches = {
        ("key1", "value1"): 20,
        ("key1", "valueXYZ"): 20,
        ("key1", "value"): 20,
        ("key1", "valu"): None,
        ("path", "/api/123/action"): 21,
        ("path", "/api/user-id/action"): 21,
        ("path", "/api/123/other"): None,
        ("route", "/api/v1/resource/123/action"): 22,
        ("route", "/api/v2/resource/456/action"): 22,
        ("route", "/api/v2/resource/456"): None,
    }
    for entry, expected in matches.items():
        (found,) = config.resolve("example9", [[entry]])
        assert (found.requests_per_unit if found else None) == expected, entry
    # Each matching value keeps its own counter (no share_threshold), under one stats key.
    rule = the_rule(config, "example9", [("key1", "value1")])
    assert rule.stat_key == "example9.key1_value*"
    assert codes(limiter, config, "example9", [("key1", "value1")], 21) == "." * 20 + "X"
    assert codes(limiter, config, "example9", [("key1", "value2")], 1) == "."


BASIC = """
domain: test-domain
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
      - key: subkey1
        value: subvalue1
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key2
    value: value2
    rate_limit: {unit: minute, requests_per_unit: 30}
  # a value with neither a limit nor descriptors: whitelisted
  - key: key2
    value: value3
  - key: key4
    rate_limit: {name: key4_rate_limit, unit: day, requests_per_unit: 1}
  - key: key5
    value: value5
    rate_limit: {unit: day, requests_per_unit: 15}
    descriptors:
      - key: subkey5
        value: subvalue5
        rate_limit: {unit: day, requests_per_unit: 25}
"""


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([("key1", "something")], None),
        ([("key1", "value1")], None),  # a placeholder level without a limit
        ([("key1", "value1"), ("subkey1", "something")], (5, "SECOND", "subkey1")),
        ([("key1", "value1"), ("subkey1", "subvalue1")], (10, "SECOND", "subkey1_subvalue1")),
        ([("key2", "something")], (20, "MINUTE", "key2")),
        ([("key2", "value2")], (30, "MINUTE", "key2_value2")),
        ([("key2", "value3")], None),  # the whitelisted value
        ([("key2", "value2"), ("subkey", "subvalue")], None),
        ([("key4", "foo")], (1, "DAY", "key4")),
        ([("key5", "value5")], (15, "DAY", "key5_value5")),
        ([("key5", "value5"), ("subkey5", "subvalue5")], (25, "DAY", "subkey5_subvalue5")),
        ([("key5", "value5"), ("subkey5", "subvalue")], None),
        ([], None),
    ],
)
def test_basic_config_lookups(
    tmp_path: Path, entries: Entries, expected: tuple[int, str, str] | None
) -> None:
    config = load(tmp_path, BASIC)
    (found,) = config.resolve("test-domain", [entries])
    if expected is None:
        assert found is None
    else:
        assert found is not None
        requests, unit, last = expected
        assert (found.requests_per_unit, found.unit) == (requests, unit)
        assert found.stat_key.endswith("." + last)
    assert config.resolve("foo_domain", [entries]) == [None]


def test_basic_config_names_and_the_whitelisted_value(tmp_path: Path, limiter: Limiter) -> None:
    config = load(tmp_path, BASIC)
    assert the_rule(config, "test-domain", [("key4", "foo")]).name == "key4_rate_limit"
    assert the_rule(config, "test-domain", [("key2", "x")]).name is None
    assert codes(limiter, config, "test-domain", [("key2", "value3")], 50) == "." * 50
    assert codes(limiter, config, "test-domain", [("key2", "other")], 21) == "." * 20 + "X"


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([("noVal", "foo1")], "test-domain.noVal"),
        ([("wild", "foo1")], "test-domain.wild_foo*"),
        ([("wild", "foo")], "test-domain.wild_foo*"),
        ([("nestedWild", "val1"), ("wild", "goo2")], "test-domain.nestedWild_val1.wild_goo*"),
        ([("midWild", "barab")], "test-domain.midWild_bar*b"),
        ([("midWild", "barb")], "test-domain.midWild_bar*b"),
        ([("multiWild", "foo123bar456baz")], "test-domain.multiWild_foo*bar*baz"),
        ([("multiWild", "foobarbaz")], "test-domain.multiWild_foo*bar*baz"),
        ([("wild", "bar")], None),
        ([("noWild", "foo1")], None),  # a plain value is not a prefix
        ([("midWild", "bara")], None),
        ([("midWild", "xbarb")], None),
        ([("multiWild", "foo123baz")], None),
        ([("multiWild", "bar456baz")], None),
    ],
)
def test_wildcard_config(tmp_path: Path, entries: Entries, expected: str | None) -> None:
    config = load(
        tmp_path,
        """
        domain: test-domain
        descriptors:
          - {key: wild, value: foo*, rate_limit: {unit: minute, requests_per_unit: 20}}
          - {key: noWild, value: foo, rate_limit: {unit: minute, requests_per_unit: 20}}
          - {key: noVal, rate_limit: {unit: minute, requests_per_unit: 20}}
          - {key: midWild, value: bar*b, rate_limit: {unit: minute, requests_per_unit: 20}}
          - key: multiWild
            value: foo*bar*baz
            rate_limit: {unit: minute, requests_per_unit: 10}
          - key: nestedWild
            value: val1
            descriptors:
              - {key: wild, value: goo*, rate_limit: {unit: minute, requests_per_unit: 20}}
        """,
    )
    (found,) = config.resolve("test-domain", [entries])
    assert (found.stat_key if found else None) == expected


def test_a_limit_override_is_charged_like_upstream(tmp_path: Path, limiter: Limiter) -> None:
    """Envoy's per-descriptor ``limit``: it replaces the configured limit of the descriptor."""
    config = load(tmp_path, MESSAGING)
    number = [("to_number", "2061111111")]
    (over,) = config.resolve("messaging", [number], overrides=[(2, "SECOND")])
    assert over is not None
    assert over.policy is not None
    assert over.policy.rates == (Rate(2, 1),)
    charged = [limiter.hit(over.policy, over.identity_for(number)).allowed for _ in range(3)]
    assert charged == [True, True, False]
