"""The fleet heartbeat's reference: what ``lua/fleet.lua`` does, for the memory backend.

Not a rate algorithm (no policy names it): the ``local_share="auto"`` heartbeat of
``ratekeeper._engine.fleet``. The fleet key holds ``{instance id: expiry}`` (microseconds); a
heartbeat stamps ARGV 4 (the id) with ``now + ttl`` (ARGV 7), drops the members whose expiry
is at or before ``now``, keeps the key for the longest membership left plus the margin and
returns ``[count]``.
No deliberate differences from the script.
"""

from __future__ import annotations

from ._base import Args, Reply
from .keyspace import Keyspace

__all__ = ["SCRIPT", "reference"]

SCRIPT = "fleet"


def reference(keyspace: Keyspace, keys: tuple[str, ...], args: Args) -> Reply:
    now, (ttl,) = args.now, args.extra
    members: dict[str, int] = keyspace.get(keys[0], now) or {}
    members[args.token] = now + ttl
    for member in [m for m, expiry in members.items() if expiry <= now]:
        del members[member]
    longest = max(members.values()) - now
    keyspace.set(keys[0], members, -(-longest // 1000) + args.margin_ms, now)
    return [len(members)]
