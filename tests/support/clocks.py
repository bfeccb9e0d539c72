"""A clock for tests that compute instants to the microsecond.

:class:`ExactClock` is a ``ratekeeper.testing.ManualClock`` moved in whole microseconds, whose
float the core reads back as exactly those microseconds (``int(seconds * 1_000_000)``): a float
sum such as ``t + 0.1`` can otherwise read as one microsecond less.
"""

from __future__ import annotations

import math

from ratekeeper.testing import ManualClock

#: An hour boundary (so also a minute, ten-second and second boundary), in microseconds.
ALIGNED_US = 1_699_999_200_000_000
assert ALIGNED_US % 3_600_000_000 == 0


class ExactClock(ManualClock):
    """A ManualClock at ``us`` microseconds since the epoch, moved in whole microseconds."""

    def __init__(self, start_us: int = ALIGNED_US) -> None:
        super().__init__()
        self.set_us(start_us)

    def set_us(self, us: int) -> None:
        """Jump to ``us`` microseconds since the epoch (backwards too)."""
        self.us = us
        seconds = us / 1_000_000
        while int(seconds * 1_000_000) < us:
            seconds = math.nextafter(seconds, math.inf)
        while int(seconds * 1_000_000) > us:
            seconds = math.nextafter(seconds, -math.inf)
        self.set(seconds)
        assert int(self() * 1_000_000) == us

    def advance(self, seconds: float) -> None:
        self.advance_us(round(seconds * 1_000_000))

    def advance_us(self, us: int) -> None:
        assert us >= 0
        self.set_us(self.us + us)

    def rewind(self, seconds: float) -> None:
        """Move back: the clock of a client behind the previous caller's."""
        self.set_us(self.us - round(seconds * 1_000_000))
