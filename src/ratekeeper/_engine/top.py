"""Top offenders: who is being denied, per policy, across the fleet, in bounded memory.

Each limiter counts the identities it denies (a deny-cache answer included) in a fixed-size
summary per policy, and merges it into the store every few seconds in one script call per
policy (``lua/top.lua``): a sorted set per policy and minute, trimmed to a fixed number of
members, with a TTL. An allowed decision costs nothing here; a denial costs a dict update.

**The summary** is Space-Saving (Metwally, Agrawal and El Abbadi, 2005): ``capacity``
counters; an identity not counted yet takes the smallest counter's place and count (plus its
own). No count is ever under the truth, and none is more than ``N / capacity`` over it, where
``N`` is what the summary counted; an identity denied more often than that is always in it.
While no more identities are denied between two merges than there are counters, every count
is exact.

**The store** sums the merges of every limiter and keeps the ``KEPT_FACTOR * capacity``
highest counts of each minute: a member dropped there had at most ``N / kept`` (the counts of
the kept ones are higher, and they add up to no more than ``N``). So every count read back is
within ``N / capacity`` of the true count of denials in those minutes, ``N`` being their
total: :class:`Offenders` states that bound with the list. The memory is bounded whatever the
number of identities: at most ``kept`` members of at most ``KEY_BYTES`` each per policy and
minute, for ``RETENTION`` seconds.

**Privacy**: with a ``hash_key``, identities are stored as ``h:`` + a keyed BLAKE2b digest
(the operator who holds the key can check a suspect with :meth:`TopOffenders.name`); an
identity longer than ``KEY_BYTES`` is stored as its plain digest (``d:...``), so the members
stay small.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import blake2b

from .._algorithms import encode_args
from .._algorithms.policy import Policy
from .._algorithms.scripts import Script, load_script
from .._algorithms.top import MERGE, READ
from .._model.errors import ConfigError
from .keys import Identity, identity_bytes

__all__ = ["KEPT_FACTOR", "RETENTION", "Offender", "Offenders", "TopOffenders"]

#: The store keeps this many times ``capacity`` members per policy and minute.
KEPT_FACTOR = 4
#: Seconds a minute's counts stay in the store (``since`` can reach this far back).
RETENTION = 3600
#: The longest identity stored as it is (UTF-8 bytes); a longer one is stored as its digest.
KEY_BYTES = 128
#: Seconds between merges into the store, while there is something to merge.
FLUSH_EVERY = 5.0


@dataclass(frozen=True, slots=True)
class Offender:
    """One identity of the top list: the denials counted for it in the minutes asked (within
    the list's ``error`` of the true count)."""

    identity: str
    denied: int


@dataclass(frozen=True, slots=True)
class Offenders:
    """The top identities of one policy, most denied first. ``total``: every denial counted
    for the policy in those minutes; ``error``: the most any ``denied`` may be off by
    (``total / capacity``, rounded down: the counts are whole)."""

    policy: str
    since: float
    total: int
    error: int
    offenders: tuple[Offender, ...]


class _Summary:
    """Space-Saving: at most ``capacity`` counters."""

    __slots__ = ("capacity", "counts", "total")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.counts: dict[str, int] = {}
        self.total = 0

    def add(self, member: str, weight: int) -> None:
        counts = self.counts
        self.total += weight
        count = counts.get(member)
        if count is not None:
            counts[member] = count + weight
        elif len(counts) < self.capacity:
            counts[member] = weight
        else:  # the smallest counter gives its place, and its count, to the newcomer
            smallest = min(counts, key=counts.__getitem__)
            counts[member] = counts.pop(smallest) + weight


class TopOffenders:
    """The summaries of one limiter, and the store calls that merge and read them.

    ``record`` is called on each denial (from any thread); ``drain`` hands what was counted to
    the merge, and ``wake`` (set by the limiter) starts the merge timer when the first denial
    after a merge is counted."""

    def __init__(
        self,
        prefix: str,
        capacity: int,
        hash_key: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(
                f"top_offenders must be an int >= 1 (or 0 for none), got {capacity!r}"
            )
        self.prefix = prefix
        self.capacity = capacity
        self.kept = KEPT_FACTOR * capacity
        self.hash_key = hash_key
        self.clock = clock
        self.script: Script = load_script("top")
        self._lock = threading.Lock()
        self._summaries: dict[str, _Summary] = {}
        self._waiting = False
        #: Starts the merge timer (set by the limiter that owns this).
        self.wake: Callable[[], None] = lambda: None

    def name(self, identity: Identity) -> str:
        """How ``identity`` is stored and listed."""
        raw = identity_bytes(identity)
        if self.hash_key is not None:
            return "h:" + blake2b(raw, key=self.hash_key, digest_size=16).hexdigest()
        if len(raw) > KEY_BYTES:
            return "d:" + blake2b(raw, digest_size=16).hexdigest()
        return raw.decode("utf-8", "backslashreplace")

    def record(self, policy: Policy, identity: Identity, cost: int) -> None:
        """Count a denial of ``cost`` for ``identity`` under ``policy``."""
        member = self.name(identity)
        with self._lock:
            summary = self._summaries.get(policy.name)
            if summary is None:
                summary = self._summaries[policy.name] = _Summary(self.capacity)
            summary.add(member, cost)
            wake = not self._waiting
            self._waiting = True
        if wake:
            self.wake()

    def drain(self) -> list[tuple[Script, tuple[str, ...], tuple[int | str, ...]]]:
        """The merge calls of everything counted since the last drain (one per policy), and
        the summaries emptied."""
        with self._lock:
            summaries, self._summaries = self._summaries, {}
            self._waiting = False
        minute = int(self.clock() // 60)
        calls: list[tuple[Script, tuple[str, ...], tuple[int | str, ...]]] = []
        for policy, summary in summaries.items():
            extra: list[int | str] = [RETENTION * 1000 + 60_000, self.kept, summary.total]
            for member, count in summary.counts.items():
                extra += [member, count]
            calls.append((self.script, self._keys(policy, minute), self._args(MERGE, extra)))
        return calls

    def forget(self) -> None:
        """Drop what was counted and not merged (a forked child: its parent merges it)."""
        with self._lock:
            self._summaries = {}
            self._waiting = False

    def read_call(
        self, policy: str, since: float, limit: int
    ) -> tuple[Script, tuple[str, ...], tuple[int | str, ...]]:
        """The call that reads the top ``limit`` of ``policy`` over the last ``since``
        seconds (whole minutes, the current one included)."""
        if (
            isinstance(since, bool)
            or not isinstance(since, (int, float))
            or not 0 < since <= RETENTION
        ):
            raise ConfigError(f"since must be seconds in (0, {RETENTION}], got {since!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"limit must be an int >= 1, got {limit!r}")
        now = self.clock()
        last = int(now // 60)
        first = int((now - since) // 60)
        keys: tuple[str, ...] = ()
        for minute in range(max(first, last - RETENTION // 60), last + 1):
            keys += self._keys(policy, minute)
        return self.script, keys, self._args(READ, [limit])

    def offenders(self, policy: str, since: float, reply: Sequence[object]) -> Offenders:
        """The reply of :meth:`read_call`, read."""
        total = int(reply[0])  # type: ignore[call-overload]
        listed = []
        for i in range(1, len(reply), 2):
            member = reply[i]
            identity = (
                member.decode("utf-8", "backslashreplace")
                if isinstance(member, bytes)
                else str(member)
            )
            listed.append(Offender(identity, int(reply[i + 1])))  # type: ignore[call-overload]
        error = total // self.capacity  # counts are whole: within N / capacity, rounded down
        return Offenders(policy, float(since), total, error, tuple(listed))

    def _args(self, mode: int, extra: list[int | str]) -> tuple[int | str, ...]:
        # The client's time (the script does not use it): no TIME call in the store.
        now = int(self.clock() * 1_000_000)
        head = encode_args(now, cost=0, mode=mode, token="", margin_ms=0, rates=())
        return head + tuple(extra)

    def _keys(self, policy: str, minute: int) -> tuple[str, str]:
        base = f"{self.prefix}:top:{{{policy}}}:{minute}"
        return f"{base}:denied", f"{base}:total"
