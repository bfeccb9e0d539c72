"""Client identity: ``client_ip`` behind trusted proxies, ``header`` and ``first``; spoofing.

The key functions are pure, so most tests call them on a :class:`Request` directly. The
spoofing tests go through the ASGI middleware (httpx's in-process transport sets the socket
peer) and count exactly what a client that lies in its headers gets.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from ratekeeper import AsyncLimiter, ConfigError, Policy
from ratekeeper._http import Limiting, StoreCall, anonymous_identity
from ratekeeper._http import _identity as identity_module
from ratekeeper.asgi import RateLimitMiddleware
from ratekeeper.identity import Request, client_ip, first, header

from ..support.web_apps import asgi_client, exact_options, plain_app

TRUSTED = ["10.0.0.0/8", "2001:db8:ffff::/48"]
RFC7239_EXAMPLE = 'for=192.0.2.60;proto=http, for="[2001:db8:cafe::17]:4711"'


def request(peer: str | None = "203.0.113.7", **headers: str) -> Request:
    return Request("GET", "/", {k.replace("_", "-"): v for k, v in headers.items()}, peer)


# --- the socket peer -----------------------------------------------------------------------------


def test_without_trusted_proxies_the_peer_is_the_client_whatever_the_headers():
    key = client_ip()
    lying = request("203.0.113.7", x_forwarded_for="198.51.100.1", forwarded="for=198.51.100.2")
    assert key(lying) == "ip:203.0.113.7"
    assert key(request("203.0.113.7")) == key(lying)


def test_an_untrusted_peer_is_the_client_even_if_proxies_are_configured():
    key = client_ip(TRUSTED)
    assert key(request("203.0.113.7", x_forwarded_for="198.51.100.1")) == "ip:203.0.113.7"
    forwarded = client_ip(TRUSTED, header="forwarded")
    assert forwarded(request("203.0.113.7", forwarded="for=198.51.100.1")) == "ip:203.0.113.7"


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("203.0.113.7:51234", "ip:203.0.113.7"),
        ("[2001:db8::1]:443", "ip:2001:db8::/64"),
        ("fe80::1%eth0", "ip:fe80::/64"),
        ("::ffff:203.0.113.7", "ip:203.0.113.7"),
    ],
)
def test_peer_forms_are_parsed(peer: str, expected: str):
    assert client_ip()(request(peer)) == expected


@pytest.mark.parametrize("peer", [None, "", "testclient", "unix:/run/app.sock", "999.1.1.1"])
def test_a_peer_that_is_no_address_gives_no_identity(peer: str | None):
    assert client_ip()(request(peer)) is None
    assert client_ip(TRUSTED)(request(peer, x_forwarded_for="203.0.113.7")) is None


# --- trusted proxies: X-Forwarded-For ------------------------------------------------------------


def test_a_trusted_peer_defers_to_the_right_most_untrusted_hop():
    key = client_ip(TRUSTED)
    chain = "198.51.100.1, 203.0.113.7, 10.1.2.3, 10.0.0.2"
    assert key(request("10.0.0.1", x_forwarded_for=chain)) == "ip:203.0.113.7"
    assert key(request("10.0.0.1", x_forwarded_for="203.0.113.9")) == "ip:203.0.113.9"


def test_a_trusted_peer_without_the_header_is_itself_the_client():
    key = client_ip(TRUSTED)
    assert key(request("10.0.0.1")) == "ip:10.0.0.1"
    assert key(request("10.0.0.1", x_forwarded_for="")) == "ip:10.0.0.1"


def test_a_chain_of_trusted_hops_ends_at_the_left_most_one_it_saw():
    key = client_ip(TRUSTED)
    assert key(request("10.0.0.1", x_forwarded_for="10.0.0.3, 10.0.0.2")) == "ip:10.0.0.3"


def test_xff_hops_with_ports_and_brackets():
    key = client_ip(TRUSTED)
    assert key(request("10.0.0.1", x_forwarded_for="203.0.113.7:4711")) == "ip:203.0.113.7"
    bracketed = request("10.0.0.1", x_forwarded_for="[2001:db8:1:2::5]:443, 10.0.0.9")
    assert key(bracketed) == "ip:2001:db8:1:2::/64"


def test_only_the_configured_header_is_read():
    xff = client_ip(TRUSTED)
    forwarded = client_ip(TRUSTED, header="Forwarded")
    both = request("10.0.0.1", x_forwarded_for="198.51.100.1", forwarded="for=198.51.100.2")
    assert xff(both) == "ip:198.51.100.1"
    assert forwarded(both) == "ip:198.51.100.2"


# --- trusted proxies: Forwarded (RFC 7239) -------------------------------------------------------


def test_forwarded_rfc7239_example():
    key = client_ip(TRUSTED, header="forwarded")
    # The right-most hop is an IPv6 address with a port, quoted and bracketed.
    assert key(request("10.0.0.1", forwarded=RFC7239_EXAMPLE)) == "ip:2001:db8:cafe::/64"
    # Once that hop is a trusted proxy, the one before it is the client.
    also_trusted = client_ip([*TRUSTED, "2001:db8:cafe::/48"], header="forwarded")
    assert also_trusted(request("10.0.0.1", forwarded=RFC7239_EXAMPLE)) == "ip:192.0.2.60"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("for=192.0.2.60;proto=http;by=203.0.113.43", "ip:192.0.2.60"),
        ('For="192.0.2.60:8080"', "ip:192.0.2.60"),
        ("proto=https;for=192.0.2.61;host=example.com", "ip:192.0.2.61"),
        ("for=192.0.2.60, for=10.0.0.7", "ip:192.0.2.60"),
        ('for="[::ffff:192.0.2.62]"', "ip:192.0.2.62"),
        # "unknown", obfuscated identifiers and elements without for= are not addresses.
        ("for=unknown", "ip:10.0.0.1"),
        ("for=_hidden", "ip:10.0.0.1"),
        ("proto=https;by=10.0.0.1", "ip:10.0.0.1"),
        ("for=192.0.2.60, for=unknown", "ip:10.0.0.1"),
    ],
)
def test_forwarded_forms(value: str, expected: str):
    key = client_ip(TRUSTED, header="forwarded")
    assert key(request("10.0.0.1", forwarded=value)) == expected


# --- canonical forms -----------------------------------------------------------------------------


def test_ipv4_mapped_ipv6_is_the_same_client_as_ipv4():
    key = client_ip(TRUSTED)
    assert key(request("::ffff:1.2.3.4")) == key(request("1.2.3.4")) == "ip:1.2.3.4"
    mapped_hop = request("10.0.0.1", x_forwarded_for="::ffff:203.0.113.7")
    assert key(mapped_hop) == key(request("10.0.0.1", x_forwarded_for="203.0.113.7"))
    # A mapped peer inside a trusted IPv4 range is trusted.
    mapped_proxy = request("::ffff:10.0.0.1", x_forwarded_for="203.0.113.7")
    assert key(mapped_proxy) == "ip:203.0.113.7"


def test_ipv6_is_masked_to_a_64_by_default():
    key = client_ip()
    one = key(request("2001:db8:0:1::1"))
    assert one == "ip:2001:db8:0:1::/64"
    assert key(request("2001:db8:0:1:ffff:ffff:ffff:ffff")) == one  # same /64
    assert key(request("2001:db8:0:2::1")) != one  # the next /64
    # Written differently, the same address.
    assert key(request("2001:0DB8:0000:0001:0000:0000:0000:0001")) == one


def test_a_custom_ipv6_prefix():
    wide = client_ip(ipv6_prefix=48)
    assert (
        wide(request("2001:db8:0:1::1")) == wide(request("2001:db8:0:2::1")) == "ip:2001:db8::/48"
    )
    assert wide(request("2001:db8:1::1")) != wide(request("2001:db8:0:1::1"))
    exact = client_ip(ipv6_prefix=128)
    assert exact(request("2001:db8::1")) == "ip:2001:db8::1"
    assert exact(request("2001:db8::1")) != exact(request("2001:db8::2"))
    # The prefix applies to IPv6 only.
    assert wide(request("203.0.113.7")) == "ip:203.0.113.7"


def test_ipv6_hops_are_masked_too():
    key = client_ip(TRUSTED)
    a = key(request("10.0.0.1", x_forwarded_for="2001:db8:5:6::1"))
    b = key(request("10.0.0.1", x_forwarded_for="2001:db8:5:6::abcd"))
    c = key(request("10.0.0.1", x_forwarded_for="2001:db8:5:7::1"))
    assert a == b == "ip:2001:db8:5:6::/64"
    assert c != a


# --- unparseable values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "xff",
    [
        "garbage",
        "unknown",
        "203.0.113.7, ",
        "203.0.113.7,,",
        "1.2.3",
        "256.1.1.1",
        "[2001:db8::1",
        "2001:db8::g",
        "\x00\xff\xfe",
        "1.2.3.4" + "0" * 100,
        ";;;===,,,",
    ],
)
def test_an_unparseable_right_most_hop_falls_back_to_the_peer(xff: str):
    assert client_ip(TRUSTED)(request("10.0.0.1", x_forwarded_for=xff)) == "ip:10.0.0.1"


def test_an_unparseable_hop_stops_the_walk_at_the_last_trusted_proxy():
    key = client_ip(TRUSTED)
    chain = "203.0.113.7, junk, 10.0.0.2"
    assert key(request("10.0.0.1", x_forwarded_for=chain)) == "ip:10.0.0.2"


# --- bounded work --------------------------------------------------------------------------------


def test_a_10000_hop_header_still_yields_the_right_most_untrusted_hop():
    key = client_ip(TRUSTED)
    chain = "198.51.100.1, " * 9_997 + "203.0.113.7, 10.0.0.3, 10.0.0.2"
    assert key(request("10.0.0.1", x_forwarded_for=chain)) == "ip:203.0.113.7"
    forwarded = client_ip(TRUSTED, header="forwarded")
    value = "for=198.51.100.1;proto=https, " * 9_998 + "for=203.0.113.7, for=10.0.0.2"
    assert forwarded(request("10.0.0.1", forwarded=value)) == "ip:203.0.113.7"


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    parse = identity_module._parse_ip

    def spy(text: str) -> Any:
        seen.append(text)
        return parse(text)

    monkeypatch.setattr(identity_module, "_parse_ip", spy)
    return seen


@pytest.mark.parametrize("header_name", ["x-forwarded-for", "forwarded"])
def test_a_10000_hop_header_costs_no_more_than_a_20_hop_one(
    monkeypatch: pytest.MonkeyPatch, header_name: str
):
    """Every hop trusted, so the walk goes as far as it is allowed to: max_hops hops."""
    addresses = [str(ipaddress.IPv4Address("10.0.0.0") + i) for i in range(1, 10_001)]
    hops = [f"for={a}" for a in addresses] if header_name == "forwarded" else addresses
    key = client_ip(TRUSTED, header=header_name)
    field = header_name.replace("-", "_")
    seen = _count_parses(monkeypatch)
    short = key(request("10.255.255.254", **{field: ", ".join(hops[-20:])}))
    short_parses = len(seen)
    seen.clear()
    long = key(request("10.255.255.254", **{field: ", ".join(hops)}))
    assert short_parses == 21  # the peer and 20 hops
    assert len(seen) == 20  # the same peer again: parsed once, kept by client_ip()
    assert long == short == f"ip:{addresses[-20]}"  # the 20th hop from the right
    assert all(len(text) < 64 for text in seen)


def test_the_peer_cache_is_bounded_and_per_key_function(monkeypatch: pytest.MonkeyPatch):
    seen = _count_parses(monkeypatch)
    key = client_ip()
    assert [key(request("203.0.113.7")) for _ in range(3)] == ["ip:203.0.113.7"] * 3
    assert seen == ["203.0.113.7"]
    monkeypatch.setattr(identity_module, "PEER_CACHE_SIZE", 4)
    for i in range(10):
        assert key(request(f"198.51.100.{i}")) == f"ip:198.51.100.{i}"
    assert len(key._peers) <= 4  # type: ignore[attr-defined]
    # Another client_ip() with its own trusted proxies keeps its own answers.
    behind = client_ip(["203.0.113.0/24"])
    assert behind(request("203.0.113.7", x_forwarded_for="192.0.2.9")) == "ip:192.0.2.9"
    assert key(request("203.0.113.7", x_forwarded_for="192.0.2.9")) == "ip:203.0.113.7"


def test_the_header_text_looked_at_is_bounded(monkeypatch: pytest.MonkeyPatch):
    lengths: list[int] = []
    split = identity_module._forwarded_for

    def spy(value: str) -> list[str]:
        lengths.append(len(value))
        return split(value)

    monkeypatch.setattr(identity_module, "_forwarded_for", spy)
    key = client_ip(TRUSTED, header="forwarded")
    huge = "for=198.51.100.1, " * 60_000 + "for=203.0.113.7"  # over 1 MB
    assert key(request("10.0.0.1", forwarded=huge)) == "ip:203.0.113.7"
    assert lengths
    assert max(lengths) <= 20 * 64


def test_max_hops_is_how_far_the_walk_goes():
    chain = "203.0.113.9, 10.0.0.3, 10.0.0.2"
    assert client_ip(TRUSTED, max_hops=3)(request("10.0.0.1", x_forwarded_for=chain)) == (
        "ip:203.0.113.9"
    )
    # Two hops seen, both proxies: the left-most seen is the best there is.
    assert client_ip(TRUSTED, max_hops=2)(request("10.0.0.1", x_forwarded_for=chain)) == (
        "ip:10.0.0.3"
    )


@pytest.mark.parametrize("max_hops", [0, -1])
def test_max_hops_below_one_is_refused(max_hops: int):
    """A bound of zero or less would be no bound: ``raw[-0:]`` is the whole header, so a
    client-sized header would be parsed hop by hop. Like ``ipv6_prefix``, it must be refused."""
    with pytest.raises(ConfigError):
        client_ip(TRUSTED, max_hops=max_hops)


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"trusted_proxies": ["not-a-network"]},
        {"trusted_proxies": ["10.0.0.0/33"]},
        {"ipv6_prefix": 0},
        {"ipv6_prefix": 129},
        {"header": "x-real-ip"},
    ],
)
def test_bad_client_ip_options_are_config_errors(options: dict[str, Any]):
    with pytest.raises(ConfigError):
        client_ip(**options)


def test_a_single_address_is_a_trusted_proxy():
    key = client_ip(["10.0.0.1"])
    assert key(request("10.0.0.1", x_forwarded_for="203.0.113.7")) == "ip:203.0.113.7"
    assert key(request("10.0.0.2", x_forwarded_for="203.0.113.7")) == "ip:10.0.0.2"


# --- header() and first() ------------------------------------------------------------------------


def test_header_hashes_the_api_key():
    key = header("X-API-Key")
    secret = "sk_live_5up3r53cr3t"
    identity = key(request(x_api_key=secret))
    assert identity is not None
    assert secret not in identity
    assert identity.startswith("x-api-key:")
    assert len(identity) == len("x-api-key:") + 32
    assert key(request("198.51.100.1", x_api_key=secret)) == identity  # not tied to the address
    assert key(request(x_api_key=secret + "x")) != identity


def test_header_without_the_header_uses_the_fallback():
    key = header("x-api-key", fallback=client_ip())
    assert key(request("203.0.113.7")) == "ip:203.0.113.7"
    assert key(request("203.0.113.7", x_api_key="")) == "ip:203.0.113.7"
    assert header("x-api-key")(request("203.0.113.7")) is None


@pytest.mark.parametrize("name", ["", None])
def test_header_needs_a_name(name: Any):
    with pytest.raises(ConfigError):
        header(name)


def test_first_takes_the_first_identity_found():
    def user(req: Request) -> str | None:
        name = req.headers.get("x-user")
        return f"user:{name}" if name else None

    key = first(user, header("x-api-key"), client_ip())
    assert key(request(x_user="alice", x_api_key="k")) == "user:alice"
    assert key(request(x_api_key="k")) == header("x-api-key")(request(x_api_key="k"))
    assert key(request("203.0.113.7")) == "ip:203.0.113.7"
    assert first(user)(request()) is None
    with pytest.raises(ConfigError):
        first()


# --- a missing identity ------------------------------------------------------------------------


def test_the_fallback_identity_is_the_address_under_its_own_prefix():
    limiting = Limiting(policy=Policy("p", "1/minute"), key=header("x-api-key"))
    route = limiting.admit(request("203.0.113.7")).send(None)
    assert isinstance(route, StoreCall)
    assert route.identity == "anonymous:ip:203.0.113.7"
    assert anonymous_identity(client_ip()(request("2001:db8::1"))) == "anonymous:ip:2001:db8::/64"
    assert anonymous_identity(None) == "anonymous:no-address"
    # The peer, not a forwarding header a client could pick.
    lying = limiting.admit(request("203.0.113.7", x_forwarded_for="198.51.100.1")).send(None)
    assert isinstance(lying, StoreCall)
    assert lying.identity == route.identity


@pytest.mark.parametrize("value", ["203.0.113.7", "ip:203.0.113.7", "anonymous:ip:203.0.113.7"])
@pytest.mark.parametrize("name", ["x-api-key", "anonymous", "ip", "anonymous:ip"])
def test_no_header_value_collides_with_the_fallback_identity(name: str, value: str):
    fallback = anonymous_identity(client_ip()(request("203.0.113.7")))
    assert header(name)(request(**{name.replace("-", "_"): value})) != fallback
    assert fallback != client_ip()(request("203.0.113.7"))


# --- spoofing, through the middleware ------------------------------------------------------------


async def _statuses(
    app: Any, peer: str, header_sets: list[dict[str, Any]], path: str = "/"
) -> list[int]:
    async with asgi_client(app, client=(peer, 40000)) as http:
        return [(await http.get(path, headers=h)).status_code for h in header_sets]


def test_a_rotating_x_forwarded_for_from_an_untrusted_peer_changes_nothing(
    backend: str, key_prefix: str
):
    policy = Policy("spoof-untrusted", "5/minute")

    async def main() -> list[int]:
        async with AsyncLimiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
            app = RateLimitMiddleware(
                plain_app, limiter=limiter, policy=policy, key=client_ip(TRUSTED)
            )
            fakes = [
                {
                    "X-Forwarded-For": f"198.51.100.{i}",
                    "X-Real-IP": f"192.0.2.{i}",
                    "Forwarded": f'for="[2001:db8::{i}]";proto=https',
                }
                for i in range(20)
            ]
            return await _statuses(app, "203.0.113.7", fakes)

    assert asyncio.run(main()) == [200] * 5 + [429] * 15


def test_prepending_fake_hops_before_a_trusted_proxy_changes_nothing(backend: str, key_prefix: str):
    policy = Policy("spoof-trusted", "5/minute")

    async def main() -> tuple[list[int], list[int]]:
        async with AsyncLimiter.from_url(backend, **exact_options(backend, key_prefix)) as limiter:
            app = RateLimitMiddleware(
                plain_app, limiter=limiter, policy=policy, key=client_ip(TRUSTED)
            )
            # The proxy (10.0.0.1) appends the address it saw; the client wrote the rest.
            liar = [
                {"X-Forwarded-For": f"198.51.100.{i}, 10.0.0.{i}, 203.0.113.7"} for i in range(20)
            ]
            other = [{"X-Forwarded-For": "203.0.113.8"}] * 7
            return await _statuses(app, "10.0.0.1", liar), await _statuses(app, "10.0.0.1", other)

    liar, other = asyncio.run(main())
    assert liar == [200] * 5 + [429] * 15
    assert other == [200] * 5 + [429] * 2  # another client behind the same proxy: its own budget


def test_repeated_forwarding_headers_are_read_right_most_last():
    """Two X-Forwarded-For fields are one list (RFC 9110): the last field's last hop counts."""

    async def main() -> list[int]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            seen: list[str | None] = []
            trusted = client_ip(TRUSTED)

            def key(req: Request) -> str | None:
                seen.append(trusted(req))
                return seen[-1]

            app = RateLimitMiddleware(
                plain_app, limiter=limiter, policy=Policy("twice", "5/minute"), key=key
            )
            transport_headers = [
                ("X-Forwarded-For", "198.51.100.1"),
                ("X-Forwarded-For", "203.0.113.7, 10.0.0.2"),
            ]
            async with asgi_client(app, client=("10.0.0.1", 40000)) as http:
                response = await http.get("/", headers=transport_headers)
            assert seen == ["ip:203.0.113.7"]
            return [response.status_code]

    assert asyncio.run(main()) == [200]


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Forwarded-For", "1.2.3.4, " * 120_000)],  # about 1 MB of hops
        [("X-Forwarded-For", "x" * 1_000_000)],
        [("Forwarded", 'for="[' + ":" * 500_000 + ']";' * 1000)],
        [("X-API-Key", "k" * 1_000_000)],
        [("X-Forwarded-For", b"\xff\xfe\x00\x80garbage\xc3(")],
        [("X-API-Key", b"\xc3(\xff"), ("X-Forwarded-For", b"\xed\xa0\x80")],
        [("X-Forwarded-For", "[" * 10_000), ("Forwarded", ";=," * 100_000)],
        [
            ("X-Forwarded-For", "fe80::1%eth0, [fe80::2%25en0]:80"),
            ("Forwarded", 'for="[fe80::3%1]"'),
        ],
        [("X-Forwarded-For", ""), ("Forwarded", ""), ("X-API-Key", ""), ("X-Real-IP", "")],
        [("X-Forwarded-For", ", , ,"), ("Forwarded", "for=;for=,,")],
    ],
)
def test_huge_or_garbage_headers_never_crash_the_app(headers: list[tuple[str, Any]]):
    policy = Policy("garbage", "3/minute")

    async def main() -> list[int]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            apps = [
                RateLimitMiddleware(
                    plain_app,
                    limiter=limiter,
                    policy=policy,
                    key=first(header("x-api-key"), client_ip(TRUSTED, header=name)),
                )
                for name in ("x-forwarded-for", "forwarded")
            ]
            statuses = []
            for app in apps:
                async with asgi_client(app, client=("10.0.0.1", 40000)) as http:
                    statuses += [
                        (await http.get("/", headers=headers)).status_code for _ in range(3)
                    ]
            return statuses

    statuses = asyncio.run(main())
    assert set(statuses) <= {200, 429}
    assert statuses.count(200) >= 3  # the first requests of an identity always pass


def test_repeating_the_api_key_header_does_not_mint_fresh_identities():
    """The app authenticates the first ``X-API-Key`` (Starlette's ``request.headers[...]`` and
    FastAPI's ``Header()`` read the first value); ``request_from_scope`` joins repeated fields
    with ", " and ``header()`` hashes the joined text. So a client with one valid key that adds
    a second ``X-API-Key`` with a new junk value on every request gets a fresh identity each
    time: an unlimited, authenticated client. At most ``limit`` such requests may pass."""

    async def data(request: StarletteRequest) -> PlainTextResponse:
        if request.headers["x-api-key"] != "valid-key":
            return PlainTextResponse("who are you?", status_code=401)
        return PlainTextResponse("data")

    async def main() -> list[int]:
        async with AsyncLimiter.from_url("memory://") as limiter:
            app = Starlette(routes=[Route("/data", data)])
            app.add_middleware(
                RateLimitMiddleware,
                limiter=limiter,
                policy=Policy("keys", "3/minute"),
                key=header("x-api-key", fallback=client_ip()),
            )
            async with asgi_client(app) as http:
                honest = [
                    (await http.get("/data", headers={"X-API-Key": "valid-key"})).status_code
                    for _ in range(4)
                ]
                assert honest == [200, 200, 200, 429]
                statuses = []
                for i in range(10):
                    repeated = [("X-API-Key", "valid-key"), ("X-API-Key", f"junk-{i}")]
                    statuses.append((await http.get("/data", headers=repeated)).status_code)
                return statuses

    statuses = asyncio.run(main())
    assert 500 not in statuses
    assert statuses.count(200) == 0  # the key's budget is spent: repeating it changes nothing
