"""Sliding window counter (Cloudflare's estimate); mirrors ``lua/sliding_window.lua``.

O(1) memory per identity and rate: the current and previous window counts. The previous
window's count is weighted by how much of it still overlaps the sliding window. Arithmetic is
on integers in milliseconds, so the script and this reference agree exactly.

Deliberate differences from the script (also in its header), which change no reply and no
stored field:

* The TTL skip: on the server's clock, a script admission in the windows already stored
  writes only the current counts and skips PEXPIRE, because the TTL set when those windows
  were stored already runs to the end of the longest window after them. This reference writes
  every field (the window starts and previous counts with the values they had) and sets the
  TTL on every admission: the same end, within the TTL's rounding to whole milliseconds. On a
  client's clock the script also writes everything, since the server's clock that runs the
  TTL may not keep pace with the client's.
* The script reads only this policy's fields (HMGET); this reference reads the whole hash.
* The script takes the window in ms as ``window / 1000`` in a double, this reference as
  ``window // 1000``: the same, as a window is always whole milliseconds (``Rate.period_us``).
"""

from __future__ import annotations

from .._model.errors import ConfigError
from .._model.rates import MAX_INT
from ._base import (
    CHARGE,
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
    for rate in policy.rates:
        if 2 * rate.limit * rate.period_ms > MAX_INT:
            raise ConfigError(
                f"policy {policy.name!r}: sliding_window needs limit x period in ms <= 2**52 "
                f"for exact arithmetic (a settled reservation may count up to twice the limit), "
                f"and {rate} exceeds it; use a shorter period"
            )


def _counts(stored: dict[str, int], i: int, start: int, window: int) -> tuple[int, int]:
    """Rate ``i``'s counts in the window starting at ``start`` and in the one before."""
    w = stored.get(f"w{i}")
    if w == start:
        return stored[f"c{i}"], stored[f"p{i}"]
    if w == start - window:
        return 0, stored[f"c{i}"]
    return 0, 0


def _cap(limit: int, wms: int) -> int:
    """The largest count a charge leaves in a window: every product stays below 2**53."""
    return MAX_INT // wms - limit


def settle(keyspace: Keyspace, key: str, args: Args) -> None:
    """A charge (in the current window, past the limit) or a refund (from the window the
    reservation was counted in, current or previous), as the script's settle block."""
    now, cost = args.now, args.cost
    stored: dict[str, int] = keyspace.get(key, now) or {}
    at = int(args.token) if args.mode == REFUND else 0
    writes: dict[str, int] = {}
    expire_at = 0
    changed = False
    for i, (limit, window) in enumerate(args.rates, 1):
        start = now - now % window
        curr, prev = _counts(stored, i, start, window)
        if cost > 0:
            since = at - at % window
            if args.mode == CHARGE:
                curr, changed = min(curr + cost, _cap(limit, window // 1000)), True
            elif since == start:
                curr, changed = max(curr - cost, 0), True
            elif since == start - window:
                prev, changed = max(prev - cost, 0), True
        writes.update({f"w{i}": start, f"c{i}": curr, f"p{i}": prev})
        expire_at = max(expire_at, start + 2 * window)
    if changed:
        ttl = _ceil_div(expire_at - now, 1000) + args.margin_ms
        keyspace.set(key, {**stored, **writes}, ttl, now)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def reference(keyspace: Keyspace, keys: tuple[str, ...], args: Args) -> Reply:
    if args.mode in SETTLES:
        settle(keyspace, keys[0], args)
        args = args.settled()
    now, cost = args.now, args.cost
    stored: dict[str, int] = keyspace.get(keys[0], now) or {}
    allowed = True
    state = []
    for i, (limit, window) in enumerate(args.rates, 1):
        start = now - now % window
        curr, prev = _counts(stored, i, start, window)
        wms, e = window // 1000, (now - start) // 1000
        state.append((start, curr, prev, wms, e))
        if prev * (wms - e) > (limit - curr - cost) * wms:
            allowed = False
    consume = allowed and args.consumes
    reply = [1 if allowed else 0]
    expire_at = 0
    writes: dict[str, int] = {}
    for i, ((limit, window), (start, curr0, prev, wms, e)) in enumerate(
        zip(args.rates, state, strict=True), 1
    ):
        curr = curr0 + cost if consume else curr0
        remaining = max(limit - curr - _ceil_div(prev * (wms - e), wms), 0)
        reset = 0
        if curr > 0:
            reset = start + 2 * window - now
        elif prev > 0:
            reset = start + window - now
        retry = RETRY_NONE
        if cost > limit:
            retry = RETRY_NEVER
        elif prev * (wms - e) > (limit - curr0 - cost) * wms:
            if curr0 + cost <= limit:
                at = wms - (limit - curr0 - cost) * wms // prev
                retry = start + at * 1000 - now
            else:
                at = wms - (limit - cost) * wms // curr0
                retry = start + window + at * 1000 - now
        reply += (remaining, reset, retry)
        expire_at = max(expire_at, start + 2 * window)
        writes.update({f"w{i}": start, f"c{i}": curr, f"p{i}": prev})
    if consume:
        ttl = _ceil_div(expire_at - now, 1000) + args.margin_ms
        keyspace.set(keys[0], {**stored, **writes}, ttl, now)
    if consume and args.mode == RESERVE:
        reply.append(now)  # the reservation's stamp
    return reply


ALGORITHM = Algorithm(
    name="sliding_window",
    script="sliding_window",
    suffixes=("sw",),
    reference=reference,
    validate=validate,
)
