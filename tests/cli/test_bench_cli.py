"""``ratekeeper bench``: real (short) runs on memory:// and on the private servers, the figures
checked for sanity and exactness, bad input refused with a clear message, and the latency
histogram against exact percentiles."""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from ratekeeper import BreakerState, Policy
from ratekeeper.cli import main
from ratekeeper.cli._bench_ops import PERCENTILES, BenchConfig, LatencyHistogram, _options, redact

from ..support.servers import RedisServer

SHORT = ("--duration", "0.3", "--warmup", "0")
ALGORITHMS = ["sliding_log", "sliding_window", "fixed_window", "gcra", "token_bucket"]


def bench(*args: str) -> Result:
    return CliRunner().invoke(main, ["bench", *args])


def bench_json(*args: str) -> dict[str, Any]:
    result = bench(*SHORT, "--json", *args)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def assert_sane(data: dict[str, Any]) -> None:
    assert data["decisions"] > 0
    assert data["admitted"] + data["denied"] == data["decisions"]
    assert data["decisions_per_s"] == pytest.approx(data["decisions"] / data["duration_s"], 1e-3)
    assert data["admitted_pct"] + data["denied_pct"] == pytest.approx(100)
    assert data["errors"] == sum(data["errors_by_type"].values()) == 0
    assert data["degraded"] == 0
    latency = data["latency_us"]
    figures = [latency[label] for label in ("min", "p50", "p90", "p99", "p99.9", "max")]
    assert figures[0] > 0
    assert figures == sorted(figures)
    assert latency["min"] <= latency["mean"] <= latency["max"]
    assert data["key_prefix"].startswith("ratekeeper-bench:")


def expected_admitted(algorithm: str) -> tuple[int, int]:
    """10 keys at 5 per hour, all hit hundreds of times in 0.3 s: each admits exactly 5, but a
    fixed window may restart during the run (at most twice the limit across a boundary)."""
    return (50, 100) if algorithm == "fixed_window" else (50, 50)


# -- memory:// ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_table_shows_sane_figures(mode: str) -> None:
    result = bench(*SHORT, "--mode", mode, "--concurrency", "2", "--keys", "100")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"{mode} with 2 " in out
    assert result.stderr == ""  # no progress bar off a terminal

    def figure(label: str) -> float:
        match = re.search(rf"^\s*{re.escape(label)}\s+([\d,.]+)", out, re.MULTILINE)
        assert match is not None, f"no {label!r} row in:\n{out}"
        return float(match.group(1).replace(",", ""))

    decisions = figure("decisions")
    assert decisions > 0
    assert figure("admitted") + figure("denied") == decisions
    assert figure("decisions/s") == pytest.approx(decisions / 0.3, abs=1)
    assert figure("errors") == 0
    percentiles = [figure(f"latency {label}") for label in ("p50", "p99", "p99.9")]
    assert percentiles == sorted(percentiles)
    assert figure("latency min") <= percentiles[0] <= percentiles[-1] <= figure("latency max")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_json_run_is_exact_on_memory(mode: str, algorithm: str) -> None:
    data = bench_json(
        "--mode", mode, "--algorithm", algorithm, "--rates", "5 per hour", "--keys", "10"
    )  # fmt: skip
    assert_sane(data)
    assert (data["mode"], data["algorithm"], data["rates"]) == (mode, algorithm, ["5/hour"])
    low, high = expected_admitted(algorithm)
    assert low <= data["admitted"] <= high
    assert data["denied"] > 0
    # Cost-1 denials come from the in-process deny cache once a key has been refused.
    assert 0 < data["deny_cache_hits"] <= data["denied"]


def test_no_deny_cache_asks_the_store_every_time() -> None:
    data = bench_json("--rates", "5 per hour", "--keys", "10", "--no-deny-cache")
    assert_sane(data)
    assert data["deny_cache"] is False
    assert data["deny_cache_hits"] == 0
    assert data["admitted"] == 50


def test_cost_is_spent_per_hit() -> None:
    data = bench_json("--rates", "10 per hour", "--keys", "4", "--cost", "3", "--mode", "async")
    assert_sane(data)
    assert data["cost"] == 3
    assert data["admitted"] == 4 * 3  # three hits of 3 fit in 10, per key


def test_warmup_is_not_measured() -> None:
    # Every key is used up during the warm-up, so the measured window sees only denials.
    result = bench(
        "--duration", "0.2", "--warmup", "0.2", "--json", "--rates", "5 per hour", "--keys", "3"
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["decisions"] > 0
    assert data["admitted"] == 0
    assert data["denied"] == data["decisions"]
    assert data["latency_us"]["p50"] > 0


# -- a real server ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_run_against_a_private_server(server: RedisServer, admin: redis.Redis, mode: str) -> None:
    data = bench_json(
        "--storage", server.url, "--mode", mode, "--concurrency", "4",
        "--algorithm", "sliding_log", "--rates", "5 per hour", "--keys", "10",
        "--timeout", "2",  # a loaded test machine must not turn into errors
    )  # fmt: skip
    assert_sane(data)
    assert data["storage"] == server.url
    assert data["admitted"] == 50
    # The bench writes only under its own prefix, and every key it wrote expires on its own.
    keys = list(admin.scan_iter(match=f"{data['key_prefix']}:*", count=1000))
    assert keys
    # (the top offenders' summary of a minute is kept an hour after it: ratekeeper._engine.top)
    assert all(0 < admin.pttl(key) <= 3_661_000 for key in keys)


def test_table_against_a_private_server(server: RedisServer) -> None:
    result = bench(*SHORT, "--storage", server.url, "--timeout", "2")
    assert result.exit_code == 0, result.output
    assert server.url in result.stdout
    assert re.search(r"^\s*decisions/s\s+[1-9][\d,]*\s*$", result.stdout, re.MULTILINE)


# -- the environment ----------------------------------------------------------------------------


def test_environment_in_place_of_flags_and_a_flag_beats_it(server: RedisServer) -> None:
    env = {
        "RATEKEEPER_STORAGE_URL": server.url,
        "RATEKEEPER_ALGORITHM": "fixed_window",
        "RATEKEEPER_RATES": "5 per hour",
        "RATEKEEPER_BENCH_KEYS": "10",
        "RATEKEEPER_BENCH_MODE": "async",
        "RATEKEEPER_BENCH_CONCURRENCY": "3",
        "RATEKEEPER_BENCH_DURATION": "0.3",
        "RATEKEEPER_BENCH_WARMUP": "0",
        "RATEKEEPER_BENCH_DENY_CACHE": "false",
        "RATEKEEPER_TIMEOUT": "2",
        "RATEKEEPER_COST": "2",
        "RATEKEEPER_JSON": "1",
    }
    result = CliRunner(env=env).invoke(main, ["bench", "--algorithm", "sliding_log"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert_sane(data)
    assert (data["storage"], data["algorithm"], data["rates"]) == (
        server.url, "sliding_log", ["5/hour"]
    )  # fmt: skip
    assert (data["mode"], data["concurrency"], data["keys"], data["cost"]) == ("async", 3, 10, 2)
    assert (data["deny_cache"], data["deny_cache_hits"]) == (False, 0)
    assert data["admitted"] == 10 * 2  # two hits of cost 2 fit in 5, per key


def test_demo_reads_the_environment() -> None:
    result = CliRunner(env={"RATEKEEPER_RATES": "10/", "RATEKEEPER_DEMO_DURATION": "5"}).invoke(
        main, ["demo"]
    )
    assert_refused(result, 2, "Invalid value for '--rates'", "cannot parse rate '10/'")
    result = CliRunner(env={"RATEKEEPER_DEMO_DURATION": "0"}).invoke(main, ["demo"])
    assert_refused(result, 2, "Invalid value for '--duration'")


# -- bad input ---------------------------------------------------------------------------------


def assert_refused(result: Result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit)  # a click error, not a crash
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--rates", "10/"], ["Invalid value for '--rates'", "cannot parse rate '10/'"]),
        (["--rates", "0/second"], ["Invalid value for '--rates'"]),
        (["--algorithm", "nope"], ["Invalid value for '--algorithm'", "'nope' is not one of"]),
        (["--algorithm", "concurrency"], ["Invalid value for '--algorithm'"]),
        (["--mode", "threads"], ["Invalid value for '--mode'"]),
        (["--concurrency", "0"], ["Invalid value for '--concurrency'"]),
        (["--keys", "0"], ["Invalid value for '--keys'"]),
        (["--duration", "0.01"], ["Invalid value for '--duration'"]),
        (["--duration", "1e9"], ["Invalid value for '--duration'"]),
        (["--warmup", "-1"], ["Invalid value for '--warmup'"]),
        (["--cost", "0"], ["Invalid value for '--cost'"]),
        (["--timeout", "0"], ["Invalid value for '--timeout'"]),
        (["--timeout", "1"], ["Invalid value for '--timeout'", "not memory://"]),
        (["--storage", "ftp://example"], ["unsupported storage URL 'ftp://example'"]),
        (["--storage", "redis://127.0.0.1:notaport"], ["invalid Redis URL"]),
        (["--storage", "memory://somewhere"], ["memory:// takes no host"]),
        (
            ["--algorithm", "sliding_log", "--rates", "100000/minute"],
            ["exceeds max_log_entries", "sliding_window"],
        ),
    ],
)
def test_bad_input_is_a_usage_error(args: list[str], fragments: list[str]) -> None:
    assert_refused(bench(*SHORT, *args), 2, *fragments)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_unreachable_store_is_a_clean_error(mode: str) -> None:
    result = bench(*SHORT, "--storage", "redis://:hunter2@127.0.0.1:1", "--mode", mode)
    assert_refused(
        result, 1, "the store at redis://:***@127.0.0.1:1 failed the first call", "Unavailable"
    )
    assert "hunter2" not in result.output


def test_a_bad_url_never_shows_its_password() -> None:
    result = bench(*SHORT, "--storage", "redis://:hunter2@127.0.0.1:notaport")
    assert_refused(result, 2, "redis://:***@127.0.0.1:notaport")
    assert "hunter2" not in result.output


# -- pure parts -------------------------------------------------------------------------------


def nearest_rank(values: list[int], fraction: Fraction) -> int:
    ordered = sorted(values)
    rank = max(-(-fraction.numerator * len(ordered) // fraction.denominator), 1)
    return ordered[rank - 1]


@pytest.mark.parametrize("seed", range(5))
def test_histogram_percentiles_are_within_a_thousandth(seed: int) -> None:
    rng = random.Random(seed)
    values = [int(rng.lognormvariate(10, 2)) for _ in range(rng.randrange(1, 5000))]
    histogram = LatencyHistogram()
    halves = LatencyHistogram(), LatencyHistogram()
    for i, ns in enumerate(values):
        histogram.record(ns)
        halves[i % 2].record(ns)
    halves[0].merge(halves[1])
    for merged in (histogram, halves[0]):
        assert (merged.count, merged.min, merged.max) == (len(values), min(values), max(values))
        assert merged.total == sum(values)
        for fraction in [Fraction(0), *(f for _, f in PERCENTILES), Fraction(1)]:
            exact = nearest_rank(values, fraction)
            assert exact <= merged.percentile(fraction) <= exact + exact // 1024
            if exact < 2048:
                assert merged.percentile(fraction) == exact


def test_histogram_is_exact_for_small_values_and_refuses_when_empty() -> None:
    histogram = LatencyHistogram()
    with pytest.raises(ValueError, match="no latencies"):
        histogram.percentile(Fraction(1, 2))
    for ns in range(1, 1001):
        histogram.record(ns)
    assert histogram.percentile(Fraction(1, 2)) == 500
    assert histogram.percentile(Fraction(999, 1000)) == 999
    assert histogram.percentile(Fraction(1)) == 1000


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("memory://", "memory://"),
        ("redis://localhost:6380/0", "redis://localhost:6380/0"),
        ("redis://:pw@host:1/0", "redis://:***@host:1/0"),
        ("rediss://user:p%40ss@host:1", "rediss://user:***@host:1"),
        ("redis+sentinel://u:pw@a:1,b:2/mymaster", "redis+sentinel://u:***@a:1,b:2/mymaster"),
        ("redis://user@host:1", "redis://user@host:1"),
    ],
)
def test_redact_masks_only_the_password(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_the_breaker_never_opens_so_every_call_reaches_the_store() -> None:
    options = _options(BenchConfig("memory://", Policy("bench", "1/second")), "ratekeeper-bench:x")
    assert options["failure_mode"] == "raise"
    breaker = options["breaker"]
    for _ in range(1000):
        breaker.record(False, 1.0)  # failed and slow
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow()
