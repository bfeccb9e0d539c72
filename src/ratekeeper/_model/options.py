"""The option types a limiter and a policy take, and the ``local_share`` values: checked values,
no behaviour. ``ratekeeper.typing`` is their public face."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, TypeAlias

from .errors import ConfigError

__all__ = [
    "DEFAULT_HEARTBEAT",
    "TTL_BEATS",
    "Algorithm",
    "AutoShare",
    "FailureMode",
    "LocalShare",
    "check_local_share",
]

#: Seconds between heartbeats by default; an id expires after ``TTL_BEATS`` missed ones.
DEFAULT_HEARTBEAT = 1.0
TTL_BEATS = 3


@dataclass(frozen=True, slots=True)
class AutoShare:
    """``local_share=AutoShare(heartbeat=..., ttl=...)``: the auto share with its timing.

    ``local_share="auto"`` is ``AutoShare()``: a heartbeat at most every second, and an
    instance counted until 3 s after its last one.
    """

    heartbeat: float = DEFAULT_HEARTBEAT
    ttl: float | None = None  # default: TTL_BEATS heartbeats

    def __post_init__(self) -> None:
        for name in ("heartbeat", "ttl"):
            value = getattr(self, name)
            if value is None and name == "ttl":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not 0.001 <= value <= 86_400
            ):
                raise ConfigError(
                    f"AutoShare {name} must be seconds between 0.001 and 86400, got {value!r}"
                )
        if self.ttl is not None and self.ttl < self.heartbeat:
            raise ConfigError(
                f"AutoShare ttl ({self.ttl!r} s) must be at least one heartbeat "
                f"({self.heartbeat!r} s): instances would expire between their heartbeats"
            )

    @property
    def ttl_seconds(self) -> float:
        return self.ttl if self.ttl is not None else TTL_BEATS * self.heartbeat


def check_local_share(value: object) -> float | AutoShare:
    """``local_share`` checked: a float in (0, 1], or ``"auto"`` / an AutoShare."""
    if value == "auto":
        return AutoShare()
    if isinstance(value, AutoShare):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(
            f"local_share must be 'auto' or a share in (0, 1] (1 / number of instances), "
            f"got {value!r}"
        )
    return float(value)


#: What a limiter does when the store cannot decide: allow (``open``), deny (``closed``),
#: decide with an in-process limiter at a share of each limit (``local``), or raise the
#: StorageError to the caller (``raise``).
FailureMode: TypeAlias = Literal["open", "closed", "local", "raise"]

#: The algorithms a Policy can use (``token_bucket`` is an alias of ``gcra``).
Algorithm: TypeAlias = Literal[
    "sliding_log", "sliding_window", "fixed_window", "gcra", "token_bucket", "concurrency"
]

#: The share of each limit one process may grant in the ``local`` failure mode: a number in
#: (0, 1], or ``"auto"`` (an ``AutoShare`` for its timing) for a share that follows the number
#: of live instances.
LocalShare: TypeAlias = float | Literal["auto"] | AutoShare
