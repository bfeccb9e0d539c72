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
import logging
import random
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis

from ratekeeper import Policy
from ratekeeper.service._decide import _SETTLED
from ratekeeper.service._loader import load_config
from ratekeeper.service._tokens import CLOCK_SLACK, Tokens

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
            tokens.clock = lambda: time.time() + tokens.ttl + CLOCK_SLACK + 1
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


def payload(token: str) -> dict[str, Any]:
    """A token's payload (readable, not secret)."""
    text = token.partition(".")[0]
    return dict(json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))))


def marker_key(service: Any, token: str) -> str:
    """The store key a settle of ``token`` marks (the rate does not name it)."""
    return str(
        service.decider.limiter.keys(Policy(_SETTLED, "1/minute", "gcra"), payload(token)["r"])[0]
    )


def test_a_token_expires_when_it_says_on_every_replica(tmp_path: Path, redis_url: str) -> None:
    """Two replicas, same key and store, --reservation-ttl 2 and 300, their clocks moved by
    the test: a token's expiry is its issuer's (carried in the token), so it settles once in
    total and, expired, is refused on both. Before issue #32 a token settled on the 2 s one
    settled again on the 300 s one 64 s later (its mark lived 62 s), and one expired on the
    first (410) settled on the second (200)."""
    config = write(tmp_path / "llm.yaml", CONFIG)
    prefix = f"ttl{time.monotonic_ns()}"
    now = [time.time()]

    async def main() -> None:
        async with (
            running(config, redis_url, key_prefix=prefix, reservation_key=KEY,
                    reservation_ttl=2) as short,
            running(config, redis_url, key_prefix=prefix, reservation_key=KEY,
                    reservation_ttl=300) as long,
            httpx.AsyncClient() as http,
        ):  # fmt: skip
            for service in (short, long):
                service.decider.tokens.clock = lambda: now[0]  # type: ignore[union-attr]
            urls = {s: f"http://127.0.0.1:{s.http_port}" for s in (short, long)}
            start = now[0]

            async def reserve(on: Any, value: str) -> str:
                answer = await http.post(f"{urls[on]}/reserve", json=request(("tokens", value, 4)))
                assert answer.status_code == 200, answer.text
                return str(answer.json()["statuses"][0]["reservation"])

            async def settle(on: Any, token: str) -> httpx.Response:
                return await http.post(
                    f"{urls[on]}/settle", json={"reservation": token, "actual": 1}
                )

            brief, lasting, unused = (
                await reserve(short, "a"),
                await reserve(long, "b"),
                await reserve(short, "c"),
            )
            assert payload(brief)["x"] - payload(brief)["t"] == 2000
            assert payload(lasting)["x"] - payload(lasting)["t"] == 300_000
            with redis.Redis.from_url(redis_url) as client:
                now[0] = start + 1
                assert (await settle(short, brief)).status_code == 200
                # its mark lives to the token's expiry plus twice the slack, 2 - 1 + 10 s (and
                # the store's TTL margin): not the settling replica's ttl + 60 s any more
                left = client.pttl(marker_key(short, brief))
                assert 1_000 + 2 * CLOCK_SLACK * 1000 <= left <= 13_000, left
                # a token of the 300 s replica settled on the 2 s one: marked for 300 s and more
                assert (await settle(short, lasting)).status_code == 200
                assert client.pttl(marker_key(short, lasting)) > 300_000
            for on in (short, long):
                for token in (brief, lasting):
                    again = await settle(on, token)
                    assert again.status_code == 409, again.text
            # past the short token's expiry (and the slack): refused everywhere, whatever
            # each replica's own ttl
            now[0] = start + 2 + CLOCK_SLACK + 1
            for on in (short, long):
                refused = await settle(on, unused)
                assert refused.status_code == 410, refused.text
                assert "2 s after its reservation" in refused.text
            now[0] = start + 64
            for on in (short, long):
                assert (await settle(on, brief)).status_code == 410
                assert (await settle(on, lasting)).status_code == 409
            # the first format (no expiry of its own): refused, saying why
            data = payload(unused)
            data["v"] = 1
            del data["x"]
            text = (
                base64.urlsafe_b64encode(json.dumps(data, separators=(",", ":")).encode())
                .rstrip(b"=")
                .decode()
            )
            mac = Tokens(KEY.encode())._mac(text)
            old = f"{text}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"
            answer = await settle(long, old)
            assert answer.status_code == 410, answer.text
            assert "first format" in answer.text
            peeked = await http.post(f"{urls[long]}/json", json=request(("tokens", "c", 0)))
            assert remaining(peeked) == 6  # nothing was refunded

    asyncio.run(main())


def test_a_replayed_settle_refunds_nothing_when_its_mark_is_degraded(
    tmp_path: Path, cluster: Any
) -> None:
    """The report: a 3-primary cluster, --failure-mode open, the primary holding the settled
    marks stopped (not the one holding the identities). Each of 10 tokens settled 4 times: all
    503 and nothing refunded (before issue #32: 16 answers of 200, refunds past the estimate)."""
    config = write(
        tmp_path / "llm.yaml",
        CONFIG.replace("requests_per_unit: 10}", "requests_per_unit: 1000}", 1),
    )
    node_of = cluster.owner_of_key

    async def main() -> None:
        async with (
            running(config, cluster.url, failure_mode="open", reservation_key=KEY,
                    timeout=0.5) as service,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as http,
        ):  # fmt: skip
            rule = service.decider.config.resolve("llm", [[("tokens", "id")]])[0]  # type: ignore[union-attr]
            value = "id"
            identity_key = service.decider.limiter.keys(
                rule.policy, rule.identity_for([("tokens", value)])
            )[0]  # type: ignore[union-attr]
            holder = node_of(identity_key)
            (victim, *_) = [n for n in cluster.primary_nodes() if n.id != holder.id]
            tokens: list[str] = []
            while len(tokens) < 10:
                answer = await http.post("/reserve", json=request(("tokens", value, 30)))
                assert answer.status_code == 200, answer.text
                token = answer.json()["statuses"][0]["reservation"]
                if node_of(marker_key(service, token)).id == victim.id:
                    tokens.append(token)
                else:  # its mark is on a primary that stays up: give it back
                    cancelled = await http.post(
                        "/settle", json={"reservation": token, "cancel": True}
                    )
                    assert cancelled.status_code == 200, cancelled.text
            before = await peek(http, "tokens", value)
            assert before == 1000 - 300
            cluster.kill(victim)
            answers = [
                (await http.post("/settle", json={"reservation": token, "actual": 0})).status_code
                for token in tokens
                for _ in range(4)
            ]
            after = await peek(http, "tokens", value)
            # a failover may promote the victim's replica meanwhile: then a token settles
            # once (200, its 30 back) and its replays are 409; never two 200s for one token
            per_token = [answers[4 * n : 4 * n + 4] for n in range(10)]
            assert all(codes.count(200) <= 1 for codes in per_token), per_token
            assert set(answers) <= {200, 409, 503}, answers
            assert after == before + 30 * answers.count(200), (answers, after)
            assert answers[0] == 503, answers

    asyncio.run(main())


def test_a_large_refused_reserve_cancels_everything_and_logs_little(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """15,000 descriptors and one exhausted: 429, every reservation cancelled (a sample of 500
    identities peeked: the full limit), at most a handful of log lines. At serve's default
    20 ms store timeout, as reported: before issue #32 the cancel was one unbounded gather, whose
    calls missed the deadline (here 7,325 WARNING lines, one per failed cancel)."""
    config = write(tmp_path / "llm.yaml", CONFIG)
    many = 15_000

    async def main() -> None:
        async with (
            running(config, redis_url, timeout=0.02) as service,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}", timeout=60) as http,
        ):
            assert (await http.post("/json", json=request(("tight", "x", 1)))).status_code == 200
            body = request(*[("tokens", f"v{n}", 3) for n in range(many)], ("tight", "x", 1))
            caplog.clear()
            started = time.perf_counter()
            with caplog.at_level(logging.INFO, logger="ratekeeper"):
                answer = await http.post("/reserve", json=body)
            elapsed = time.perf_counter() - started
            assert answer.status_code == 429, answer.text[:200]
            statuses = answer.json()["statuses"]
            assert all("reservation" not in status for status in statuses)
            lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(lines) <= 5, [r.getMessage()[:200] for r in lines[:10]]
            sample = random.Random(32).sample(range(many), 500)
            peeks = await http.post(
                "/json", json=request(*[("tokens", f"v{n}", 0) for n in sample])
            )
            assert peeks.status_code == 200, peeks.text[:200]
            assert {status["limitRemaining"] for status in peeks.json()["statuses"]} == {10}
            assert elapsed < 30, elapsed

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
