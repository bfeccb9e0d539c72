"""Fixed window: a counter per epoch-aligned window; mirrors ``lua/fixed_window.lua``.

Exact within a window; a client can spend up to twice the limit across a window boundary.
The key expires at the end of the longest current window (plus the margin), so hits never
keep it alive longer than its window.

Deliberate differences from the script (also in its header), which change no reply and no
stored field:

* The TTL skip: on the server's clock, a script admission in the windows already stored
  writes only the counts and skips PEXPIRE, because the TTL set when those windows were stored
  already ends with the longest of them. This reference writes every field and sets the TTL on
  every admission: the same end, within the TTL's rounding to whole milliseconds. On a
  client's clock the script also writes everything, since the server's clock that runs the
  TTL may not keep pace with the client's.
* The script reads only this policy's fields (HMGET); this reference reads the whole hash.
"""

from __future__ import annotations

from ._base import (
    CHARGE,
    MAX_COUNTER_LIMIT,
    REFUND,
    RESERVE,
    RETRY_NEVER,
    RETRY_NONE,
    SETTLES,
    Algorithm,
    Args,
    Limits,
    Reply,
    check_limits,
)
from .keyspace import Keyspace


def validate(policy: Limits) -> None:
    check_limits(policy)


def settle(keyspace: Keyspace, key: str, args: Args) -> None:
    """A charge (in the current windows, past the limit) or a refund (from each rate whose
    current window is the reservation's), as the script's settle block."""
    now, cost = args.now, args.cost
    stored: dict[str, int] = keyspace.get(key, now) or {}
    at = int(args.token) if args.mode == REFUND else 0
    writes: dict[str, int] = {}
    expire_at = 0
    changed = False
    for i, (_, window) in enumerate(args.rates, 1):
        start = now - now % window
        count = stored.get(f"c{i}", 0) if stored.get(f"w{i}") == start else 0
        if cost > 0 and args.mode == CHARGE:
            count, changed = min(count + cost, MAX_COUNTER_LIMIT), True
        elif cost > 0 and at - at % window == start:
            count, changed = max(count - cost, 0), True
        writes.update({f"w{i}": start, f"c{i}": count})
        expire_at = max(expire_at, start + window)
    if changed:
        ttl = -(-(expire_at - now) // 1000) + args.margin_ms
        keyspace.set(key, {**stored, **writes}, ttl, now)


def reference(keyspace: Keyspace, keys: tuple[str, ...], args: Args) -> Reply:
    if args.mode in SETTLES:
        settle(keyspace, keys[0], args)
        args = args.settled()
    now, cost = args.now, args.cost
    stored: dict[str, int] = keyspace.get(keys[0], now) or {}
    allowed = True
    starts, counts = [], []
    for i, (limit, window) in enumerate(args.rates, 1):
        start = now - now % window
        count = stored.get(f"c{i}", 0) if stored.get(f"w{i}") == start else 0
        starts.append(start)
        counts.append(count)
        if count + cost > limit:
            allowed = False
    consume = allowed and args.consumes
    reply = [1 if allowed else 0]
    expire_at = 0
    writes: dict[str, int] = {}
    for i, ((limit, window), start, count) in enumerate(
        zip(args.rates, starts, counts, strict=True), 1
    ):
        used = count + cost if consume else count
        ends = start + window
        retry = RETRY_NONE
        if count + cost > limit:
            retry = RETRY_NEVER if cost > limit else ends - now
        reply += (max(limit - used, 0), ends - now if used > 0 else 0, retry)
        expire_at = max(expire_at, ends)
        writes[f"w{i}"] = start
        writes[f"c{i}"] = used
    if consume:
        stored = {**stored, **writes}
        keyspace.set(keys[0], stored, -(-(expire_at - now) // 1000) + args.margin_ms, now)
    if consume and args.mode == RESERVE:
        reply.append(now)  # the reservation's stamp
    return reply


ALGORITHM = Algorithm(
    name="fixed_window",
    script="fixed_window",
    suffixes=("fw",),
    reference=reference,
    validate=validate,
)
