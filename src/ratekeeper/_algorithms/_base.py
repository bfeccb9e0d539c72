"""What every algorithm shares: the call format, decoded arguments, the Algorithm record.

Each algorithm exists twice: as a Lua script (``ratekeeper/lua/<name>.lua``) that Redis runs
atomically, and as a pure-Python reference that the memory backend runs and the property tests
compare against the script. Both take the same KEYS and ARGV and return the same reply.

ARGV, shared by every algorithm::

    1  now        microseconds since the epoch; 0 = use the store's clock (Redis TIME)
    2  cost       units to consume, >= 1
    3  mode       0 = hit (consume if every rate admits), 1 = peek (read only)
    4  token      unique per call (per-process nonce + counter): makes log members unique
    5  ttl        milliseconds every written key lives: the longest window plus a margin
    6  n          number of rates, then n pairs: limit, window in microseconds

Reply: ``{allowed, remaining_1, reset_1, retry_1, ..., remaining_n, reset_n, retry_n}`` with
times in microseconds; ``retry_i`` is -1 when rate i admits and -2 when it never can.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._keyspace import Keyspace

if TYPE_CHECKING:
    from .._policy import Policy

__all__ = ["RETRY_NEVER", "RETRY_NONE", "Algorithm", "Args", "Reply", "decode_args", "encode_args"]

RETRY_NONE = -1
RETRY_NEVER = -2

Reply = list[int]


@dataclass(frozen=True, slots=True)
class Args:
    """ARGV decoded, with ``now`` resolved to a time."""

    now: int
    cost: int
    peek: bool
    token: str
    ttl_ms: int
    rates: tuple[tuple[int, int], ...]


def encode_args(
    now: int,
    *,
    cost: int,
    peek: bool,
    token: str,
    ttl_ms: int,
    rates: Sequence[tuple[int, int]],
) -> tuple[int | str, ...]:
    """ARGV for a script call (see the module docstring)."""
    flat: list[int | str] = [now, cost, 1 if peek else 0, token, ttl_ms, len(rates)]
    for limit, window in rates:
        flat += (limit, window)
    return tuple(flat)


def decode_args(args: Sequence[int | str], now: int) -> Args:
    """Decode ARGV as the memory backend receives it; ``now`` replaces a 0 in ARGV[1]."""
    n = int(args[5])
    rates = tuple((int(args[6 + 2 * i]), int(args[7 + 2 * i])) for i in range(n))
    given = int(args[0])
    return Args(
        now=given if given > 0 else now,
        cost=int(args[1]),
        peek=int(args[2]) == 1,
        token=str(args[3]),
        ttl_ms=int(args[4]),
        rates=rates,
    )


@dataclass(frozen=True, slots=True)
class Algorithm:
    """One algorithm: its script, its key suffixes, its reference and its policy checks."""

    name: str
    script: str
    suffixes: tuple[str, ...]
    reference: Callable[[Keyspace, tuple[str, ...], Args], Reply]
    validate: Callable[[Policy], None]
