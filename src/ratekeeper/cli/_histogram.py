"""A latency histogram in fixed memory, for ``ratekeeper bench``: values kept within 1/1024
(< 0.1%), merged across workers, percentiles read back exactly as kept. Pure."""

from __future__ import annotations

import math
from fractions import Fraction

__all__ = ["LatencyHistogram"]


_SUB_BITS = 10  # 1024 buckets per power of two: values are kept within 1/1024 (< 0.1%)


def _bucket(ns: int) -> int:
    """The bucket of a latency: the value itself below 2048 ns, then log-linear."""
    shift = ns.bit_length() - _SUB_BITS - 1
    if shift <= 0:
        return ns
    return (shift << _SUB_BITS) + (ns >> shift)


def _highest(bucket: int) -> int:
    """The largest value that falls in ``bucket``."""
    shift = max((bucket >> _SUB_BITS) - 1, 0)
    mantissa = bucket - (shift << _SUB_BITS)
    return ((mantissa + 1) << shift) - 1


class LatencyHistogram:
    """Latencies in nanoseconds, in fixed log-linear buckets: memory stays small however long
    the run. Values below 2048 ns are exact; above, a percentile is reported as the highest
    value of its bucket, at most 1/1024 (0.1%) above the exact nearest-rank value and never
    below it. ``min`` and ``max`` are exact.

    >>> histogram = LatencyHistogram()
    >>> for ns in (1_000, 2_000, 3_000, 40_000):
    ...     histogram.record(ns)
    >>> histogram.percentile(Fraction(1, 2)), histogram.max
    (2000, 40000)
    """

    __slots__ = ("count", "counts", "max", "min", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.count = 0
        self.total = 0
        self.min = 0
        self.max = 0

    def record(self, ns: int) -> None:
        index = _bucket(ns)
        counts = self.counts
        counts[index] = counts.get(index, 0) + 1
        if self.count == 0 or ns < self.min:
            self.min = ns
        self.max = max(self.max, ns)
        self.count += 1
        self.total += ns

    def merge(self, other: LatencyHistogram) -> None:
        if other.count == 0:
            return
        for index, n in other.counts.items():
            self.counts[index] = self.counts.get(index, 0) + n
        self.min = other.min if self.count == 0 else min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.count += other.count
        self.total += other.total

    def percentile(self, fraction: Fraction) -> int:
        """The nearest-rank percentile: the value at rank ``ceil(fraction * count)``."""
        if self.count == 0:
            raise ValueError("no latencies recorded")
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        rank = max(math.ceil(fraction * self.count), 1)
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                return min(max(_highest(index), self.min), self.max)
        return self.max  # pragma: no cover - the counts add up to count

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan
