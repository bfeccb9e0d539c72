"""``local_share="auto"``: the fleet count that sizes the local fallback, kept by heartbeats.

While the store answers, every limiter with an auto share runs ``lua/fleet.lua`` at most once
per ``heartbeat``, right after a decision the store made: the script stamps this limiter's
instance id with an expiry ``ttl`` ahead, drops the ids whose expiry has passed and returns how
many remain. When the store fails, the ``local`` failure mode grants ``limit // N`` of each
limit, N being the largest count this limiter saw in the ``ttl`` before its last heartbeat (the
largest, so that a store that lost the set, or instances that had not beaten yet, cannot make
the share grow). The fleet is every limiter with an auto share on the same store and
``key_prefix``. Until a count is known the local mode denies, as ``closed`` does: granting the
whole limit per instance would multiply it by the fleet's size.

A heartbeat is a store call like a decision's: the breaker and the metrics see its outcome
once, and it never raises a store failure to the caller. The blocking limiter runs it inline
(one round trip per ``heartbeat``); the asyncio limiter runs it as a task beside the caller's
decision, so the decision does not wait for it.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections import deque
from collections.abc import Callable

from .._algorithms import HIT, encode_args
from .._algorithms.scripts import Script, load_script
from .._model.options import AutoShare

__all__ = ["Fleet"]

#: Milliseconds the fleet key outlives its newest member (clock skew, as for every key).
_MARGIN_MS = 1_000


#: (script, keys, args) of one heartbeat.
Beat = tuple[Script, tuple[str, ...], tuple[int | str, ...]]


class Fleet:
    """One limiter's membership in its fleet: when to beat, its id, the counts it saw."""

    def __init__(
        self,
        key: str,
        share: AutoShare,
        *,
        clock_us: Callable[[], int],
        client_time: bool,
        new_id: Callable[[], str],
    ) -> None:
        self.key = key
        self.heartbeat_us = round(share.heartbeat * 1_000_000)
        self.ttl_us = round(share.ttl_seconds * 1_000_000)
        self._clock_us = clock_us
        self._client_time = client_time
        self._new_id = new_id
        self._pid = os.getpid()
        self._id = new_id()
        self._lock = threading.Lock()
        self._next = -math.inf  # the first decision beats
        self._in_flight = False
        self._seen: deque[tuple[int, int]] = deque()  # (at, count), within ttl of the newest
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def instance_id(self) -> str:
        """This limiter's member in the fleet set; a forked child takes a new one."""
        if os.getpid() != self._pid:
            self._pid, self._id, self._next = os.getpid(), self._new_id(), -math.inf
        return self._id

    @property
    def count(self) -> int | None:
        """The instances to share with: the largest count seen in the ttl before the last
        heartbeat (None before any)."""
        seen = self._seen
        return max(count for _, count in seen) if seen else None

    def due(self) -> Beat | None:
        """The heartbeat call if one is due now (and claim it), else None."""
        member = self.instance_id
        now = self._clock_us()
        if now < self._next or self._in_flight:
            return None
        with self._lock:
            if now < self._next or self._in_flight:
                return None
            self._in_flight = True
        args = encode_args(
            now if self._client_time else 0,
            cost=1,
            mode=HIT,
            token=member,
            margin_ms=_MARGIN_MS,
            rates=(),
            extra=(self.ttl_us,),
        )
        return load_script("fleet"), (self.key,), args

    def beaten(self, reply: list[int] | None) -> None:
        """The heartbeat's outcome: the live count it returned, or None if it failed (then
        the next decision tries again, one heartbeat later)."""
        now = self._clock_us()
        with self._lock:
            self._in_flight = False
            self._next = now + self.heartbeat_us
            if reply is not None:
                seen = self._seen
                seen.append((now, int(reply[0])))
                while seen[0][0] < now - self.ttl_us:
                    seen.popleft()

    def track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def join(self) -> None:
        """Wait for the heartbeat tasks in flight (for tests, and before closing a storage)."""
        if self._tasks:
            await asyncio.gather(*self._tasks)
