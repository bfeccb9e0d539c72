"""Policies, keys, identities, costs and the public surface. Pure unit tests, no server."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import re
from collections.abc import Callable
from importlib import resources

import pytest

import ratekeeper
from ratekeeper import AsyncLimiter, ConfigError, Limiter, Policy, Rate
from ratekeeper._engine.keys import KeyBuilder

# -- Policy ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a b",
        "{x}",
        "a{b",
        "a}b",
        "x" * 200,
        "x" * 129,
        "-leading-dash",
        "_leading",
        "a\n",
        "caf\u00e9",
        "a\x00",
    ],
)
def test_policy_refuses_invalid_names(name: str) -> None:
    with pytest.raises(ConfigError, match="policy name"):
        Policy(name, "1/second")


@pytest.mark.parametrize("name", [None, 1, b"api", ["api"]])
def test_policy_refuses_non_str_names(name: object) -> None:
    with pytest.raises(ConfigError, match="policy name"):
        Policy(name, "1/second")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["a", "A9", "api", "api.v2:login/post-x_y", "x" * 128, "0"])
def test_policy_accepts_valid_names(name: str) -> None:
    assert Policy(name, "1/second").name == name


def test_policy_defaults() -> None:
    policy = Policy("api", "10/second;1000/hour")
    assert policy.algorithm == "sliding_log"
    assert policy.max_log_entries == 10_000
    assert policy.rates == (Rate(10, 1), Rate(1000, 3600))
    assert policy.max_limit == 1000
    assert policy.max_period_ms == 3_600_000


@pytest.mark.parametrize("algorithm", ["nope", "leaky_bucket", "SLIDING_LOG", "sliding-log", ""])
def test_policy_unknown_algorithm_names_the_known_ones(algorithm: str) -> None:
    with pytest.raises(ConfigError, match="sliding_log") as info:
        Policy("api", "1/second", algorithm)
    assert repr(algorithm) in str(info.value)


def test_policy_unhashable_algorithm_is_config_error() -> None:
    with pytest.raises(ConfigError, match="sliding_log"):
        Policy("api", "1/second", ["sliding_log"])  # type: ignore[arg-type]


def test_policy_invalid_rates_are_config_error() -> None:
    with pytest.raises(ConfigError, match="fortnight"):
        Policy("api", "1/fortnight")


def test_sliding_log_refuses_limit_above_max_log_entries() -> None:
    with pytest.raises(ConfigError) as info:
        Policy("big", "10001/hour")
    message = str(info.value)
    for name in ("sliding_window", "fixed_window", "gcra", "max_log_entries", "10001"):
        assert name in message
    # The largest limit counts, whichever rate holds it.
    with pytest.raises(ConfigError, match="max_log_entries"):
        Policy("big", "10/second;20000/day")


def test_sliding_log_accepts_limit_equal_to_max_log_entries() -> None:
    assert Policy("big", "10000/hour").max_limit == 10_000


def test_max_log_entries_is_configurable() -> None:
    assert Policy("big", "50000/hour", max_log_entries=50_000).max_log_entries == 50_000
    with pytest.raises(ConfigError, match="max_log_entries"):
        Policy("small", "6/second", max_log_entries=5)
    assert Policy("small", "5/second", max_log_entries=5).max_limit == 5


@pytest.mark.parametrize("value", [0, -1, True, 1.0, "10", None])
def test_max_log_entries_validation(value: object) -> None:
    with pytest.raises(ConfigError, match="max_log_entries"):
        Policy("api", "1/second", max_log_entries=value)  # type: ignore[arg-type]


def test_policy_is_frozen() -> None:
    policy = Policy("api", "1/second")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.rates = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_log_entries = 1  # type: ignore[misc]
    assert policy.name == "api"
    assert policy.rates == (Rate(1, 1),)


def test_policy_equality() -> None:
    assert Policy("api", "1/second;5/minute") == Policy("api", [Rate(5, 60), Rate(1, 1)])
    assert Policy("api", "1/second") != Policy("api", "2/second")


# -- KeyBuilder: prefixes --------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix", ["", "{x}", "a{b", "b}", "x" * 65, "a b", "caf\u00e9", None, b"rk", 1]
)
def test_key_prefix_validation(prefix: object) -> None:
    with pytest.raises(ConfigError, match="key_prefix"):
        KeyBuilder(prefix)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix", ["{rk}", "", "x" * 65])
def test_key_prefix_validation_through_limiter(prefix: str) -> None:
    with pytest.raises(ConfigError, match="key_prefix"):
        Limiter.from_url("memory://", key_prefix=prefix)


@pytest.mark.parametrize("prefix", ["a", "x" * 64, "app:rk/v1.2_x-y"])
def test_key_prefix_accepted(prefix: str) -> None:
    keys = KeyBuilder(prefix).keys("api", "alice", ("log",))
    assert keys[0].startswith(prefix + ":api:{")


def test_default_key_prefix() -> None:
    assert KeyBuilder().keys("api", "alice", ("log",))[0].startswith("ratekeeper:api:{")


# -- KeyBuilder: identities ------------------------------------------------------------------


@pytest.mark.parametrize("identity", [None, 1.0, 1.5, ["a"], ("a",), {"a": 1}, True, False])
def test_identity_type_validation(identity: object) -> None:
    with pytest.raises(ConfigError, match="identity"):
        KeyBuilder().tag("api", identity)  # type: ignore[arg-type]


@pytest.mark.parametrize("identity", [None, 1.0, ["a"], True])
def test_identity_type_validation_through_limiter(identity: object) -> None:
    policy = Policy("api", "1/second")
    with Limiter.from_url("memory://") as limiter:
        with pytest.raises(ConfigError, match="identity"):
            limiter.hit(policy, identity)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="identity"):
            limiter.peek(policy, identity)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="identity"):
            limiter.reset(policy, identity)  # type: ignore[arg-type]
        # Nothing was consumed by the refused calls.
        assert limiter.hit(policy, "ok").allowed


TAG = re.compile(r"[A-Za-z0-9_-]{22}")

CRAFTED: list[str | bytes | int] = [
    "a",
    "a\x00",
    "",
    "{",
    "}",
    "}{",
    "{}",
    "a}b{c",
    "a:b",
    "\n",
    "x" * 1_000_000,
    "x" * 1_000_001,
    "\u00e9",
    "e\u0301",
    "\U0001f600",
    "\ud800",
    b"\x00\xff",
    b"bytes-only",
    b"",  # same as "" (documented: str is its UTF-8 bytes)
    7,
    -7,
    2**64,
]


def test_every_key_has_exactly_one_hash_tag() -> None:
    builder = KeyBuilder("rk")
    for identity in CRAFTED:
        tag = builder.tag("api", identity)
        assert TAG.fullmatch(tag), tag
        for key in builder.keys("api", identity, ("log", "fw", "x")):
            assert key.count("{") == 1
            assert key.count("}") == 1
            assert key[key.index("{") + 1 : key.index("}")] == tag
            assert key.startswith(f"rk:api:{{{tag}}}:")


def test_keys_share_one_tag_across_suffixes() -> None:
    keys = KeyBuilder("rk").keys("api", "alice", ("a", "b", "c"))
    assert len({k[k.index("{") : k.index("}") + 1] for k in keys}) == 1
    assert [k.rsplit(":", 1)[1] for k in keys] == ["a", "b", "c"]


def test_distinct_identities_give_distinct_tags() -> None:
    builder = KeyBuilder()
    identities: list[str | bytes | int] = [
        "a",
        "a\x00",
        "",
        "{",
        "}",
        "}{",
        "{}",
        "a}b{c",
        "x" * 1_000_000,
        "x" * 1_000_001,
        "\u00e9",
        "e\u0301",
        "\U0001f600",
        "\ud800",
        b"\x00\xff",
        b"bytes-only",
        "str-only",
        7,
        -7,
        2**64,
        "A",
        " a",
        "a ",
    ]
    tags = [builder.tag("api", identity) for identity in identities]
    assert len(set(tags)) == len(identities)


def test_str_bytes_and_int_spellings_of_one_identity_share_a_tag() -> None:
    builder = KeyBuilder()
    assert builder.tag("api", 42) == builder.tag("api", "42")
    assert builder.tag("api", "a") == builder.tag("api", b"a")
    assert builder.tag("api", "\u00e9") == builder.tag("api", "\u00e9".encode())
    assert builder.tag("api", -1) == builder.tag("api", "-1")
    assert builder.tag("api", b"x") != builder.tag("api", "y")


def test_key_length_is_bounded() -> None:
    builder = KeyBuilder("rk")
    short = builder.keys("api", "x", ("log",))[0]
    huge = builder.keys("api", "x" * 1_000_000, ("log",))[0]
    assert len(huge) == len(short)
    assert len(short) == len("rk:api:{}:log") + 22


def test_raw_identity_never_appears_in_keys() -> None:
    key = KeyBuilder("rk").keys("api", "secret-user-token", ("log",))[0]
    assert "secret" not in key


def test_tag_depends_on_policy_name() -> None:
    builder = KeyBuilder()
    assert builder.tag("api", "alice") != builder.tag("login", "alice")
    # The name is length-prefixed: no run-together ambiguity.
    assert builder.tag("ab", "c") != builder.tag("a", "bc")
    assert builder.tag("a", "bc") != builder.tag("abc", "")
    assert builder.tag("ab", b"c") != builder.tag("a", b"bc")


def test_tag_is_deterministic_and_independent_of_prefix() -> None:
    assert KeyBuilder("one").tag("api", "alice") == KeyBuilder("two").tag("api", "alice")
    one = KeyBuilder("one").keys("api", "alice", ("log",))
    two = KeyBuilder("two").keys("api", "alice", ("log",))
    assert one != two


def test_limiter_keys_use_the_hash_tag_scheme() -> None:
    policy = Policy("api", "1/second")
    with Limiter.from_url("memory://", key_prefix="pfx") as limiter:
        keys = limiter.keys(policy, "a}b{c")
    tag = KeyBuilder("pfx").tag("api", "a}b{c")
    assert keys == (f"pfx:api:{{{tag}}}:times",)


# -- cost validation -------------------------------------------------------------------------


@pytest.mark.parametrize("cost", [0, -1, 1.5, 1.0, True, False, 2**53 + 1, "1", None])
def test_cost_validation(cost: object) -> None:
    policy = Policy("api", "5/second")
    with Limiter.from_url("memory://") as limiter:
        with pytest.raises(ConfigError, match="cost"):
            limiter.hit(policy, "alice", cost)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="cost"):
            limiter.peek(policy, "alice", cost)  # type: ignore[arg-type]
        # Nothing was consumed by the refused calls.
        assert limiter.hit(policy, "alice", 5).remaining == 0


def _raised(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("method", ["hit", "peek", "acquire", "reset", "keys"])
@pytest.mark.parametrize("not_a_policy", ["api", None])
def test_policy_must_be_a_policy(method: str, not_a_policy: object) -> None:
    # A bug once: Core.hit_call and Core.acquire_call read policy.algorithm before the call
    # checked isinstance(policy, Policy), so hit and acquire raised AttributeError.
    with Limiter.from_url("memory://") as limiter:
        raised = _raised(lambda: getattr(limiter, method)(not_a_policy, "alice"))
    assert isinstance(raised, ConfigError), (
        f"Limiter.{method}({not_a_policy!r}, ...) should raise ConfigError, "
        f"raised {type(raised).__name__}: {raised}"
    )
    assert "policy must be a Policy" in str(raised)


@pytest.mark.parametrize("method", ["hit", "peek", "acquire", "reset"])
def test_async_policy_must_be_a_policy(method: str) -> None:
    async def main() -> BaseException | None:
        async with AsyncLimiter.from_url("memory://") as limiter:
            try:
                await getattr(limiter, method)("api", "alice")
            except Exception as exc:
                return exc
        return None

    raised = asyncio.run(main())
    assert isinstance(raised, ConfigError), (
        f"AsyncLimiter.{method}('api', ...) should raise ConfigError, "
        f"raised {type(raised).__name__}: {raised}"
    )


def test_clock_must_be_callable() -> None:
    with pytest.raises(ConfigError, match="clock"):
        Limiter.from_url("memory://", clock=1_700_000_000.0)  # type: ignore[arg-type]


# -- public surface --------------------------------------------------------------------------

EXPECTED_ALL = {
    "Algorithm",
    "AutoShare",
    "AsyncLease",
    "AsyncLimiter",
    "AsyncReservation",
    "BreakerState",
    "CircuitBreaker",
    "Clock",
    "ConfigError",
    "Decision",
    "FailureMode",
    "Lease",
    "Limiter",
    "ManualClock",
    "Policy",
    "Rate",
    "RateLimited",
    "RatekeeperError",
    "RequestRejected",
    "Reservation",
    "ReservationError",
    "StorageError",
    "StorageFull",
    "StorageResponseError",
    "StorageTimeout",
    "StorageUnavailable",
    "__version__",
    "parse_rates",
}


def test_all_is_the_expected_set() -> None:
    assert set(ratekeeper.__all__) == EXPECTED_ALL
    assert len(ratekeeper.__all__) == len(EXPECTED_ALL)


def test_every_public_name_is_importable() -> None:
    module = importlib.import_module("ratekeeper")
    for name in ratekeeper.__all__:
        assert getattr(module, name) is not None
        namespace: dict[str, object] = {}
        exec(f"from ratekeeper import {name}", namespace)
        assert namespace[name] is getattr(module, name)


def test_error_hierarchy() -> None:
    assert issubclass(ratekeeper.ConfigError, ratekeeper.RatekeeperError)
    assert issubclass(ratekeeper.ConfigError, ValueError)
    for name in ("StorageTimeout", "StorageUnavailable", "StorageResponseError", "StorageFull"):
        assert issubclass(getattr(ratekeeper, name), ratekeeper.StorageError)
    assert issubclass(ratekeeper.StorageFull, ratekeeper.StorageResponseError)
    assert issubclass(ratekeeper.StorageError, ratekeeper.RatekeeperError)


def test_version_is_a_string() -> None:
    assert isinstance(ratekeeper.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", ratekeeper.__version__)


def test_package_is_typed() -> None:
    assert resources.files("ratekeeper").joinpath("py.typed").is_file()


def test_an_int_identity_too_large_to_print_is_a_config_error() -> None:
    limiter = Limiter.from_url("memory://")
    with pytest.raises(ConfigError, match="int identity"):
        limiter.hit(Policy("big", "1/second"), 10**5000)


def test_key_cache_keeps_only_short_identities_and_tells_types_apart() -> None:
    from ratekeeper._engine.keys import KEY_CACHE_SIZE, KeyBuilder

    builder = KeyBuilder("kc")
    short = builder.keys("p", "alice", ("log",))
    assert builder.keys("p", "alice", ("log",)) is short  # served from the cache
    huge = "x" * 1_000_000
    before = builder._cached.cache_info().currsize
    assert builder.keys("p", huge, ("log",)) == builder.keys("p", huge, ("log",))
    assert builder._cached.cache_info().currsize == before  # a huge identity is never kept
    assert builder.keys("p", 1, ("log",)) == builder.keys("p", "1", ("log",))
    with pytest.raises(ConfigError, match="identity must be"):
        builder.keys("p", True, ("log",))  # not served as the cached 1
    with pytest.raises(ConfigError, match="identity must be"):
        builder.keys("p", ["unhashable"], ("log",))  # type: ignore[arg-type]
    for i in range(KEY_CACHE_SIZE * 2):
        builder.keys("p", i, ("log",))
    assert builder._cached.cache_info().currsize == KEY_CACHE_SIZE  # bounded
