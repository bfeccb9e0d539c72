"""ratekeeper: exact, atomic, distributed rate limiting on Redis, Valkey or in memory."""

from __future__ import annotations

from ._breaker import BreakerState, CircuitBreaker
from ._clock import Clock, ManualClock
from ._decision import Decision
from ._errors import (
    ConfigError,
    RatekeeperError,
    RateLimited,
    RequestRejected,
    ReservationError,
    StorageError,
    StorageFull,
    StorageResponseError,
    StorageTimeout,
    StorageUnavailable,
)
from ._fleet import AutoShare
from ._lease import AsyncLease, Lease
from ._limiter import AsyncLimiter, Limiter
from ._policy import Policy
from ._rates import Rate, parse_rates
from ._reservation import AsyncReservation, Reservation
from ._version import __version__
from .typing import Algorithm, FailureMode

__all__ = [
    "Algorithm",
    "AsyncLease",
    "AsyncLimiter",
    "AsyncReservation",
    "AutoShare",
    "BreakerState",
    "CircuitBreaker",
    "Clock",
    "ConfigError",
    "Decision",
    "FailureMode",
    "Lease",
    "Limiter",
    "ManualClock",
    "Policy",
    "Rate",
    "RateLimited",
    "RatekeeperError",
    "RequestRejected",
    "Reservation",
    "ReservationError",
    "StorageError",
    "StorageFull",
    "StorageResponseError",
    "StorageTimeout",
    "StorageUnavailable",
    "__version__",
    "parse_rates",
]
