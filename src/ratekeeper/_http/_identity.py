"""The key functions; users import them from ``ratekeeper.identity``, whose docstring describes
them."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from hashlib import blake2b

from .._model.errors import ConfigError
from ._request import KeyFunc, Request

__all__ = ["KeyFunc", "Request", "client_ip", "first", "header"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: A peer string's address (None: not an address), its identity, and whether it is trusted.
_Peer = tuple["IPAddress | None", "str | None", bool]

#: Hops of a forwarding header that are looked at, at most: a longer chain is cut (from the
#: left, where a client writes) so parsing stays cheap whatever a client sends.
MAX_HOPS = 20

#: Socket peers whose parsed address and identity a ``client_ip()`` keeps (cleared when full).
PEER_CACHE_SIZE = 4096


def _parse_ip(text: str) -> IPAddress | None:
    """An address from a header or socket value, or None. Accepts ``[v6]:port``, ``v4:port``
    and bracketed or quoted forms; IPv4-mapped IPv6 becomes IPv4; zone ids are dropped."""
    value = text.strip().strip('"')
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        value = value[1:end]
    elif value.count(":") == 1:
        value = value.split(":", 1)[0]  # v4:port
    value = value.split("%", 1)[0]
    if not value or len(value) > 45:
        return None
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _forwarded_for(value: str) -> list[str]:
    """The ``for=`` values of an RFC 7239 ``Forwarded`` header, left to right."""
    out = []
    for element in value.split(","):
        node = None
        for pair in element.split(";"):
            name, _, val = pair.partition("=")
            if name.strip().lower() == "for":
                node = val.strip()
        out.append(node or "unknown")
    return out


class _ClientIP:
    def __init__(
        self,
        trusted_proxies: Iterable[str],
        ipv6_prefix: int,
        header: str,
        max_hops: int,
    ) -> None:
        try:
            self.trusted: tuple[IPNetwork, ...] = tuple(
                ipaddress.ip_network(cidr, strict=False) for cidr in trusted_proxies
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"trusted_proxies must be CIDRs or addresses: {exc}") from None
        if not isinstance(ipv6_prefix, int) or not 1 <= ipv6_prefix <= 128:
            raise ConfigError(f"ipv6_prefix must be 1..128, got {ipv6_prefix!r}")
        if isinstance(max_hops, bool) or not isinstance(max_hops, int) or max_hops < 1:
            raise ConfigError(f"max_hops must be an int >= 1, got {max_hops!r}")
        if header.lower() not in ("x-forwarded-for", "forwarded"):
            raise ConfigError(f"header must be 'x-forwarded-for' or 'forwarded', got {header!r}")
        self.ipv6_prefix = ipv6_prefix
        self.header = header.lower()
        self.max_hops = max_hops
        self._peers: dict[str, _Peer] = {}

    def _trusted(self, address: IPAddress) -> bool:
        return any(address in network for network in self.trusted)

    def _render(self, address: IPAddress) -> str:
        if isinstance(address, ipaddress.IPv6Address) and self.ipv6_prefix < 128:
            network = ipaddress.IPv6Network((address, self.ipv6_prefix), strict=False)
            return f"ip:{network}"
        return f"ip:{address}"

    def _peer(self, text: str) -> _Peer:
        """What a peer string means: its address, its identity, whether it is trusted; kept
        per string (bounded), so a busy client's address is parsed once."""
        known = self._peers.get(text)
        if known is None:
            address = _parse_ip(text)
            if address is None:
                known = (None, None, False)
            else:
                known = (
                    address,
                    self._render(address),
                    bool(self.trusted) and self._trusted(address),
                )
            if len(text) <= 64:  # a peer string is the server's, but never keep a long one
                if len(self._peers) >= PEER_CACHE_SIZE:
                    self._peers.clear()
                self._peers[text] = known
        return known

    def __call__(self, request: Request) -> str | None:
        if not request.peer:
            return None
        peer, rendered, trusted = self._peer(request.peer)
        if peer is None:
            return None
        if not trusted:
            return rendered
        raw = request.headers.get(self.header)
        if not raw:
            return rendered
        # Only the right-most hops matter; cut the rest before splitting.
        tail = raw[-(self.max_hops * 64) :]
        hops = _forwarded_for(tail) if self.header == "forwarded" else tail.split(",")
        hops = hops[-self.max_hops :]
        for hop in reversed(hops):
            address = _parse_ip(hop)
            if address is None:
                # Unparseable: the chain is not trustworthy past here; use the last trusted peer.
                return self._render(peer)
            if not self._trusted(address):
                return self._render(address)
            peer = address
        return self._render(peer)


def client_ip(
    trusted_proxies: Iterable[str] = (),
    *,
    ipv6_prefix: int = 64,
    header: str = "x-forwarded-for",
    max_hops: int = MAX_HOPS,
) -> KeyFunc:
    """The client's IP address as an identity (``"ip:203.0.113.7"``, ``"ip:2001:db8::/64"``).

    ``trusted_proxies`` lists the CIDRs of your own proxies and load balancers. The peer is the
    client unless it is trusted; then the right-most address in ``header`` that is not trusted
    is. IPv4-mapped IPv6 is canonicalised to IPv4; IPv6 is masked to ``ipv6_prefix`` (a client
    usually holds a whole /64); unparseable values fall back to the last trusted peer.
    """
    return _ClientIP(trusted_proxies, ipv6_prefix, header, max_hops)


def header(name: str, *, fallback: KeyFunc | None = None) -> KeyFunc:
    """An API key or token from header ``name``, hashed (the raw value is never kept).

    Only the first value counts (up to the first comma, where a repeated header was joined), as
    frameworks read it: extra copies cannot mint fresh identities for a valid key. A request
    without it gets ``fallback(request)`` (for example ``client_ip(trusted_proxies=...)``), or
    None, which the middleware's ``missing_identity`` option handles (by default: limited by
    the socket peer's address).
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"header name must be a non-empty str, got {name!r}")
    lowered = name.lower()

    def key(request: Request) -> str | None:
        value = request.headers.get(lowered, "").split(",", 1)[0].strip()
        if value:
            digest = blake2b(value.encode("utf-8", "surrogateescape"), digest_size=16)
            return f"{lowered}:{digest.hexdigest()}"
        return fallback(request) if fallback is not None else None

    return key


def first(*key_funcs: Callable[[Request], str | None]) -> KeyFunc:
    """The first identity any of ``key_funcs`` finds: ``first(user_id, client_ip())``."""
    if not key_funcs:
        raise ConfigError("first() needs at least one key function")

    def key(request: Request) -> str | None:
        for func in key_funcs:
            identity = func(request)
            if identity is not None:
                return identity
        return None

    return key
