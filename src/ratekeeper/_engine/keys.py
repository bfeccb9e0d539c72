"""The only place Redis keys are built.

A key looks like ``<prefix>:<policy>:{<tag>}:<suffix>``:

* ``prefix`` and ``policy`` are validated configuration and contain no braces;
* ``tag`` is 22 characters of URL-safe base64 of a 128-bit BLAKE2b digest of the policy name and
  the identity. Every key of one decision shares it, so Redis Cluster puts them in one slot, and
  the identity never appears raw: it cannot pick the slot, collide with another identity through
  escaping tricks, or make the key longer than a fixed bound;
* ``suffix`` names the algorithm's structure.
"""

from __future__ import annotations

import re
from binascii import b2a_base64
from functools import lru_cache
from hashlib import blake2b
from typing import Any

from .._model.errors import ConfigError

__all__ = ["DEFAULT_KEY_PREFIX", "Identity", "KeyBuilder", "identity_bytes"]

Identity = str | bytes | int

DEFAULT_KEY_PREFIX = "ratekeeper"

#: base64 to its URL-safe alphabet (``base64.urlsafe_b64encode``, without its two calls).
_URL_SAFE = bytes.maketrans(b"+/", b"-_")

_PREFIX = re.compile(r"[A-Za-z0-9_.:/-]{1,64}", re.ASCII)


def identity_bytes(identity: Identity) -> bytes:
    """Encode an identity for hashing. ``None`` and other types are a ConfigError.

    ``str`` is encoded as UTF-8 (lone surrogates are kept, not rejected), ``int`` as its decimal
    string, so ``42`` and ``"42"`` are the same identity, as are ``"a"`` and ``b"a"``.
    """
    if isinstance(identity, str):
        return identity.encode("utf-8", "surrogatepass")
    if isinstance(identity, bytes):
        return identity
    if isinstance(identity, int) and not isinstance(identity, bool):
        try:
            return str(identity).encode("ascii")
        except ValueError:  # more digits than sys.get_int_max_str_digits()
            raise ConfigError("an int identity this large cannot be used; pass a str") from None
    raise ConfigError(f"identity must be str, bytes or int, got {type(identity).__name__}")


#: Recent (policy, identity) pairs whose keys are kept ready (about 300 bytes each).
KEY_CACHE_SIZE = 4096
_CACHED_IDENTITY_LEN = 256
#: Policy names whose digest state (after hashing the name) is kept to be copied.
_NAMED_STATES = 1024


class KeyBuilder:
    """Builds the keys of one decision from a policy name and an identity."""

    __slots__ = ("_cached", "_named", "prefix")

    def __init__(self, prefix: str = DEFAULT_KEY_PREFIX) -> None:
        if not isinstance(prefix, str) or _PREFIX.fullmatch(prefix) is None:
            raise ConfigError(
                f"key_prefix {prefix!r} is invalid: use 1-64 characters of "
                "A-Z a-z 0-9 _ . : / - (no braces: they would become the cluster hash tag)"
            )
        self.prefix = prefix
        # Hot identities (a flood, a busy user) skip the digest; typed, so 1 and True differ.
        self._cached = lru_cache(maxsize=KEY_CACHE_SIZE, typed=True)(self._build)
        self._named: dict[str, Any] = {}  # policy name -> digest state after the name

    def tag(self, policy_name: str, identity: Identity) -> str:
        """The hash tag shared by every key of one (policy, identity)."""
        named = self._named.get(policy_name)
        if named is None:
            name = policy_name.encode("ascii")
            named = blake2b(digest_size=16, person=b"ratekeeper-id")
            # Length-prefix the name so (name, identity) pairs can never run into each other.
            named.update(len(name).to_bytes(2, "big"))
            named.update(name)
            if len(self._named) < _NAMED_STATES:
                self._named[policy_name] = named
        h = named.copy()
        h.update(
            identity.encode("utf-8", "surrogatepass")  # the usual identity, without a call
            if type(identity) is str
            else identity_bytes(identity)
        )
        return b2a_base64(h.digest(), newline=False).translate(_URL_SAFE)[:22].decode("ascii")

    def fleet_key(self) -> str:
        """The sorted set of live instances with ``local_share="auto"`` under this prefix:
        ``<prefix>:{fleet}``. No policy key has this shape (theirs have a policy segment and
        a 22-character tag), and it is one key, so any cluster slot will do."""
        return f"{self.prefix}:{{fleet}}"

    def keys(
        self, policy_name: str, identity: Identity, suffixes: tuple[str, ...]
    ) -> tuple[str, ...]:
        """The keys of one decision: one per suffix, all in the same cluster slot."""
        if isinstance(identity, (str, bytes)) and len(identity) > _CACHED_IDENTITY_LEN:
            return self._build(policy_name, identity, suffixes)  # never kept: it may be huge
        try:
            return self._cached(policy_name, identity, suffixes)
        except TypeError:  # an unhashable identity: _build says what is wrong with it
            return self._build(policy_name, identity, suffixes)

    def _build(
        self, policy_name: str, identity: Identity, suffixes: tuple[str, ...]
    ) -> tuple[str, ...]:
        base = f"{self.prefix}:{policy_name}:{{{self.tag(policy_name, identity)}}}:"
        if len(suffixes) == 1:  # every algorithm so far: skip the generator
            return (base + suffixes[0],)
        return tuple(base + suffix for suffix in suffixes)
