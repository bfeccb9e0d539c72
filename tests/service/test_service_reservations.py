"""Reservations over ``ratekeeper serve``'s HTTP API (``POST /reserve``, ``POST /settle``) on
real servers: reserve, settle, cancel; a request refused as a whole holds nothing; a forged,
altered, expired or replayed token is refused, and one whose rule is gone; a token settles on
another service instance and on another worker; and the whole of it from ``curl`` alone against
a ``ratekeeper serve`` process. Then ``charge_over_limit`` over gRPC, as Envoy's
``apply_on_stream_done`` uses it."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from ratekeeper.service._loader import load_config
from ratekeeper.service._tokens import Tokens

from ..support.servers import RedisServer, free_port
from ..support.service_support import (
    OFFICIAL,
    OURS,
    SCRIPT,
    STORE_TIMEOUT,
    Stubs,
    running,
    serve_process,
    write,
)

CONFIG = """\
domain: llm
descriptors:
  - key: tokens
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: slog
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: sliding_log}
  - key: tight
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: free
    rate_limit: {unlimited: true}
"""

KEY = "a-shared-secret-of-32-characters"


@pytest.fixture
def redis_url(servers: dict[str, RedisServer]) -> str:
    return next(iter(servers.values())).url


def request(*descriptors: tuple[str, str, int | None], hits: int = 0) -> dict[str, Any]:
    """A /json or /reserve body: descriptors as (key, value, their own hits_addend or None)."""
    body: dict[str, Any] = {"domain": "llm", "descriptors": []}
    for key, value, own in descriptors:
        descriptor: dict[str, Any] = {"entries": [{"key": key, "value": value}]}
        if own is not None:
            descriptor["hits_addend"] = own
        body["descriptors"].append(descriptor)
    if hits:
        body["hits_addend"] = hits
    return body


def remaining(answer: httpx.Response, index: int = 0) -> int:
    return int(answer.json()["statuses"][index].get("limitRemaining", 0))


async def peek(http: httpx.AsyncClient, key: str, value: str) -> int:
    answer = await http.post("/json", json=request((key, value, 0)))
    assert answer.status_code == 200, answer.text
    return remaining(answer)


def test_reserve_settle_and_cancel(tmp_path: Path, redis_url: str) -> None:
    config = write(tmp_path / "llm.yaml", CONFIG)

    async def main() -> None:
        async with (
            running(config, redis_url) as service,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as http,
        ):
            for key in ("tokens", "slog"):
                # reserve 5 of 10, then settle 8: 2 left
                reserved = await http.post("/reserve", json=request((key, "u1", None), hits=5))
                assert reserved.status_code == 200, reserved.text
                assert reserved.headers["content-type"] == "application/json"
                data = reserved.json()
                assert data["overallCode"] == "OK"
                (status,) = data["statuses"]
                assert status["code"] == "OK"
                assert status["limitRemaining"] == 5
                assert status["currentLimit"]["requestsPerUnit"] == 10
                token = status["reservation"]
                settled = await http.post("/settle", json={"reservation": token, "actual": 8})
                assert settled.status_code == 200, settled.text
                assert settled.json()["overallCode"] == "OK"
                assert remaining(settled) == 2
                assert await peek(http, key, "u1") == 2
                # a token settles once, whichever way
                for again in ({"actual": 1}, {"cancel": True}):
                    replay = await http.post("/settle", json={"reservation": token, **again})
                    assert replay.status_code == 409, replay.text
                    assert "settled or cancelled already" in replay.text
                # reserve the last 2 and cancel: 2 left again
                last = await http.post("/reserve", json=request((key, "u1", 2)))
                assert remaining(last) == 0
                cancel = {"reservation": last.json()["statuses"][0]["reservation"], "cancel": True}
                cancelled = await http.post("/settle", json=cancel)
                assert cancelled.status_code == 200, cancelled.text
                assert remaining(cancelled) == 2
                # over the limit: 429 as /json, and no token
                over = await http.post("/reserve", json=request((key, "u1", 3)))
                assert over.status_code == 429
                assert over.json()["overallCode"] == "OVER_LIMIT"
                assert "reservation" not in over.json()["statuses"][0]
                # a settle above the estimate charges past the limit; the answer says so
                small = await http.post("/reserve", json=request((key, "u1", 1)))
                token = small.json()["statuses"][0]["reservation"]
                past = await http.post("/settle", json={"reservation": token, "actual": 5})
                assert past.status_code == 200  # settled; the body says a next unit won't fit
                assert past.json()["statuses"][0]["code"] == "OVER_LIMIT"
                assert past.json()["overallCode"] == "OVER_LIMIT"

    asyncio.run(main())


def test_several_descriptors_and_what_reserve_refuses(tmp_path: Path, redis_url: str) -> None:
    config = write(tmp_path / "llm.yaml", CONFIG)

    async def main() -> None:
        async with (
            running(config, redis_url) as service,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as http,
        ):
            # several descriptors: one token each that the store holds; none for a peek, an
            # unlimited rule, or a descriptor no rule matches
            mixed = await http.post(
                "/reserve",
                json=request(
                    ("tokens", "u2", 4), ("slog", "u2", 0), ("free", "x", 3), ("nothing", "y", 1)
                ),
            )
            assert mixed.status_code == 200, mixed.text
            statuses = mixed.json()["statuses"]
            assert ["reservation" in status for status in statuses] == [True, False, False, False]
            assert await peek(http, "tokens", "u2") == 6

            # Envoy's limit override: the token carries it, the settle applies it again
            body = request(("tokens", "u7", 15))
            body["descriptors"][0]["limit"] = {"requests_per_unit": 20, "unit": "MINUTE"}
            reserved = await http.post("/reserve", json=body)
            assert reserved.status_code == 200, reserved.text
            assert remaining(reserved) == 5
            token = reserved.json()["statuses"][0]["reservation"]
            settled = await http.post("/settle", json={"reservation": token, "actual": 1})
            assert (settled.status_code, remaining(settled)) == (200, 19), settled.text
            assert settled.json()["statuses"][0]["currentLimit"]["requestsPerUnit"] == 20

            # one descriptor refused: the request holds nothing (what it reserved is cancelled)
            assert (await http.post("/json", json=request(("tight", "u3", 1)))).status_code == 200
            refused = await http.post(
                "/reserve", json=request(("tokens", "u3", 4), ("tight", "u3", 1))
            )
            assert refused.status_code == 429
            statuses = refused.json()["statuses"]
            assert [status["code"] for status in statuses] == ["OK", "OVER_LIMIT"]
            assert all("reservation" not in status for status in statuses)
            assert statuses[0]["limitRemaining"] == 10  # what is left after the cancel
            assert await peek(http, "tokens", "u3") == 10

            # /reserve takes what /json takes, and refuses what it refuses, alike
            for bad in (b"{not json", b'{"domain": 3}', b'{"nope": 1}', b'{"domain": "llm"}'):
                answers = [await http.post(path, content=bad) for path in ("/json", "/reserve")]
                assert {answer.status_code for answer in answers} == {400}, bad
                assert answers[0].text == answers[1].text
                assert answers[0].text.startswith("bad request")
            for path in ("/reserve", "/settle"):
                assert (await http.get(path)).status_code == 405
                assert (await http.post(path, content=b" " * (1 << 20 + 1))).status_code == 413

    asyncio.run(main())


def _altered(token: str) -> str:
    """The token with its payload's estimate raised: what a client would try."""
    payload, mac = token.split(".")
    data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    data["n"] = 1000
    raw = json.dumps(data, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode() + "." + mac


def test_bad_settles_are_refused(tmp_path: Path, redis_url: str) -> None:
    config = write(tmp_path / "llm.yaml", CONFIG)

    async def main() -> None:
        async with (
            running(config, redis_url, reservation_key=KEY) as service,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as http,
        ):

            async def reserve(value: str, hits: int = 3) -> str:
                answer = await http.post("/reserve", json=request(("tokens", value, hits)))
                assert answer.status_code == 200, answer.text
                return str(answer.json()["statuses"][0]["reservation"])

            token = await reserve("u1")
            malformed: list[Any] = [
                b"{not json",
                b"[" * 100_000 + b"]" * 100_000,  # deeper than the JSON parser recurses
                b'{"reservation": ' + b"[" * 100_000,
                [token, 1],
                {"actual": 1},
                {"reservation": "", "actual": 1},
                {"reservation": 7, "actual": 1},
                {"reservation": token},
                {"reservation": token, "actual": 1, "cancel": True},
                {"reservation": token, "cancel": "yes"},
                {"reservation": token, "cancel": False},
                {"reservation": token, "actual": -1},
                {"reservation": token, "actual": 1.5},
                {"reservation": token, "actual": True},
                {"reservation": token, "actual": "3"},
                {"reservation": token, "actual": 2**53 + 1},
                {"reservation": token, "actual": 1, "extra": 1},
                {"reservation": "not a token", "actual": 1},
                {"reservation": "a.b.c", "actual": 1},
                {"reservation": "*.*", "actual": 1},
            ]
            for body in malformed:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                answer = await http.post("/settle", content=content)
                assert answer.status_code == 400, (body, answer.text)
                assert answer.text.startswith("bad request: "), answer.text
                assert answer.headers["content-type"].startswith("text/plain")
            # altered: its mac no longer verifies; forged: signed with another key
            forged = Tokens(b"another key of the same length!!").issue(
                "llm", [("tokens", "u1")], None, "anything", 5, None
            )
            flipped = token[:-2] + ("AA" if token[-2:] != "AA" else "BB")
            for fake in (_altered(token), forged, flipped):
                answer = await http.post("/settle", json={"reservation": fake, "actual": 0})
                assert answer.status_code == 403, answer.text
                assert "does not verify" in answer.text
            assert await peek(http, "tokens", "u1") == 7  # nothing was refunded
            # the genuine token still settles (every refusal above came before the store)
            answer = await http.post("/settle", json={"reservation": token, "actual": 0})
            assert answer.status_code == 200, answer.text
            assert remaining(answer) == 10

            # expired: the clock of the tokens moves past their lifetime
            old = await reserve("u4")
            tokens = service.decider.tokens  # type: ignore[union-attr]
            tokens.clock = lambda: time.time() + tokens.ttl + 1
            answer = await http.post("/settle", json={"reservation": old, "actual": 0})
            assert answer.status_code == 410, answer.text
            assert "expired" in answer.text
            tokens.clock = time.time

            # the rule is gone after a reload: 410, and the estimate stays counted
            gone = await reserve("u5")
            moved = await reserve("u6")
            write(config, CONFIG.replace("key: tokens", "key: tokens2"))
            assert await service.reload()
            answer = await http.post("/settle", json={"reservation": gone, "actual": 0})
            assert answer.status_code == 410, answer.text
            assert "no longer in the configuration" in answer.text
            # back again at the same place: the same rule (and counters), so it settles
            write(config, CONFIG)
            assert await service.reload()
            answer = await http.post("/settle", json={"reservation": moved, "actual": 1})
            assert answer.status_code == 200, answer.text
            assert remaining(answer) == 9

    asyncio.run(main())


def test_a_token_settles_on_another_instance(tmp_path: Path, redis_url: str) -> None:
    """Two services on one store with the same key: either settles the other's tokens, once.
    A third with another key refuses them."""
    config = write(tmp_path / "llm.yaml", CONFIG)
    prefix = f"svc{time.monotonic_ns()}"

    async def main() -> None:
        async with (
            running(config, redis_url, key_prefix=prefix, reservation_key=KEY) as first,
            running(config, redis_url, key_prefix=prefix, reservation_key=KEY) as second,
            running(config, redis_url, key_prefix=prefix, reservation_key=KEY[::-1]) as third,
            httpx.AsyncClient() as http,
        ):
            urls = [f"http://127.0.0.1:{s.http_port}" for s in (first, second, third)]
            answer = await http.post(f"{urls[0]}/reserve", json=request(("tokens", "u1", 6)))
            token = answer.json()["statuses"][0]["reservation"]
            refused = await http.post(f"{urls[2]}/settle", json={"reservation": token, "actual": 1})
            assert refused.status_code == 403
            assert "--reservation-key" in refused.text
            settled = await http.post(f"{urls[1]}/settle", json={"reservation": token, "actual": 1})
            assert settled.status_code == 200, settled.text
            assert remaining(settled) == 9
            again = await http.post(f"{urls[0]}/settle", json={"reservation": token, "actual": 1})
            assert again.status_code == 409

    asyncio.run(main())


def curl(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """POST ``body`` with the real curl binary: the status and the JSON answer."""
    command = ["curl", "-sS", "-w", "\n%{http_code}", url]
    if body is not None:
        command += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
    text, _, status = done.stdout.rpartition("\n")
    return int(status), json.loads(text) if text.startswith("{") else text


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_reserve_and_settle_from_curl_against_serve_with_two_workers(
    tmp_path: Path, redis_url: str
) -> None:
    """The must-show: a ``ratekeeper serve --workers 2`` process (no key given: the parent
    draws one for both workers), driven by curl alone. Reserve 5 on a 10/minute rule, settle
    8: 2 left. Then 16 reservations, each settled on a new connection (so on either worker):
    every one settles."""
    config = write(tmp_path / "llm.yaml", CONFIG)
    http_port = free_port()
    base = f"http://127.0.0.1:{http_port}"
    with serve_process(
        "--config", str(config), "--storage", redis_url, "--host", "127.0.0.1",
        "--grpc-port", str(free_port()), "--http-port", str(http_port), "--workers", "2",
        "--timeout", str(STORE_TIMEOUT), "--key-prefix", f"curl{time.monotonic_ns()}",
    ) as server:  # fmt: skip
        server.wait_for("ready", count=2)
        status, reserved = curl(f"{base}/reserve", request(("tokens", "curl", 5)))
        assert status == 200, reserved
        assert reserved["overallCode"] == "OK"
        (held,) = reserved["statuses"]
        assert held["limitRemaining"] == 5
        status, settled = curl(f"{base}/settle", {"reservation": held["reservation"], "actual": 8})
        assert status == 200, settled
        assert settled["statuses"][0]["limitRemaining"] == 2
        status, peeked = curl(f"{base}/json", request(("tokens", "curl", 0)))
        assert status == 200, peeked
        assert peeked["statuses"][0]["limitRemaining"] == 2
        status, decided = curl(f"{base}/json", request(("tokens", "curl", 1)))
        assert (status, decided["statuses"][0]["limitRemaining"]) == (200, 1)

        tokens = []
        for n in range(16):
            status, reserved = curl(f"{base}/reserve", request(("slog", f"w{n}", 4)))
            assert status == 200, reserved
            tokens.append(reserved["statuses"][0]["reservation"])
        for n, token in enumerate(tokens):
            status, settled = curl(f"{base}/settle", {"reservation": token, "actual": 1})
            assert status == 200, settled
            assert settled["statuses"][0]["limitRemaining"] == 9, n
        status, text = curl(f"{base}/settle", {"reservation": tokens[0], "cancel": True})
        assert status == 409, text
        assert server.stop() == 0


def test_the_key_from_the_environment(tmp_path: Path, redis_url: str) -> None:
    """RATEKEEPER_SERVE_RESERVATION_KEY signs the tokens: one signed here with it settles (its
    stamp None: the store holds nothing, so all of actual is charged). A short key is refused."""
    config = write(tmp_path / "llm.yaml", CONFIG)
    rule = load_config(config).resolve("llm", [[("tokens", "env")]])[0]
    assert rule is not None
    assert rule.policy is not None
    http_port = free_port()
    env = {"RATEKEEPER_SERVE_RESERVATION_KEY": KEY}
    with serve_process(
        "--config", str(config), "--storage", redis_url, "--host", "127.0.0.1",
        "--grpc-port", "0", "--http-port", str(http_port),
        "--timeout", str(STORE_TIMEOUT), env=env,
    ) as server:  # fmt: skip
        server.wait_for("ready")
        assert not [line for line in server.seen if "no reservation key" in line]
        token = Tokens(KEY.encode()).issue(
            "llm", [("tokens", "env")], None, rule.policy.name, 5, None
        )
        answer = httpx.post(
            f"http://127.0.0.1:{http_port}/settle", json={"reservation": token, "actual": 3}
        )
        assert answer.status_code == 200, answer.text
        assert remaining(answer) == 7
    short = subprocess.run(
        [SCRIPT, "serve", "--config", str(config), "--reservation-key", "short"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert short.returncode == 2
    assert "at least 16 characters" in short.stderr


def test_a_drawn_key_is_logged(tmp_path: Path, redis_url: str) -> None:
    """Without a key, serve draws one and says so once, before it is ready: replicas started
    so refuse each other's tokens, which must not be a silent surprise."""
    config = write(tmp_path / "llm.yaml", CONFIG)
    env = {"RATEKEEPER_SERVE_RESERVATION_KEY": ""}
    with serve_process(
        "--config", str(config), "--storage", redis_url, "--host", "127.0.0.1",
        "--grpc-port", "0", "--http-port", str(free_port()), env=env,
    ) as server:  # fmt: skip
        server.wait_for("ready")
        warned = [line for line in server.seen if "no reservation key" in line]
        assert len(warned) == 1, server.seen
        assert "give every replica the same key" in warned[0]


# --- charge_over_limit over gRPC ------------------------------------------------------------

STREAM_CONFIG = """\
domain: edge
descriptors:
  - key: stream
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: gcra, charge_over_limit: true}
  - key: plain
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: gcra}
"""

STUBS = [OURS, *([OFFICIAL] if OFFICIAL is not None else [])]


@pytest.mark.parametrize("stubs", STUBS, ids=lambda stubs: stubs.name)
def test_charge_over_limit_counts_a_response_phase_cost_past_the_limit(
    tmp_path: Path, redis_url: str, stubs: Stubs
) -> None:
    """Envoy's apply_on_stream_done sends the cost once the response is done (hits_addend
    from metadata): with charge_over_limit it is counted even past the limit, so the debt
    delays what follows (gcra: 16 units at 10 a minute keep the descriptor busy 96 s); a rule
    without it refuses and counts nothing."""
    config = write(tmp_path / "edge.yaml", STREAM_CONFIG)

    async def main() -> None:
        async with (
            running(config, redis_url) as service,
            grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel,
        ):
            call = stubs.caller(channel)
            ok, over = stubs.code("OK"), stubs.code("OVER_LIMIT")

            async def send(key: str, hits: int) -> Any:
                return await call(stubs.request("edge", [(key, "u1")], hits_addend=hits))

            first = await send("stream", 8)
            assert first.overall_code == ok
            assert first.statuses[0].limit_remaining == 2
            second = await send("stream", 8)  # 16 counted: over, charged anyway
            assert second.overall_code == over
            assert second.statuses[0].limit_remaining == 0
            assert second.statuses[0].duration_until_reset.seconds >= 90
            assert (await send("stream", 1)).overall_code == over

            assert (await send("plain", 8)).overall_code == ok
            refused = await send("plain", 8)  # refused and not counted
            assert refused.overall_code == over
            assert refused.statuses[0].duration_until_reset.seconds <= 60
            assert (await send("plain", 2)).statuses[0].code == ok

    asyncio.run(main())
