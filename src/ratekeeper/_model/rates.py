"""Rates: ``Rate`` values and the strict parser for strings such as ``"10/second;1000/hour"``."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["MAX_INT", "MAX_SPAN_US", "Rate", "parse_rates"]

#: Largest integer a Lua number (an IEEE double) holds exactly.
MAX_INT = 2**53

#: Longest period and refill horizon, in microseconds (about 71 years): times in the scripts are
#: epoch microseconds plus at most twice this, and must stay below 2**53.
MAX_SPAN_US = 2**51

#: Each unit: its name, its length in milliseconds and every spelling the parser takes (matched
#: case-insensitively), longest first. A month is 30 days and a year 365 days, as in
#: envoyproxy/ratelimit. ``m`` is a minute; months are ``mo``.
_UNIT_TABLE: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("year", 365 * 86_400_000, ("y", "yr", "yrs", "year", "years")),
    ("month", 30 * 86_400_000, ("mo", "mos", "month", "months")),
    ("week", 7 * 86_400_000, ("w", "wk", "wks", "week", "weeks")),
    ("day", 86_400_000, ("d", "day", "days")),
    ("hour", 3_600_000, ("h", "hr", "hrs", "hour", "hours")),
    ("minute", 60_000, ("m", "min", "mins", "minute", "minutes")),
    ("second", 1_000, ("s", "sec", "secs", "second", "seconds")),
)
_UNITS = {spelling: ms for _, ms, spellings in _UNIT_TABLE for spelling in spellings}
_NAMES = [name for name, _, _ in reversed(_UNIT_TABLE)]
_UNIT_NAMES = f"{', '.join(_NAMES[:-1])} or {_NAMES[-1]}"

# "10/second", "10 / 5 seconds", "100 per 15 minutes". ASCII digits only, no signs, no decimals.
_RATE = re.compile(
    r"(?P<limit>[0-9]+)\s*(?:/|\s+per\s+)\s*(?:(?P<mult>[0-9]+)\s*)?(?P<unit>[A-Za-z]+)",
    re.ASCII | re.IGNORECASE,
)
_SEPARATORS = re.compile(r"[;,|]")


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``limit`` units of cost per ``period`` seconds.

    ``period`` must be a whole number of milliseconds (the resolution of key TTLs).
    """

    limit: int
    period: float

    def __post_init__(self) -> None:
        limit, period = self.limit, self.period
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise ConfigError(f"rate limit must be an int, got {limit!r}")
        if not 1 <= limit <= MAX_INT:
            raise ConfigError(f"rate limit must be between 1 and 2**53, got {limit}")
        if isinstance(period, bool) or not isinstance(period, (int, float)):
            raise ConfigError(f"rate period must be a number of seconds, got {period!r}")
        if not math.isfinite(period) or period <= 0:
            raise ConfigError(f"rate period must be a positive number of seconds, got {period!r}")
        ms = period * 1000
        if abs(ms - round(ms)) > 1e-6 or round(ms) < 1:
            raise ConfigError(
                f"rate period must be a whole number of milliseconds, got {period!r} s"
            )
        if round(ms) * 1000 > MAX_SPAN_US:
            raise ConfigError(f"rate period is too long (over 71 years): {period!r} s")

    @property
    def period_ms(self) -> int:
        """The period in whole milliseconds."""
        return round(self.period * 1000)

    @property
    def period_us(self) -> int:
        """The period in whole microseconds."""
        return self.period_ms * 1000

    def __str__(self) -> str:
        ms = self.period_ms
        for unit, size, _ in _UNIT_TABLE:
            if ms % size == 0:
                n = ms // size
                return f"{self.limit}/{unit}" if n == 1 else f"{self.limit} per {n} {unit}s"
        return f"{self.limit} per {self.period:g} seconds"


def _parse_one(text: str) -> Rate:
    match = _RATE.fullmatch(text.strip())
    if match is None:
        raise ConfigError(
            f"cannot parse rate {text!r}: expected '<limit>/<unit>' or "
            "'<limit> per <n> <unit>' with a whole-number limit, e.g. '10/second' "
            "or '100 per 15 minutes'"
        )
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise ConfigError(
            f"unknown time unit {match['unit']!r} in rate {text!r}: use {_UNIT_NAMES}"
        )
    limit = int(match["limit"])
    mult = int(match["mult"]) if match["mult"] is not None else 1
    if limit < 1:
        raise ConfigError(f"rate {text!r}: the limit must be at least 1")
    if limit > MAX_INT:
        raise ConfigError(f"rate {text!r}: the limit must be at most 2**53")
    if mult < 1:
        raise ConfigError(f"rate {text!r}: the period multiplier must be at least 1")
    if mult * _UNITS[unit] * 1000 > MAX_SPAN_US:
        raise ConfigError(f"rate {text!r}: the period is too long (over 71 years)")
    return Rate(limit, mult * _UNITS[unit] / 1000)


def parse_rates(rates: str | Rate | Iterable[Rate]) -> tuple[Rate, ...]:
    """Parse and validate one or more rates.

    Accepts a string (``"10/second;1000/week"``, items separated by ``;``, ``,`` or ``|``), a single
    :class:`Rate`, or an iterable of :class:`Rate`. The result is sorted by period. Two rates
    with the same period are refused: one of them would be dead configuration.
    """
    parsed: list[Rate]
    if isinstance(rates, str):
        if not rates.strip():
            raise ConfigError("rates must not be empty")
        parts = _SEPARATORS.split(rates)
        for part in parts:
            if not part.strip():
                raise ConfigError(f"empty item in rates {rates!r}")
        parsed = [_parse_one(part) for part in parts]
    elif isinstance(rates, Rate):
        parsed = [rates]
    else:
        try:
            parsed = list(rates)
        except TypeError:
            raise ConfigError(
                f"rates must be a string or a sequence of Rate, got {type(rates).__name__}"
            ) from None
        if not parsed:
            raise ConfigError("rates must not be empty")
        for item in parsed:
            if not isinstance(item, Rate):
                raise ConfigError(f"rates must contain Rate values, got {item!r}")
    seen: dict[int, Rate] = {}
    for rate in parsed:
        if rate.period_ms in seen:
            raise ConfigError(
                f"two rates share the period {rate.period:g} s: {seen[rate.period_ms]} and {rate}"
            )
        seen[rate.period_ms] = rate
    return tuple(sorted(parsed, key=lambda r: r.period_ms))
