"""The peer library, ``limits``: its strategies, and the one each ratekeeper algorithm is set
beside. One table for every script that measures ``limits`` (``compare.py``,
``script_cost.py``, ``algorithms.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import limits.aio.strategies
import limits.strategies

__all__ = ["FIXED_WINDOW", "MOVING_WINDOW", "PEERS", "SLIDING_WINDOW_COUNTER", "STRATEGIES"]


@dataclass(frozen=True)
class Strategy:
    """One ``limits`` strategy, named as the reports name it."""

    name: str  # "MovingWindow": the tables of script_cost.py and algorithms.py
    case: str  # "moving_window": compare.py's case names (limits/sync/moving_window)
    class_name: str  # the same in limits.strategies and limits.aio.strategies
    log: bool  # one entry per hit (a sliding log), not a counter

    @property
    def label(self) -> str:
        return f"limits {self.name}"

    def sync(self, storage: Any) -> Any:
        """The strategy over ``limits.storage`` ``storage``."""
        return getattr(limits.strategies, self.class_name)(storage)

    def aio(self, storage: Any) -> Any:
        """The strategy over ``limits.aio.storage`` ``storage``."""
        return getattr(limits.aio.strategies, self.class_name)(storage)


MOVING_WINDOW = Strategy("MovingWindow", "moving_window", "MovingWindowRateLimiter", log=True)
FIXED_WINDOW = Strategy("FixedWindow", "fixed_window", "FixedWindowRateLimiter", log=False)
SLIDING_WINDOW_COUNTER = Strategy(
    "SlidingWindowCounter", "sliding_window_counter", "SlidingWindowCounterRateLimiter", log=False
)
#: Every strategy measured, in the order the reports list them.
STRATEGIES = (MOVING_WINDOW, FIXED_WINDOW, SLIDING_WINDOW_COUNTER)
#: ratekeeper algorithm -> its nearest ``limits`` strategy. gcra has none: FixedWindow, the
#: cheapest ``limits`` hit, is its reference point; concurrency has none at all.
PEERS = {
    "sliding_log": MOVING_WINDOW,
    "sliding_window": SLIDING_WINDOW_COUNTER,
    "fixed_window": FIXED_WINDOW,
    "gcra": FIXED_WINDOW,
}
