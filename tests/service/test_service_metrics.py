"""The service's metrics under ours and envoyproxy/ratelimit's names (as its Prometheus sink
names them), upstream's near_limit accounting, its LIMIT_RESPONSE_HEADERS_ENABLED headers, and
one /metrics view across ``--workers 2``: 100 decisions spread over both workers add up to 100
in one scrape, under both names."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ratekeeper.service._upstream import (
    hit_counts,
    near_limit_threshold,
    sanitize_stat_name,
    upstream_series,
)

from ..support.private_servers import private_servers
from ..support.servers import RedisServer, free_port
from ..support.service_support import OURS, SCRIPT, STORE_TIMEOUT, running, serve_process, write

CONFIG = """\
domain: api
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: path
    value: /login
    descriptors:
      - key: ip
        detailed_metric: true
        rate_limit: {unit: hour, requests_per_unit: 3}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: blocked
    rate_limit: {unit: hour, requests_per_unit: 0}
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and labels."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


@pytest.fixture
def redis_url(servers: dict[str, RedisServer]) -> str:
    return next(iter(servers.values())).url


# -- upstream's accounting and names, pure ------------------------------------------------------


def test_near_limit_threshold_in_float32() -> None:
    assert near_limit_threshold(10, 0.8) == 8
    assert near_limit_threshold(100, 0.8) == 80
    assert near_limit_threshold(1000, 0.05) == 50
    assert near_limit_threshold(3, 0.8) == 2
    # float32: 0.7 is 0.699999988..., times 10 rounds to 7.0 in float32 (6.99999988 in double)
    assert near_limit_threshold(10, 0.7) == 7
    assert near_limit_threshold(5, 0.0) == 0
    assert near_limit_threshold(5, 1.0) == 5


@pytest.mark.parametrize(
    ("used_before", "hits", "shadow", "expected"),
    [
        (0, 1, False, (1, 0, 0, 0)),  # within, not near (after 1 <= 8)
        (7, 1, False, (1, 0, 0, 0)),  # after 8: not past the threshold
        (8, 1, False, (1, 1, 0, 0)),  # after 9: near
        (6, 3, False, (3, 1, 0, 0)),  # 7, 8, 9: only the last is past 8
        (9, 1, False, (1, 1, 0, 0)),  # the 10th: within, near
        (10, 1, False, (0, 0, 1, 0)),  # full already: all over
        (10, 4, True, (0, 0, 4, 4)),  # shadow repeats over_limit
        (7, 5, False, (0, 2, 2, 0)),  # 8..12: 9 and 10 near, 11 and 12 over
        (9, 3, True, (0, 1, 2, 2)),
    ],
)
def test_hit_counts_as_upstream(
    used_before: int, hits: int, shadow: bool, expected: tuple[int, int, int, int]
) -> None:
    assert hit_counts(10, used_before, hits, 8, shadow) == expected


def test_upstream_series_as_its_prometheus_sink_maps_them() -> None:
    # upstream's own sink tests (src/stats/prom/prometheus_sink_test.go)
    assert upstream_series("ratelimit.service.rate_limit.domain1.key1_val1.over_limit") == (
        "ratelimit_service_rate_limit_over_limit",
        {"domain": "domain1", "key1": "key1_val1"},
    )
    deep = "ratelimit.service.rate_limit.domain1.key3_val3.key4_val4.key5_val5.over_limit"
    assert upstream_series(deep) == (
        "ratelimit_service_rate_limit_over_limit",
        {"domain": "domain1", "key1": "key3_val3", "key2": "key4_val4"},
    )
    assert upstream_series("ratelimit.service.rate_limit.mongo_cps.database_users.total_hits") == (
        "ratelimit_service_rate_limit_total_hits",
        {"domain": "mongo_cps", "key1": "database_users"},
    )
    assert upstream_series("ratelimit_server.ShouldRateLimit.total_requests") == (
        "ratelimit_service_total_requests",
        {"grpc_method": "ShouldRateLimit"},
    )
    assert upstream_series("ratelimit.service.call.should_rate_limit.redis_error") == (
        "ratelimit_service_should_rate_limit_error",
        {"err_type": "redis_error"},
    )
    assert upstream_series("ratelimit.service.config_load_success") == (
        "ratelimit_service_config_load_success",
        {},
    )
    # unmapped: statsd_exporter's escaped name
    assert upstream_series("ratelimit.service.rate_limit.my-app.domain_not_found") == (
        "ratelimit_service_rate_limit_my_app_domain_not_found",
        {},
    )
    # upstream's SanitizeStatName: statsd separators, and an IPv4 address's dots
    assert sanitize_stat_name("api.ip_10.0.0.1.a:b|c") == "api.ip_10_0_0_1.a_b_c"


# -- one worker, in process -------------------------------------------------------------------


async def _exercise(config: Path, redis_url: str) -> tuple[list[Any], dict[str, Any], Samples]:
    """One worker in process, with upstream's headers under other names: 12 calls for one
    user (limit 10), a detailed_metric rule hit by 2 then 3, a shadow rule, a rule of 0, an
    unknown domain, a refused request, one /json call; the gRPC responses, the /json answer
    and the scrape."""
    async with running(
        config,
        redis_url,
        limit_response_headers=True,
        limit_header_names=("X-Limit", "X-Remaining", "X-Reset"),
    ) as service:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
            call = OURS.caller(channel)
            responses = [await call(OURS.request("api", [("user", "bob")])) for _ in range(12)]
            # 3 hits when 1 is left of 3: 1 near (floor(3 * 0.8) = 2), 2 over
            login = [("path", "/login"), ("ip", "10.0.0.1")]
            await call(OURS.request("api", login, hits_addend=2))
            await call(OURS.request("api", login, hits_addend=3))
            await call(OURS.request("api", [("shadow", "x")], hits_addend=2))
            await call(OURS.request("api", [("blocked", "y")]))
            await call(OURS.request("elsewhere", [("user", "bob")], [("user", "eve")]))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(OURS.request("", [("user", "bob")]))
            assert refused.value.code() == grpc.StatusCode.UNKNOWN
        base = f"http://127.0.0.1:{service.http_port}"
        async with httpx.AsyncClient(base_url=base) as http:
            entries = [{"key": "user", "value": "ann"}]
            answered = await http.post("/json", json={"domain": "api", "descriptors": [
                {"entries": entries}]})  # fmt: skip
            text = (await http.get("/metrics")).text
        return responses, answered.json(), parse(text)


def _headers(response: Any) -> dict[str, str]:
    return {header.key: header.value for header in response.response_headers_to_add}


def test_limit_response_headers(tmp_path: Path, redis_url: str) -> None:
    """Upstream's LIMIT_RESPONSE_HEADERS_ENABLED headers: the limit, what is left, and the
    reset as the status's duration_until_reset says it (what Envoy reads too)."""
    config = write(tmp_path / "api.yaml", CONFIG)
    responses, answered, _ = asyncio.run(_exercise(config, redis_url))
    first, last = responses[0], responses[11]
    reset = first.statuses[0].duration_until_reset.seconds
    assert 1 <= reset <= 3600  # a fixed window of an hour, aligned to the epoch
    assert _headers(first) == {"X-Limit": "10", "X-Remaining": "9", "X-Reset": str(reset)}
    assert last.overall_code == OURS.code("OVER_LIMIT")
    over_reset = last.statuses[0].duration_until_reset.seconds
    assert _headers(last) == {"X-Limit": "10", "X-Remaining": "0", "X-Reset": str(over_reset)}
    shown = {h["key"]: h["value"] for h in answered["responseHeadersToAdd"]}
    assert (shown["X-Limit"], shown["X-Remaining"]) == ("10", "9")


def test_ours_and_upstreams_names(tmp_path: Path, redis_url: str) -> None:
    config = write(tmp_path / "api.yaml", CONFIG)
    _, _, samples = asyncio.run(_exercise(config, redis_url))
    ours = {"domain": "api", "descriptor": "api.user"}
    decisions = "ratekeeper_service_decisions_total"
    assert value(samples, decisions, **ours, outcome="ok") == 11  # 10 over gRPC, 1 over HTTP
    assert value(samples, decisions, **ours, outcome="over_limit") == 2
    kinds = ("total_hits", "within_limit", "near_limit", "over_limit", "shadow_mode")
    hits = {kind: value(samples, "ratekeeper_service_hits_total", **ours, kind=kind)
            for kind in kinds}  # fmt: skip
    assert hits == {"total_hits": 13, "within_limit": 11, "near_limit": 2, "over_limit": 2,
                    "shadow_mode": 0}  # fmt: skip
    assert value(samples, "ratekeeper_service_domain_not_found_total", domain="elsewhere") == 2
    durations = "ratekeeper_service_request_duration_seconds_count"
    assert value(samples, durations, method="ShouldRateLimit") == 18
    assert value(samples, durations, method="/json") == 1
    errors = "ratekeeper_service_request_errors_total"
    assert value(samples, errors, method="ShouldRateLimit", error="refused") == 1

    def up(stat: str, **labels: str) -> float:
        return value(samples, f"ratelimit_service_rate_limit_{stat}", **labels)

    user = {"domain": "api", "key1": "user"}
    assert up("total_hits", **user) == 13  # 12 over gRPC, 1 over HTTP
    assert (up("within_limit", **user), up("near_limit", **user)) == (11, 2)
    assert up("over_limit", **user) == 2
    # detailed_metric: the values, the IPv4 address's dots sanitized, deeper levels in key2
    login = {"domain": "api", "key1": "path_/login", "key2": "ip_10_0_0_1"}
    assert (up("total_hits", **login), up("within_limit", **login)) == (5, 2)
    assert (up("near_limit", **login), up("over_limit", **login)) == (1, 2)
    shadow = {"domain": "api", "key1": "shadow"}
    assert (up("within_limit", **shadow), up("near_limit", **shadow)) == (0, 1)
    assert (up("over_limit", **shadow), up("shadow_mode", **shadow)) == (1, 1)
    blocked = {"domain": "api", "key1": "blocked"}
    assert (up("total_hits", **blocked), up("over_limit", **blocked)) == (1, 1)
    assert value(samples, "ratelimit_service_rate_limit_elsewhere_domain_not_found") == 2
    assert value(samples, "ratelimit_service_config_load_success") == 1
    error = "ratelimit_service_should_rate_limit_error"
    assert value(samples, error, err_type="service_error") == 1
    grpc_method = {"grpc_method": "ShouldRateLimit"}
    assert value(samples, "ratelimit_service_total_requests", **grpc_method) == 18
    assert value(samples, "ratelimit_service_response_time_seconds_count", **grpc_method) == 18
    bucket = "ratelimit_service_response_time_seconds_bucket"
    assert value(samples, bucket, **grpc_method, le="10.0") == 18
    assert value(samples, bucket, **grpc_method, le="+Inf") == 18


# -- workers ------------------------------------------------------------------------------------

FLEET = """\
domain: fleet
descriptors:
  - key: user
    rate_limit: {unit: day, requests_per_unit: 1000}
"""

DECISION = {"domain": "fleet", "descriptors": [{"entries": [{"key": "user", "value": "u"}]}]}


def _worker_of(client: httpx.Client) -> str:
    """The pid of the worker that owns ``client``'s one kept-alive connection."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "ratekeeper_service_worker_info":  # the text parser keeps _info
            (sample,) = family.samples
            return sample.labels["pid"]
    raise AssertionError("no ratekeeper_service_worker_info in the scrape")


@contextlib.contextmanager
def _one_connection_per_worker(base: str, workers: int) -> Iterator[dict[str, httpx.Client]]:
    """A client of one kept-alive connection on each worker, by pid: connections are opened
    until each worker holds one (the kernel picks a worker per connection, at random)."""
    clients: list[httpx.Client] = []
    pinned: dict[str, httpx.Client] = {}
    try:
        for _ in range(200):
            client = httpx.Client(base_url=base, limits=httpx.Limits(max_connections=1))
            clients.append(client)
            pinned.setdefault(_worker_of(client), client)
            if len(pinned) == workers:
                break
        assert len(pinned) == workers, f"200 connections reached {len(pinned)} worker(s)"
        yield pinned
    finally:
        for client in clients:
            client.close()


async def _grpc_calls(port: int, calls: int) -> None:
    """``calls`` decisions over gRPC, each on a connection of its own (any worker)."""
    for _ in range(calls):
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            response = await OURS.caller(channel)(OURS.request("fleet", [("user", "u")]))
            assert response.overall_code == OURS.code("OK")


def _assert_the_whole_fleet(samples: Samples, pids: set[str]) -> None:
    ours = {"domain": "fleet", "descriptor": "fleet.user"}
    assert value(samples, "ratekeeper_service_decisions_total", **ours, outcome="ok") == 100
    assert value(samples, "ratekeeper_service_hits_total", **ours, kind="total_hits") == 100
    up = {"domain": "fleet", "key1": "user"}
    assert value(samples, "ratelimit_service_rate_limit_total_hits", **up) == 100
    assert value(samples, "ratelimit_service_rate_limit_within_limit", **up) == 100
    # floor(1000 * 0.05) = 50: the 51st to the 100th hit, whichever worker decided it
    assert value(samples, "ratelimit_service_rate_limit_near_limit", **up) == 50
    durations = "ratekeeper_service_request_duration_seconds_count"
    assert value(samples, durations, method="/json") == 80
    assert value(samples, durations, method="ShouldRateLimit") == 20
    grpc_method = {"grpc_method": "ShouldRateLimit"}
    assert value(samples, "ratelimit_service_total_requests", **grpc_method) == 20
    assert value(samples, "ratelimit_service_config_load_success") == 2  # one per worker
    # the limiter's gauges stay per worker, with a pid label
    breaker = [labels for name, labels in samples if name == "ratekeeper_breaker_state"]
    assert {dict(labels)["pid"] for labels in breaker} == pids


def test_one_view_across_two_workers(tmp_path: Path) -> None:
    """100 decisions: 40 on a connection each worker holds (so both decide, deterministically)
    and 20 over gRPC on connections of their own. One scrape, on either worker, counts them
    all under ours and upstream's names. The workers' directory is private and removed; the
    user's PROMETHEUS_MULTIPROC_DIR gets nothing."""
    config = write(tmp_path / "fleet.yaml", FLEET)
    user_dir = tmp_path / "users-own-multiproc"
    user_dir.mkdir()
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(user_dir), "TMPDIR": str(temp)}
    with private_servers() as started:
        redis_url = next(iter(started.values())).url
        grpc_port, http_port = free_port(), free_port()
        with serve_process(
            "--config", str(config), "--storage", redis_url, "--host", "127.0.0.1",
            "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--workers", "2",
            "--timeout", str(STORE_TIMEOUT), "--near-limit-ratio", "0.05", env=env,
        ) as server:  # fmt: skip
            server.wait_for("ready", count=2)
            (private,) = temp.iterdir()  # the workers' directory, made by the parent
            assert private.name.startswith("ratekeeper-serve-metrics-")
            with _one_connection_per_worker(f"http://127.0.0.1:{http_port}", 2) as pinned:
                for pid, client in pinned.items():
                    for _ in range(40):
                        assert client.post("/json", json=DECISION).status_code == 200
                    assert _worker_of(client) == pid  # the same connection, the same worker
                asyncio.run(_grpc_calls(grpc_port, 20))
                scrapes = {
                    pid: parse(client.get("/metrics").text) for pid, client in pinned.items()
                }
            assert sorted(os.listdir(private))  # the workers' counts, while they run
            assert server.stop() == 0
        assert not private.exists()  # removed by the parent
        assert list(user_dir.iterdir()) == []  # nothing leaked into the user's directory
    for samples in scrapes.values():  # each worker's scrape: the same, whole view
        _assert_the_whole_fleet(samples, set(scrapes))


def test_one_worker_keeps_the_users_multiproc_dir_untouched(tmp_path: Path) -> None:
    config = write(tmp_path / "fleet.yaml", FLEET)
    user_dir = tmp_path / "users-own-multiproc"
    user_dir.mkdir()
    http_port = free_port()
    with serve_process(
        "--config", str(config), "--storage", "memory://", "--host", "127.0.0.1",
        "--grpc-port", "0", "--http-port", str(http_port),
        env={"PROMETHEUS_MULTIPROC_DIR": str(user_dir)},
    ) as server:  # fmt: skip
        server.wait_for("ready")
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}") as client:
            for _ in range(3):
                client.post("/json", json=DECISION)
            samples = parse(client.get("/metrics").text)
    assert total(samples, "ratelimit_service_rate_limit_total_hits", domain="fleet") == 3
    assert list(user_dir.iterdir()) == []


def test_a_bad_header_name_is_refused() -> None:
    done = subprocess.run(
        [SCRIPT, "serve", "--check", ".", "--limit-reset-header", "Rate Limit"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--limit-reset-header" in done.stderr
    assert "'Rate Limit' is not a header name" in done.stderr


def test_upstreams_environment_variables(tmp_path: Path) -> None:
    """LIMIT_RESPONSE_HEADERS_ENABLED, LIMIT_RESET_HEADER and NEAR_LIMIT_RATIO, as upstream's
    deployments set them."""
    config = write(tmp_path / "fleet.yaml", FLEET)
    http_port = free_port()
    env = {"LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_RESET_HEADER": "X-Reset",
           "NEAR_LIMIT_RATIO": "0.0"}  # fmt: skip
    with serve_process(
        "--config", str(config), "--storage", "memory://", "--host", "127.0.0.1",
        "--grpc-port", "0", "--http-port", str(http_port), env=env,
    ) as server:  # fmt: skip
        server.wait_for("ready")
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}") as client:
            answered = client.post("/json", json=DECISION).json()
            samples = parse(client.get("/metrics").text)
    shown = {h["key"]: h["value"] for h in answered["responseHeadersToAdd"]}
    assert (shown["RateLimit-Limit"], shown["RateLimit-Remaining"]) == ("1000", "999")
    assert shown["X-Reset"] == answered["statuses"][0]["durationUntilReset"].rstrip("s")
    up = {"domain": "fleet", "key1": "user"}
    assert value(samples, "ratelimit_service_rate_limit_near_limit", **up) == 1  # ratio 0
