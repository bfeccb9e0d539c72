"""Sliding-window log: the exact algorithm, one sorted-set entry per admitted unit of cost.

The reference below returns what ``lua/sliding_log.lua`` returns and keeps the same log. A rate
(limit L, window W) admits a hit of cost c at time t when the entries with time in (t - W, t]
(and any later ones) number at most L - c. An admitted hit adds c entries at time t.

Deliberate differences from the script (also in its header), which change no reply and no
stored time:

* This log is a sorted list of times, and the token (ARGV 4) is unused. The script's sorted
  set needs a member per unit, ``token.i``, to keep equal times apart, so it relies on tokens
  being unique per call; a reused token would move members there instead of adding entries.
* The read shortcut: the script reads the newest two entries first. It counts a window
  (ZCOUNT) only when both are inside it and the log may hold more, looks up the entry a
  denial waits for only when it is older than those two, and prunes only when it did not read
  the whole log or an entry it read has left the longest window. This reference bisects and
  prunes on every admission.
"""

from __future__ import annotations

from bisect import bisect_right, insort_right
from typing import TYPE_CHECKING

from .._errors import ConfigError
from .._keyspace import Keyspace

if TYPE_CHECKING:
    from .._policy import Policy

from ._base import RETRY_NEVER, RETRY_NONE, Algorithm, Args, Reply


def validate(policy: Policy) -> None:
    if policy.max_limit > policy.max_log_entries:
        raise ConfigError(
            f"policy {policy.name!r}: sliding_log keeps one entry per unit of cost, and a limit "
            f"of {policy.max_limit} exceeds max_log_entries={policy.max_log_entries}. Use an "
            "O(1) algorithm instead: 'sliding_window', 'fixed_window' or 'gcra' (or raise "
            "max_log_entries knowingly)"
        )


def reference(keyspace: Keyspace, keys: tuple[str, ...], args: Args) -> Reply:
    now, cost = args.now, args.cost
    log: list[int] = keyspace.get(keys[0], now) or []
    newest = log[-1] if log else None
    starts = []
    allowed = True
    for limit, window in args.rates:
        start = bisect_right(log, now - window)  # first entry inside (now - window, +inf)
        starts.append(start)
        if len(log) - start + cost > limit:
            allowed = False
    consume = allowed and args.consumes
    reply = [1 if allowed else 0]
    for (limit, window), start in zip(args.rates, starts, strict=True):
        count = len(log) - start
        used = count + cost if consume else count
        remaining = max(limit - used, 0)
        retry = RETRY_NONE
        if count + cost > limit:
            if cost > limit:
                retry = RETRY_NEVER
            else:
                retry = log[start + count + cost - limit - 1] + window - now
        last = newest
        if consume and (last is None or now > last):
            last = now
        reset = 0
        if last is not None and used > 0:
            reset = max(last + window - now, 0)
        reply += (remaining, reset, retry)
    if consume:
        if newest is None or now >= newest:
            log.extend([now] * cost)
        else:
            for _ in range(cost):
                insort_right(log, now)
        longest = max(window for _, window in args.rates)
        del log[: bisect_right(log, now - longest)]
        keyspace.set(keys[0], log, -(-longest // 1000) + args.margin_ms, now)
    return reply


ALGORITHM = Algorithm(
    name="sliding_log",
    script="sliding_log",
    suffixes=("log",),
    reference=reference,
    validate=validate,
)
