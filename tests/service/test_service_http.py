"""The service's HTTP side on a real server (uvicorn on a loopback port, the shared Redis):
POST /json with envoyproxy/ratelimit's status codes, /healthcheck, /metrics, /rlconfig; and
what a dead store does under each failure mode, over gRPC and HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from ratekeeper.service._health import STOPPING

from ..support.private_servers import private_servers
from ..support.servers import RedisServer
from ..support.service_support import OURS, running, write

CONFIG = """\
domain: web
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: api
    detailed_metric: true
    rate_limit: {unit: day, requests_per_unit: 1}
"""


@pytest.fixture
def redis_url(servers: dict[str, RedisServer]) -> str:
    return next(iter(servers.values())).url


def body(domain: str, *entries: tuple[str, str]) -> dict[str, Any]:
    return {
        "domain": domain,
        "descriptors": [{"entries": [{"key": k, "value": v} for k, v in entries]}],
    }


def test_json_on_a_kept_alive_connection_never_waits_for_a_delayed_ack(
    tmp_path: Path, redis_url: str
) -> None:
    """uvicorn writes a response's head and body apart; without TCP_NODELAY on the accepted
    socket the body waited for the client's delayed ACK: about 44 ms a call, every call."""
    config = write(tmp_path / "web.yaml", CONFIG)
    request = json.dumps(body("web", ("user", "kept-alive")))

    def sequential(port: int) -> list[float]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        took = []
        for _ in range(50):
            started = time.perf_counter()
            connection.request("POST", "/json", request, {"Content-Type": "application/json"})
            answer = connection.getresponse()
            answer.read()
            took.append(time.perf_counter() - started)
            assert answer.status in (200, 429)
        connection.close()
        return sorted(took)

    async def main() -> list[float]:
        async with running(config, redis_url) as service:
            return await asyncio.to_thread(sequential, service.http_port)

    took = asyncio.run(main())
    assert took[len(took) // 2] < 0.020, took  # the stall was 40 ms or more on every call


def test_json_endpoint(tmp_path: Path, redis_url: str) -> None:
    config = write(tmp_path / "web.yaml", CONFIG)

    async def main() -> None:
        async with running(config, redis_url) as service:
            base = f"http://127.0.0.1:{service.http_port}"
            async with httpx.AsyncClient(base_url=base) as http:
                ok = await http.post("/json", json=body("web", ("user", "u1")))
                assert ok.status_code == 200
                assert ok.headers["content-type"] == "application/json"
                data = ok.json()  # proto3 JSON: lowerCamelCase names, enum names
                assert data["overallCode"] == "OK"
                (status,) = data["statuses"]
                assert status["code"] == "OK"
                assert status["currentLimit"] == {"requestsPerUnit": 2, "unit": "HOUR"}
                assert status["limitRemaining"] == 1
                assert status["durationUntilReset"].endswith("s")
                # the original field names are accepted too
                snake = {
                    "domain": "web",
                    "descriptors": [{"entries": [{"key": "user", "value": "u1"}]}],
                    "hits_addend": 1,
                }
                assert (await http.post("/json", json=snake)).status_code == 200
                over = await http.post("/json", json=body("web", ("user", "u1")))
                assert over.status_code == 429
                assert over.json()["overallCode"] == "OVER_LIMIT"
                unknown = await http.post("/json", json=body("other", ("user", "u1")))
                assert unknown.status_code == 200
                for bad in (b"{not json", b'{"domain": 3}', b'{"nope": 1}'):
                    answer = await http.post("/json", content=bad)
                    assert answer.status_code == 400, bad
                    assert answer.text.startswith("bad request")
                no_descriptors = await http.post("/json", json={"domain": "web"})
                assert no_descriptors.status_code == 400
                assert "descriptor list must not be empty" in no_descriptors.text
                assert (await http.get("/json")).status_code == 405
                assert (await http.post("/metrics")).status_code == 405
                assert (await http.get("/nothing")).status_code == 404
                too_big = await http.post("/json", content=b" " * (1 << 20 + 1))
                assert too_big.status_code == 413

    asyncio.run(main())


def test_healthcheck_metrics_rlconfig(tmp_path: Path, redis_url: str) -> None:
    config = write(tmp_path / "web.yaml", CONFIG)

    async def main() -> None:
        async with running(config, redis_url) as service:
            base = f"http://127.0.0.1:{service.http_port}"
            async with httpx.AsyncClient(base_url=base) as http:
                health = await http.get("/healthcheck")
                assert (health.status_code, health.text) == (200, "OK")
                for _ in range(2):
                    await http.post("/json", json=body("web", ("api", "k1")))
                await http.post("/json", json=body("web", ("user", "m")))
                metrics = await http.get("/metrics")
                assert metrics.status_code == 200
                assert metrics.headers["content-type"].startswith("text/plain")
                text = metrics.text
                # decisions by domain, descriptor (detailed_metric: the value) and outcome
                assert (
                    'ratekeeper_service_decisions_total{descriptor="web.api_k1",domain="web",'
                    'outcome="ok"} 1.0' in text
                )
                assert (
                    'ratekeeper_service_decisions_total{descriptor="web.api_k1",domain="web",'
                    'outcome="over_limit"} 1.0' in text
                )
                assert (
                    'ratekeeper_service_decisions_total{descriptor="web.user",domain="web",'
                    'outcome="ok"} 1.0' in text
                )
                assert 'ratekeeper_store_latency_seconds_count{outcome="ok"}' in text
                assert 'ratekeeper_breaker_state{node=""} 0.0' in text
                assert 'ratekeeper_service_config_reloads_total{outcome="ok"} 1.0' in text
                shown = (await http.get("/rlconfig")).json()
                assert shown["sources"] == [str(config)]
                (domain,) = shown["domains"]
                assert domain["domain"] == "web"
                assert [d["key"] for d in domain["descriptors"]] == ["user", "api"]
                # while stopping (gRPC draining), the health check fails first (500, upstream's)
                await service.health.fail(STOPPING)
                draining = await http.get("/healthcheck")
                assert (draining.status_code, draining.text) == (500, "shutting down\n")

    asyncio.run(main())


#: The store timeout of the dead-store test: every call must end within it plus the machinery.
TIMEOUT = 0.25


@pytest.mark.parametrize("mode", ["raise", "open", "closed", "local"])
def test_dead_store(tmp_path: Path, mode: str) -> None:
    """raise: UNAVAILABLE (HTTP 503), so Envoy's failure_mode_deny decides; open and closed:
    the failure mode decides, counted as degraded. No call waits past the store timeout by
    more than the machinery's own time."""
    config = write(tmp_path / "web.yaml", CONFIG)
    with private_servers() as started:
        server = next(iter(started.values()))

        async def main() -> None:
            async with (
                running(config, server.url, failure_mode=mode, timeout=TIMEOUT) as service,
                grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as http,
            ):
                call = OURS.caller(channel)
                request = OURS.request("web", [("user", "dead")])
                assert (await call(request)).overall_code == OURS.code("OK")
                server.kill()
                for _ in range(3):
                    started_at = time.monotonic()
                    if mode == "raise":
                        with pytest.raises(grpc.aio.AioRpcError) as caught:
                            await call(request)
                        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                        assert "the store failed" in (caught.value.details() or "")
                    elif mode == "local":  # an in-process share: allowed or denied, answered
                        response = await call(request)
                        assert response.overall_code in (OURS.code("OK"), OURS.code("OVER_LIMIT"))
                    else:
                        response = await call(request)
                        expected = "OK" if mode == "open" else "OVER_LIMIT"
                        assert response.overall_code == OURS.code(expected)
                    assert time.monotonic() - started_at < TIMEOUT + 1.0
                answer = await http.post("/json", json=body("web", ("user", "dead")))
                expected_status = {"raise": [503], "open": [200], "closed": [429]}
                assert answer.status_code in expected_status.get(mode, [200, 429])
                text, _ = service.metrics.render()
                if mode == "raise":
                    assert b"ratekeeper_service_unavailable_total 4.0" in text
                elif mode == "local":
                    # before its first fleet count, the local share denies (see AutoShare)
                    assert b'reason="unavailable/local"} 4.0' in text
                else:
                    outcome = "degraded_ok" if mode == "open" else "degraded_over_limit"
                    line = (
                        f'ratekeeper_service_decisions_total{{descriptor="web.user",'
                        f'domain="web",outcome="{outcome}"}} 4.0'
                    )
                    assert line.encode() in text
                    assert b"ratekeeper_degraded_decisions_total" in text

        asyncio.run(main())


def test_rlconfig_is_json_of_the_loaded_config(tmp_path: Path, redis_url: str) -> None:
    config = write(tmp_path / "web.yaml", CONFIG)

    async def main() -> None:
        async with running(config, redis_url) as service:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as h:
                served = (await h.get("/rlconfig")).json()
            assert served == json.loads(json.dumps(service.decider.config.to_dict()))

    asyncio.run(main())
