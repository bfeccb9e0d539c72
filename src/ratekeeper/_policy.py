"""``Policy``: a named set of rates enforced with one algorithm."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ._errors import ConfigError
from ._rates import Rate, parse_rates

__all__ = ["DEFAULT_MAX_LOG_ENTRIES", "Policy"]

#: Default cap on the entries one sliding-log identity may keep (its largest limit).
DEFAULT_MAX_LOG_ENTRIES = 10_000

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}", re.ASCII)


@dataclass(frozen=True, slots=True, init=False)
class Policy:
    """A named limit: one or more rates, checked all-or-nothing with one algorithm.

    >>> Policy("api", "10/second;1000/hour")
    Policy(name='api', rates=(Rate(limit=10, period=1.0), Rate(limit=1000, period=3600.0)), ...)

    The name is part of every key and header, so it is restricted to 1-128 characters of
    ``A-Z a-z 0-9 _ . : / -`` starting with a letter or digit.
    """

    name: str
    rates: tuple[Rate, ...]
    algorithm: str
    max_log_entries: int

    def __init__(
        self,
        name: str,
        rates: str | Rate | Iterable[Rate],
        algorithm: str = "sliding_log",
        *,
        max_log_entries: int = DEFAULT_MAX_LOG_ENTRIES,
    ) -> None:
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            raise ConfigError(
                f"policy name {name!r} is invalid: use 1-128 characters of "
                "A-Z a-z 0-9 _ . : / - starting with a letter or digit"
            )
        if isinstance(max_log_entries, bool) or not isinstance(max_log_entries, int):
            raise ConfigError(f"max_log_entries must be an int, got {max_log_entries!r}")
        if max_log_entries < 1:
            raise ConfigError(f"max_log_entries must be at least 1, got {max_log_entries}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "rates", parse_rates(rates))
        object.__setattr__(self, "algorithm", algorithm)
        object.__setattr__(self, "max_log_entries", max_log_entries)
        # Imported here: the algorithm registry imports Policy for its type hints.
        from ._algorithms import get_algorithm

        get_algorithm(algorithm).validate(self)

    @property
    def max_limit(self) -> int:
        """The largest limit among the rates."""
        return max(rate.limit for rate in self.rates)

    @property
    def max_period_ms(self) -> int:
        """The longest period, in milliseconds."""
        return self.rates[-1].period_ms
