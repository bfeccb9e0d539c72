"""The top offenders' store script's reference: what ``lua/top.lua`` does, for the memory
backend.

Not a rate algorithm (no policy names it): the merge and the read of ``ratekeeper._engine.top``. A
minute's sorted set is a dict identity -> count here, its total an int. The script's ARGV
mixes identities (strings) with numbers, so this reference reads the raw ARGV rather than the
decoded layout of the algorithms. No deliberate differences from the script.
"""

from __future__ import annotations

from collections.abc import Sequence

from .keyspace import Keyspace

__all__ = ["MERGE", "READ", "SCRIPT", "reference"]

SCRIPT = "top"
MERGE = 0
READ = 1


def reference(
    keyspace: Keyspace, keys: tuple[str, ...], args: Sequence[int | str], now: int
) -> list[int | str]:
    """``lua/top.lua`` on ``keyspace`` at ``now`` (microseconds)."""
    if int(args[2]) == MERGE:
        ttl, kept, added = int(args[6]), int(args[7]), int(args[8])
        total: int = keyspace.get(keys[1], now) or 0
        counts: dict[str, int] = dict(keyspace.get(keys[0], now) or {})
        for i in range(9, len(args), 2):
            member = str(args[i])
            counts[member] = counts.get(member, 0) + int(args[i + 1])
        if len(counts) > kept:  # the lowest go (by count, then by member, as ZSETs order)
            ordered = sorted(counts.items(), key=lambda item: (item[1], item[0]))
            counts = dict(ordered[len(counts) - kept :])
        keyspace.set(keys[0], counts, ttl, now)
        keyspace.set(keys[1], total + added, ttl, now)
        return [len(counts)]
    most = int(args[6])
    sums: dict[str, int] = {}
    grand = 0
    for i in range(0, len(keys), 2):
        for member, count in (keyspace.get(keys[i], now) or {}).items():
            sums[member] = sums.get(member, 0) + count
        grand += keyspace.get(keys[i + 1], now) or 0
    ranked = sorted(sums.items(), key=lambda item: (-item[1], item[0]))[:most]
    reply: list[int | str] = [grand]
    for member, count in ranked:
        reply += [member, count]
    return reply
