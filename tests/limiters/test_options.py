"""Limiter options checked where they are given: URL errors hide passwords, the default
breaker's slow-call bound follows the store timeout the user chose, every way to build a
limiter spells out the same typed keyword-only options, and ``from_url()`` without a URL reads
``RATEKEEPER_STORAGE_URL``, then falls back to ``memory://`` with one warning a process."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from ratekeeper import AsyncLimiter, CircuitBreaker, ConfigError, Decision, Limiter, Policy
from ratekeeper._limiters.limiter import STORAGE_URL_VARIABLE
from ratekeeper._storage.memory import MemoryStorage
from ratekeeper.testing import RecordingMetrics
from ratekeeper.typing import LimiterOptions, UrlOptions

from ..support.servers import RedisServer


@pytest.mark.parametrize("make", [Limiter.from_url, AsyncLimiter.from_url])
def test_a_bad_url_error_does_not_show_the_password(make: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        make("redis://user:s3cret@127.0.0.1:notaport/0")  # type: ignore[operator]
    assert "s3cret" not in str(excinfo.value)
    assert "redis://user:***@127.0.0.1:notaport/0" in str(excinfo.value)


def test_the_default_breaker_counts_a_call_slow_only_past_the_timeout() -> None:
    with Limiter.from_url("redis://127.0.0.1:1", timeout=2.5) as patient:
        assert patient.breaker.slow_call == 2.5
    with Limiter.from_url("redis://127.0.0.1:1") as default:
        assert default.breaker.slow_call == 0.020
    mine = CircuitBreaker(slow_call=0.1)
    with Limiter.from_url("redis://127.0.0.1:1", timeout=2.5, breaker=mine) as chosen:
        assert chosen.breaker is mine
    with pytest.raises(ConfigError, match="timeout must be a positive number"):
        Limiter.from_url("redis://127.0.0.1:1", timeout=-1)


# Typed options: every way to build a limiter takes the same keyword-only options.

LIMITER_OPTIONS = (
    "key_prefix",
    "clock",
    "failure_mode",
    "local_share",
    "breaker",
    "deny_cache",
    "deny_cache_max_age",
    "metrics",
    "top_offenders",
    "top_hash_key",
)
STORE_OPTIONS = ("timeout", "connect_timeout", "max_connections", "redis_options")
BUILDERS = (Limiter.from_url, Limiter.from_client, AsyncLimiter.from_url, AsyncLimiter.from_client)


def _options(function: Callable[..., object]) -> list[inspect.Parameter]:
    """The keyword-only parameters, after the one positional (the URL, client or storage)."""
    first, *rest = inspect.signature(function).parameters.values()
    assert first.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in rest), function
    return rest


def test_every_builder_takes_the_same_typed_limiter_options() -> None:
    """The options are spelled out once, on the constructor; ``LimiterOptions`` types them
    for the builders (``**options: Unpack[LimiterOptions]``) with the same names and
    annotations, so no copy can drift."""
    constructor = _options(Limiter)
    assert [p.name for p in constructor] == list(LIMITER_OPTIONS)
    assert {p.name: p.default for p in constructor}["failure_mode"] == "open"
    assert LimiterOptions.__optional_keys__ == set(LIMITER_OPTIONS)
    typed = {name: hint.__forward_arg__ for name, hint in LimiterOptions.__annotations__.items()}
    assert typed == {p.name: p.annotation for p in constructor}
    own = {
        Limiter.from_url: (["url"], "UrlOptions"),
        AsyncLimiter.from_url: (["url", "batching"], "UrlOptions"),
        Limiter.from_client: (["client"], "LimiterOptions"),
        AsyncLimiter.from_client: (["client", "batching"], "LimiterOptions"),
    }
    for builder, (names, typed_as) in own.items():
        *params, options = inspect.signature(builder).parameters.values()
        assert [p.name for p in params] == names, builder
        assert options.kind is inspect.Parameter.VAR_KEYWORD, builder
        assert options.annotation == f"Unpack[{typed_as}]", builder
    assert UrlOptions.__optional_keys__ == {*LIMITER_OPTIONS, *STORE_OPTIONS}
    assert inspect.signature(Limiter.from_url).parameters["url"].default is None


def test_the_builders_pass_every_option_on() -> None:
    clock = lambda: 1_700_000_000.0  # noqa: E731
    breaker = CircuitBreaker(slow_call=0.5)
    given: dict[str, Any] = {
        "key_prefix": "mine",
        "clock": clock,
        "failure_mode": "closed",
        "local_share": 0.5,
        "breaker": breaker,
        "deny_cache": 7,
        "deny_cache_max_age": 2.0,
        "metrics": RecordingMetrics(),
    }
    for limiter in (
        Limiter.from_url("memory://", **given),
        AsyncLimiter.from_url("memory://", **given),
    ):
        guard = limiter._guard
        assert limiter.keys(Policy("p", "1/second"), "a")[0].startswith("mine:")
        assert limiter._core.clock is clock
        assert (guard.failure_mode, guard.local_share, guard.breaker) == ("closed", 0.5, breaker)
        assert guard._deny is not None
        assert (guard._deny.size, guard._deny.max_age_us) == (7, 2_000_000)
        assert guard.metrics is given["metrics"]


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: Limiter.from_url("memory://", failur_mode="open"), "Limiter.from_url"),
        (lambda: AsyncLimiter.from_url(failur_mode="open"), "AsyncLimiter.from_url"),
        (lambda: Limiter(MemoryStorage(), failur_mode="open"), "LimiterBase.__init__"),
        (
            lambda: AsyncLimiter.from_client(object(), failur_mode="open"),
            "AsyncLimiter.from_client",
        ),
        (lambda: Limiter.from_client(object(), failur_mode="open"), "Limiter.from_client"),
    ],
)
def test_an_unknown_option_is_refused_by_name(build: Callable[[], object], named: str) -> None:
    with pytest.raises(TypeError) as excinfo:
        build()
    message = str(excinfo.value)  # newer Pythons may add: Did you mean 'failure_mode'?
    assert message.startswith(f"{named}() got an unexpected keyword argument 'failur_mode'")


def test_from_client_takes_the_limiter_options_and_leaves_the_client_open(
    server: RedisServer, key_prefix: str
) -> None:
    policy = Policy("own", "2/minute")
    with server.client() as client:
        with Limiter.from_client(client, key_prefix=key_prefix, failure_mode="raise") as limiter:
            assert [limiter.hit(policy, "a").allowed for _ in range(3)] == [True, True, False]
            keys = limiter.keys(policy, "a")
        assert all(key.startswith(f"{key_prefix}:") for key in keys)
        assert client.exists(*keys) == len(keys)  # closed, the limiter left the client usable


def test_a_store_option_is_refused_where_no_store_takes_it() -> None:
    with pytest.raises(ConfigError, match=r"unknown option\(s\) for memory://: timeout"):
        Limiter.from_url("memory://", timeout=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
        Limiter.from_client(object(), timeout=1.0)  # type: ignore[call-arg]


@pytest.mark.parametrize("url", ["memory://", "redis://127.0.0.1:1/0"])
def test_a_bad_value_is_still_a_config_error_naming_it(url: str) -> None:
    for build in (Limiter.from_url, AsyncLimiter.from_url):
        with pytest.raises(ConfigError, match="failure_mode 'opne' is unknown"):
            build(url, failure_mode="opne")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="local_share"):
            build(url, local_share=0)
    with pytest.raises(ConfigError, match="unknown algorithm 'slidinglog'"):
        Policy("p", "1/s", algorithm="slidinglog")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="failure_mode 'closd' is unknown"):
        Policy("p", "1/s", failure_mode="closd")  # type: ignore[arg-type]


# Configuration from the environment: from_url() without a URL.


def test_from_url_without_a_url_opens_the_store_the_environment_names(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch, key_prefix: str
) -> None:
    monkeypatch.setenv(STORAGE_URL_VARIABLE, server.url)
    policy = Policy("env", "3/minute")
    options: dict[str, Any] = {"key_prefix": key_prefix, "failure_mode": "raise", "timeout": 5.0}
    with Limiter.from_url(**options) as limiter, server.client() as admin:
        assert limiter.hit(policy, "alice").remaining == 2
        keys = limiter.keys(policy, "alice")
        assert admin.exists(*keys) == len(keys)  # the count is on the server

    async def main() -> Decision:
        async with AsyncLimiter.from_url(**options) as limiter:
            return await limiter.hit(policy, "alice")

    assert asyncio.run(main()).remaining == 1  # the same server, the same count


def test_a_url_given_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STORAGE_URL_VARIABLE, "redis://127.0.0.1:1/0")  # nothing listens
    with Limiter.from_url("memory://", failure_mode="raise") as limiter:
        assert limiter.hit(Policy("p", "1/minute"), "a").allowed


_FALLBACK = """\
import asyncio, logging
from ratekeeper import AsyncLimiter, Limiter, Policy

logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
policy = Policy("p", "1/minute")
for _ in range(3):
    with Limiter.from_url(failure_mode="raise") as limiter:
        assert limiter.hit(policy, "a").allowed  # a new memory store each time
asyncio.run(AsyncLimiter.from_url().close())
print("done")
"""


@pytest.mark.parametrize("variable", [None, ""], ids=["unset", "empty"])
def test_without_a_url_or_variable_memory_is_used_with_one_warning_a_process(
    variable: str | None,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != STORAGE_URL_VARIABLE}
    if variable is not None:
        env[STORAGE_URL_VARIABLE] = variable
    result = subprocess.run(
        [sys.executable, "-c", _FALLBACK],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout == "done\n"
    assert result.stderr.splitlines() == [
        "WARNING ratekeeper: ratekeeper: no storage URL given and RATEKEEPER_STORAGE_URL is "
        "not set: using memory://, whose limits are per process (each process admits the "
        "whole limit)"
    ]
