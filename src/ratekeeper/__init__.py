"""ratekeeper: exact, atomic, distributed rate limiting on Redis, Valkey or in memory."""

from __future__ import annotations

from ._clock import Clock, ManualClock
from ._decision import Decision
from ._errors import (
    ConfigError,
    RatekeeperError,
    StorageError,
    StorageResponseError,
    StorageTimeout,
    StorageUnavailable,
)
from ._limiter import AsyncLimiter, Limiter
from ._policy import Policy
from ._rates import Rate, parse_rates

__all__ = [
    "AsyncLimiter",
    "Clock",
    "ConfigError",
    "Decision",
    "Limiter",
    "ManualClock",
    "Policy",
    "Rate",
    "RatekeeperError",
    "StorageError",
    "StorageResponseError",
    "StorageTimeout",
    "StorageUnavailable",
    "__version__",
    "parse_rates",
]

__version__ = "0.1.0"
