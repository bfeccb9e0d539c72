"""Concurrency leases: at most ``limit`` units in flight; mirrors ``lua/concurrency.lua``.

The policy has one rate: its limit is the number of units that may be held at once, and its
period is the lease timeout, after which an unreleased lease (a crashed holder) frees itself.

Deliberate differences from the script (also in its header), which change no reply and no
lease stored:

* The read shortcut: the script reads the newest three members first, and counts (ZCOUNT),
  looks up scores (ZMSCORE, a rank) and prunes expired leases only when those cannot answer;
  a release finds its own members among them by name (``token.unit``, unit 1 to cost). This
  reference bisects, looks members up by name and prunes on every acquire.
* A release that removes the last members: the script's ZREM deletes the key (Redis keeps no
  empty sorted set); this reference deletes it explicitly. Neither sets a TTL on release.
"""

from __future__ import annotations

from bisect import bisect_right, insort_right

from .._model.errors import ConfigError
from ._base import HIT, RELEASE, RETRY_NEVER, RETRY_NONE, Algorithm, Args, Limits, Reply
from .keyspace import Keyspace

#: Leases one identity may hold at once at most: each is a sorted-set member.
MAX_LEASES = 100_000


def validate(policy: Limits) -> None:
    if len(policy.rates) != 1:
        raise ConfigError(
            f"policy {policy.name!r}: a concurrency policy takes one limit, e.g. "
            "'10 per 30 seconds' for 10 leases that expire after 30 s unless released; "
            f"got {len(policy.rates)} rates"
        )
    if policy.max_limit > MAX_LEASES:
        raise ConfigError(
            f"policy {policy.name!r}: a concurrency limit above {MAX_LEASES} is not supported"
        )


class _Leases:
    """A sorted set in miniature: members with expiry scores, ordered by (score, member)."""

    __slots__ = ("order", "scores")

    def __init__(self) -> None:
        self.scores: dict[str, int] = {}
        self.order: list[tuple[int, str]] = []

    def live(self, now: int) -> list[tuple[int, str]]:
        return self.order[bisect_right(self.order, (now, "\U0010ffff")) :]

    def add(self, member: str, score: int) -> None:
        self.remove(member)
        self.scores[member] = score
        insort_right(self.order, (score, member))

    def remove(self, member: str) -> None:
        score = self.scores.pop(member, None)
        if score is not None:
            self.order.remove((score, member))

    def prune(self, now: int) -> None:
        cut = bisect_right(self.order, (now, "\U0010ffff"))
        for _, member in self.order[:cut]:
            del self.scores[member]
        del self.order[:cut]


def reference(keyspace: Keyspace, keys: tuple[str, ...], args: Args) -> Reply:
    now, cost, token = args.now, args.cost, args.token
    ((limit, timeout),) = args.rates
    leases: _Leases = keyspace.get(keys[0], now) or _Leases()
    if args.mode == RELEASE:
        members = [f"{token}.{j}" for j in range(1, cost + 1)]
        ok = 1 if any(leases.scores.get(m, now) > now for m in members) else 0
        for member in members:
            leases.remove(member)
        live = leases.live(now)
        reset = live[-1][0] - now if live else 0
        if not leases.scores:
            keyspace.delete([keys[0]])
        return [ok, max(limit - len(live), 0), reset, RETRY_NONE]
    live = leases.live(now)
    count = len(live)
    allowed = count + cost <= limit
    retry = RETRY_NONE
    if cost > limit:
        retry = RETRY_NEVER
    elif not allowed:
        retry = live[count + cost - limit - 1][0] - now
    used = count
    last = live[-1][0] if live else None
    if allowed and args.mode == HIT:
        used = count + cost
        expiry = now + timeout
        last = expiry if last is None or expiry > last else last
        for j in range(1, cost + 1):
            leases.add(f"{token}.{j}", expiry)
        leases.prune(now)
        keyspace.set(keys[0], leases, -(-(last - now) // 1000) + args.margin_ms, now)
    reset = last - now if used > 0 and last is not None else 0
    return [1 if allowed else 0, max(limit - used, 0), reset, retry]


ALGORITHM = Algorithm(
    name="concurrency",
    script="concurrency",
    suffixes=("leases",),
    reference=reference,
    validate=validate,
)
