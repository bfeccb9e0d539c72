"""Sliding-window log: the exact algorithm, one logged time per admitted unit of cost.

The reference below returns what ``lua/sliding_log.lua`` returns and keeps the same log: a list
of times, oldest first, as the script keeps it in a Redis list. A rate (limit L, window W)
admits a hit of cost c at time t when the entries with time in (t - W, t] (and any later ones)
number at most L - c. An admitted hit adds c entries at time max(t, the newest entry): the log
stays in time order even when a client's clock goes back, and an entry stamped later than its
admission leaves every window later, so it can only lengthen a wait, never admit more.

Deliberate differences from the script (also in its header), which change no reply and no
stored time:

* The token (ARGV 4) is unused on both sides: a list needs no unique members.
* The read shortcut: the script reads the newest two entries first and searches the rest of
  the list by index (LINDEX) only when both are inside a window, and counts a window shorter
  than the longest only up to its limit + 1 (a larger count gives the same reply); this
  reference bisects every window of every call.
"""

from __future__ import annotations

from bisect import bisect_right

from .._model.errors import ConfigError
from ._base import REFUND, RESERVE, RETRY_NEVER, RETRY_NONE, SETTLES, Algorithm, Args, Limits, Reply
from .keyspace import Keyspace


def validate(policy: Limits) -> None:
    if policy.max_limit > policy.max_log_entries:
        raise ConfigError(
            f"policy {policy.name!r}: sliding_log keeps one entry per unit of cost, and a limit "
            f"of {policy.max_limit} exceeds max_log_entries={policy.max_log_entries}. Use an "
            "O(1) algorithm instead: 'sliding_window', 'fixed_window' or 'gcra' (or raise "
            "max_log_entries knowingly)"
        )


def settle(keyspace: Keyspace, key: str, args: Args) -> None:
    """A refund (remove ``cost`` entries of the reservation's time) or a charge (append up to
    the largest limit of entries at max(now, the newest)), as the script's settle block."""
    now, cost = args.now, args.cost
    if cost == 0:
        return
    log: list[int] = keyspace.get(key, now) or []
    if args.mode == REFUND:
        at = int(args.token)
        for _ in range(cost):
            if at not in log:
                break
            log.remove(at)
        if not log:
            keyspace.delete([key])  # as Redis drops an empty list
        return
    stamp = max(now, log[-1]) if log else now
    log.extend([stamp] * min(cost, max(limit for limit, _ in args.rates)))
    longest = max(window for _, window in args.rates)
    keyspace.set(key, log, -(-(stamp - now + longest) // 1000) + args.margin_ms, now)


def reference(keyspace: Keyspace, keys: tuple[str, ...], args: Args) -> Reply:
    if args.mode in SETTLES:
        settle(keyspace, keys[0], args)
        args = args.settled()
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
        at = now if newest is None or now > newest else newest
        log.extend([at] * cost)
        longest = max(window for _, window in args.rates)
        del log[: bisect_right(log, now - longest)]
        # The log lives until its newest entry has left the longest window, plus the margin.
        keyspace.set(keys[0], log, -(-(at - now + longest) // 1000) + args.margin_ms, now)
        if args.mode == RESERVE:
            reply.append(at)  # a reservation's stamp: its entries' time
    return reply


ALGORITHM = Algorithm(
    name="sliding_log",
    script="sliding_log",
    # "times" holds a list; "log" held the earlier sorted set. The new suffix means a key left
    # by an older version is never read as a list (WRONGTYPE): it expires by its own TTL.
    suffixes=("times",),
    reference=reference,
    validate=validate,
)
