"""ratekeeper: exact, atomic, distributed rate limiting on Redis, Valkey or in memory."""

from __future__ import annotations

from ._algorithms.policy import Policy
from ._engine.breaker import BreakerState, CircuitBreaker
from ._limiters.lease import AsyncLease, Lease
from ._limiters.limiter import AsyncLimiter, Limiter
from ._limiters.reservation import AsyncReservation, Reservation
from ._model.clock import Clock, ManualClock
from ._model.decision import Decision
from ._model.errors import (
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
from ._model.options import Algorithm, AutoShare, FailureMode
from ._model.rates import Rate, parse_rates
from ._version import __version__

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
