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

from typing import TYPE_CHECKING

from .._errors import ConfigError
from .._keyspace import Keyspace
from .._rates import MAX_INT
from ._base import RETRY_NEVER, RETRY_NONE, Algorithm, Args, Reply, check_limits

if TYPE_CHECKING:
    from .._policy import Policy


def validate(policy: Policy) -> None:
    check_limits(policy)
    for rate in policy.rates:
        if rate.limit * rate.period_ms > MAX_INT:
            raise ConfigError(
                f"policy {policy.name!r}: sliding_window needs limit x period in ms <= 2**53 "
                f"for exact arithmetic, and {rate} exceeds it; use a shorter period"
            )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def reference(keyspace: Keyspace, keys: tuple[str, ...], args: Args) -> Reply:
    now, cost = args.now, args.cost
    stored: dict[str, int] = keyspace.get(keys[0], now) or {}
    allowed = True
    state = []
    for i, (limit, window) in enumerate(args.rates, 1):
        start = now - now % window
        w = stored.get(f"w{i}")
        curr = prev = 0
        if w == start:
            curr, prev = stored[f"c{i}"], stored[f"p{i}"]
        elif w == start - window:
            prev = stored[f"c{i}"]
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
    return reply


ALGORITHM = Algorithm(
    name="sliding_window",
    script="sliding_window",
    suffixes=("sw",),
    reference=reference,
    validate=validate,
)
