"""``Policy``: a named set of rates enforced with one algorithm."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import get_args

from .._model.errors import ConfigError
from .._model.options import Algorithm, FailureMode
from .._model.rates import MAX_INT, Rate, parse_rates
from . import get_algorithm

__all__ = ["DEFAULT_MAX_LOG_ENTRIES", "FAILURE_MODES", "Policy"]

#: The failure modes, in the order of ``ratekeeper.typing.FailureMode`` (see there).
FAILURE_MODES: tuple[FailureMode, ...] = get_args(FailureMode)

#: Default cap on the entries one sliding-log identity may keep (its largest limit).
DEFAULT_MAX_LOG_ENTRIES = 10_000

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}", re.ASCII)


@dataclass(frozen=True, slots=True, init=False)
class Policy:
    """A named limit: one or more rates, checked all-or-nothing with one algorithm.

    >>> api = Policy("api", "10/second;1000/hour")
    >>> api.rates
    (Rate(limit=10, period=1.0), Rate(limit=1000, period=3600.0))

    The name is part of every key and header, so it is restricted to 1-128 characters of
    ``A-Z a-z 0-9 _ . : / -`` starting with a letter or digit.

    Algorithms: ``sliding_log`` (exact, one entry per unit; limits above ``max_log_entries`` are
    refused), ``sliding_window`` (approximate, O(1)), ``fixed_window`` (exact per aligned window,
    O(1)), ``gcra`` or its alias ``token_bucket`` (exact rate with ``burst``, O(1)) and
    ``concurrency`` (leases: one rate whose limit is the units held at once and whose period is
    the lease timeout; use ``Limiter.acquire``).

    ``failure_mode`` overrides the limiter's for this policy: ``"open"`` (allow), ``"closed"``
    (deny), ``"local"`` (an in-process limiter at the limiter's ``local_share`` of each limit) or
    ``"raise"`` (the StorageError reaches the caller).
    """

    name: str
    rates: tuple[Rate, ...]
    algorithm: Algorithm
    max_log_entries: int
    burst: int | None
    failure_mode: FailureMode | None

    def __init__(
        self,
        name: str,
        rates: str | Rate | Iterable[Rate],
        algorithm: Algorithm = "sliding_log",
        *,
        burst: int | None = None,
        failure_mode: FailureMode | None = None,
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
        algo = get_algorithm(algorithm)
        if burst is not None:
            if isinstance(burst, bool) or not isinstance(burst, int):
                raise ConfigError(f"burst must be an int, got {burst!r}")
            if not 1 <= burst <= MAX_INT:
                raise ConfigError(f"burst must be between 1 and 2**53, got {burst}")
            if algorithm not in ("gcra", "token_bucket"):
                raise ConfigError(
                    f"burst applies to the gcra and token_bucket algorithms, not {algorithm!r}"
                )
        if failure_mode is not None and failure_mode not in FAILURE_MODES:
            raise ConfigError(
                f"failure_mode {failure_mode!r} is unknown: choose one of "
                f"{', '.join(FAILURE_MODES)} (or None for the limiter's default)"
            )
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "rates", parse_rates(rates))
        object.__setattr__(self, "algorithm", algorithm)
        object.__setattr__(self, "max_log_entries", max_log_entries)
        object.__setattr__(self, "burst", burst)
        object.__setattr__(self, "failure_mode", failure_mode)
        algo.validate(self)

    @property
    def max_limit(self) -> int:
        """The largest limit among the rates."""
        return max(rate.limit for rate in self.rates)

    @property
    def max_period_ms(self) -> int:
        """The longest period, in milliseconds."""
        return self.rates[-1].period_ms
