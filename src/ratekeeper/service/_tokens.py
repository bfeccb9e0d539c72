"""Reservation tokens of ``POST /reserve`` and ``POST /settle``: a held reservation written as a
string that any worker, or any replica holding the same key, reads back, and that no client can
forge or alter. The service keeps nothing between the two calls.

A token is ``<payload>.<mac>``, both base64url without padding: the payload is the reservation
as compact JSON (domain, the descriptor's entries and ``limit`` override, the rule's policy name,
the estimate, the stamp, when it was issued and a random nonce), the mac HMAC-SHA256 of the
payload's text under the service's key. The payload is readable (base64 is not encryption): it
holds what the client sent, and where the store counted it.

Pure: no I/O; the wall clock is injected (tokens cross processes and hosts, so it is the epoch,
not a monotonic clock).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Held", "TokenRefused", "Tokens"]

_VERSION = 1
_B64URL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


class TokenRefused(ValueError):
    """A token, or a settle, that the service refuses; ``status`` is the HTTP status to answer:
    400 malformed, 403 forged or signed with another key, 409 settled already, 410 expired or
    its rule is no longer configured."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Held:
    """What a token says: a reservation of ``estimate`` for the descriptor ``entries`` of
    ``domain`` (with its ``limit`` override, if any) under the rule whose policy is ``policy``,
    counted by the store at ``stamp`` (None: a failure mode admitted it, the store holds
    nothing); ``issued`` in seconds since the epoch; ``nonce`` makes each token one of a kind."""

    domain: str
    entries: tuple[tuple[str, str], ...]
    limit: tuple[int, str] | None
    policy: str
    estimate: int
    stamp: int | None
    issued: float
    nonce: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    """Strict: a character outside base64url is an error (the lenient decoder skips it)."""
    if not _B64URL.issuperset(text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _malformed(what: str) -> TokenRefused:
    return TokenRefused(400, f"bad request: the reservation token is malformed ({what})")


class Tokens:
    """Signs and reads tokens under ``key``; a token older than ``ttl`` seconds is refused."""

    def __init__(
        self, key: bytes, ttl: float = 600.0, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._key = key
        self.ttl = ttl
        self.clock = clock

    def _mac(self, payload: str) -> bytes:
        return hmac.new(self._key, payload.encode("ascii"), hashlib.sha256).digest()

    def issue(
        self,
        domain: str,
        entries: list[tuple[str, str]],
        limit: tuple[int, str] | None,
        policy: str,
        estimate: int,
        stamp: int | None,
    ) -> str:
        """A token for a reservation made now."""
        data = {
            "v": _VERSION,
            "d": domain,
            "e": [list(entry) for entry in entries],
            "l": list(limit) if limit is not None else None,
            "p": policy,
            "n": estimate,
            "s": stamp,
            "t": round(self.clock() * 1000),
            "r": secrets.token_hex(12),
        }
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
        payload = _b64(text.encode("utf-8"))
        return f"{payload}.{_b64(self._mac(payload))}"

    def read(self, token: str) -> Held:
        """The reservation ``token`` holds; raises :class:`TokenRefused`: 400 when it is not a
        token, 403 when its mac does not verify, 410 when it is older than ``ttl``."""
        payload, dot, mac = token.partition(".")
        if not dot or not payload or not mac:
            raise _malformed("expected <payload>.<mac>")
        try:
            given = _unb64(mac)
            _unb64(payload)
        except (binascii.Error, ValueError):
            raise _malformed("not base64url") from None
        if not hmac.compare_digest(given, self._mac(payload)):
            raise TokenRefused(
                403,
                "the reservation token does not verify: it was altered, forged, or signed with "
                "another key (every replica needs the same --reservation-key)",
            )
        try:
            data: Any = json.loads(_unb64(payload))
            held = _held(data)
        except (binascii.Error, ValueError, TypeError, KeyError):
            raise _malformed("unreadable payload") from None
        if self.clock() - held.issued > self.ttl:
            raise TokenRefused(
                410,
                f"the reservation expired: a token settles within {self.ttl:g} s of its "
                "reservation (--reservation-ttl); its estimate stays counted",
            )
        return held


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(value)
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(value)
    return value


def _held(data: Any) -> Held:
    """A verified payload read into a Held (TypeError/KeyError/ValueError when it is not one:
    only a payload signed with this key by another version of the service gets here)."""
    if not isinstance(data, dict) or data.get("v") != _VERSION:
        raise ValueError("unknown token version")
    limit = data["l"]
    return Held(
        domain=_str(data["d"]),
        entries=tuple((_str(key), _str(value)) for key, value in data["e"]),
        limit=None if limit is None else (_int(limit[0]), _str(limit[1])),
        policy=_str(data["p"]),
        estimate=_int(data["n"]),
        stamp=None if data["s"] is None else _int(data["s"]),
        issued=_int(data["t"]) / 1000,
        nonce=_str(data["r"]),
    )
