"""Reservation tokens of ``POST /reserve`` and ``POST /settle``: a held reservation written as a
string that any worker, or any replica holding the same key, reads back, and that no client can
forge or alter. The service keeps nothing between the two calls.

A token is ``<payload>.<mac>``, both base64url without padding: the payload is the reservation
as compact JSON (domain, the descriptor's entries and ``limit`` override, the rule's policy name,
the estimate, the stamp, when it was issued, when it expires and a random nonce), the mac
HMAC-SHA256 of the payload's text under the service's key. The payload is readable (base64 is
not encryption): it holds what the client sent, and where the store counted it.

A token carries its own expiry (the issuer's ``ttl`` after it was issued, signed): whichever
replica reads it, whatever ``ttl`` that one has, refuses it once it expired (plus
:data:`CLOCK_SLACK`, for clocks that differ), so a token lives as long everywhere. Tokens of the
first format (without an expiry) are refused (410): tokens are short-lived, and theirs depended
on the reader.

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

__all__ = ["CLOCK_SLACK", "Held", "TokenRefused", "Tokens"]

#: The token format; 1 (no expiry of its own, before issue #32) is refused.
_VERSION = 2
#: Seconds a token is still accepted after its expiry: room for the clocks of the issuer and
#: the reader to differ. A settled token stays marked in the store until its expiry plus twice
#: this (``_decide``), so that no reader whose clock is within it accepts it again.
CLOCK_SLACK = 5.0
_B64URL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


class TokenRefused(ValueError):
    """A token, or a settle, that the service refuses; ``status`` is the HTTP status to answer:
    400 malformed, 403 forged or signed with another key, 409 settled already, 410 expired, of
    the first format (no expiry of its own) or its rule is no longer configured."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Held:
    """What a token says: a reservation of ``estimate`` for the descriptor ``entries`` of
    ``domain`` (with its ``limit`` override, if any) under the rule whose policy is ``policy``,
    counted by the store at ``stamp`` (None: a failure mode admitted it, the store holds
    nothing); ``issued`` and ``expires`` in seconds since the epoch (``expires``: the issuer's
    ttl after ``issued``); ``nonce`` makes each token one of a kind."""

    domain: str
    entries: tuple[tuple[str, str], ...]
    limit: tuple[int, str] | None
    policy: str
    estimate: int
    stamp: int | None
    issued: float
    expires: float
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
    """Signs and reads tokens under ``key``. A token issued here expires ``ttl`` seconds after
    it was issued: the expiry is written in the token, and read checks the token's own expiry
    (plus :data:`CLOCK_SLACK`), never this ``ttl``, so replicas with different ttls agree."""

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
        """A token for a reservation made now, expiring ``ttl`` seconds from now."""
        now = self.clock()
        data = {
            "v": _VERSION,
            "d": domain,
            "e": [list(entry) for entry in entries],
            "l": list(limit) if limit is not None else None,
            "p": policy,
            "n": estimate,
            "s": stamp,
            "t": round(now * 1000),
            "x": round((now + self.ttl) * 1000),
            "r": secrets.token_hex(12),
        }
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
        payload = _b64(text.encode("utf-8"))
        return f"{payload}.{_b64(self._mac(payload))}"

    def read(self, token: str) -> Held:
        """The reservation ``token`` holds; raises :class:`TokenRefused`: 400 when it is not a
        token, 403 when its mac does not verify, 410 when it expired (its own expiry, plus
        :data:`CLOCK_SLACK`) or is of the first format (no expiry of its own)."""
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
        except (binascii.Error, ValueError):
            raise _malformed("unreadable payload") from None
        if isinstance(data, dict) and data.get("v") == 1:
            raise TokenRefused(
                410,
                "the reservation token is of the first format, which has no expiry of its own "
                "and is no longer settled (ratekeeper was upgraded since it was issued); its "
                "estimate stays counted until its window ends",
            )
        try:
            held = _held(data)
        except (ValueError, TypeError, KeyError, IndexError):
            raise _malformed("unreadable payload") from None
        late = self.clock() - held.expires
        if late > CLOCK_SLACK:
            raise TokenRefused(
                410,
                f"the reservation expired {late:.0f} s ago: a token settles until the expiry it "
                f"carries ({held.expires - held.issued:g} s after its reservation, the issuing "
                f"replica's --reservation-ttl, plus {CLOCK_SLACK:g} s of clock slack); its "
                "estimate stays counted",
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
        expires=_int(data["x"]) / 1000,
        nonce=_str(data["r"]),
    )
