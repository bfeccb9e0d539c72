"""The deny cache: recent exact denials per key, answered without the store while they hold.

A denial the store made says exactly when the same hit could pass (``retry_after``), whatever
other clients do (they can only add load): until then, the same hit is denied again without a
round trip. The guard (``_guard``) asks it before the store, stores the store's denials in it,
and asks it again, stale entries included, when the store cannot answer.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable

from .._model.decision import Decision, make_decision

__all__ = ["DenyCache", "micros"]


def micros(clock: Callable[[], float]) -> Callable[[], int]:
    """A clock in integer microseconds, converted as the core converts client time."""
    return lambda: int(clock() * 1_000_000)


class DenyCache:
    """Recent exact denials per key: (until, cost, decision, at, fresh), times in integer
    microseconds so that a cached wait equals the one the store would give. LRU-bounded.

    An entry answers on its own until ``fresh`` (at most ``max_age`` after the store denied):
    after that the store is asked again, so that a reset or a changed limit made elsewhere is
    seen. Until ``until`` (the end of the true wait) it still answers when the store cannot
    (``stale``): a denial the store made stays a denial through a fault."""

    def __init__(self, size: int, clock_us: Callable[[], int], max_age: float) -> None:
        self.size = size
        self.clock_us = clock_us
        self.max_age_us = round(max_age * 1_000_000)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[int, int, Decision, int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str, cost: int, stale: bool = False) -> Decision | None:
        """The cached denial of ``cost`` on ``key``; with ``stale``, also one past its
        freshness (the store could not be asked)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        until, denied_cost, decision, at, fresh = entry
        now = self.clock_us()
        if now >= until:
            with self._lock:
                if self._entries.get(key) is entry:
                    del self._entries[key]
            return None
        if cost != denied_cost or (now >= fresh and not stale):
            # Only the same cost has the same wait: a larger one may need longer, or never fit.
            return None
        reset = max(round(decision.reset_after * 1_000_000) - (now - at), 0)
        return make_decision(  # built directly: dataclasses.replace costs more than the lookup
            False,
            decision.limit,
            decision.remaining,
            reset / 1_000_000,
            (until - now) / 1_000_000,
            decision.policy,
            decision.rate,
            reason="deny_cache",
        )

    def store(self, key: str, cost: int, decision: Decision, sent: int) -> None:
        retry = decision.retry_after
        if retry is None or math.isinf(retry) or retry <= 0:
            return
        until = sent + round(retry * 1_000_000)
        with self._lock:
            self._entries[key] = (until, cost, decision, sent, min(until, sent + self.max_age_us))
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def forget(self, keys: tuple[str, ...]) -> None:
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)

    def discard(self, key: str) -> None:
        """Drop ``key``'s entry (after an admission changed its state), if there is one."""
        if key in self._entries:
            with self._lock:
                self._entries.pop(key, None)
