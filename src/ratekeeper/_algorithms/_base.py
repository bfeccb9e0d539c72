"""What every algorithm shares: the call format, decoded arguments, the Algorithm record.

Each algorithm exists twice: as a Lua script (``lua/<name>.lua`` beside it) that Redis runs
atomically, and as a pure-Python reference that the memory backend runs and the property tests
compare against the script. Both take the same KEYS and ARGV and return the same reply.

ARGV, shared by every algorithm::

    1  now        microseconds since the epoch; 0 = use the store's clock (Redis TIME)
    2  cost       units to consume, >= 1 (>= 0 for a charge or a refund)
    3  mode       0 = hit (consume if every rate admits), 1 = peek (read only),
                  2 = release (concurrency leases only; read only elsewhere),
                  3 = reserve (a hit whose reply ends with the reservation's stamp),
                  4 = charge (add ``cost`` now, whatever the limit: the rest of a settled
                  reservation), 5 = refund (give back ``cost`` of the reservation stamped
                  ARGV 4, where it still counts); 4 and 5 then reply as a peek of cost 1
    4  token      unique per call (per-process nonce + counter): makes lease members unique;
                  for a refund, the stamp of the reservation refunded
    5  margin     milliseconds every written key outlives the state it holds (clock skew)
    6  n          number of rates, then n pairs: limit, window in microseconds
    7+2n ...      then the algorithm's own arguments (gcra: a burst per rate)

Reply: ``{allowed, remaining_1, reset_1, retry_1, ..., remaining_n, reset_n, retry_n}`` with
times in microseconds; ``retry_i`` is -1 when rate i admits and -2 when it never can. A reserve
appends the stamp its units were counted at (microseconds: ``now``, or for the log the time
its entries took), which its refund sends back as ARGV 4.

Reservations (modes 3 to 5) are a hit now and a correction later, each one atomic call: a
settle charges the difference between the actual cost and the estimate (mode 4) or refunds it
(mode 5). A refund takes back only what still counts: units of a window that has ended, or of
log entries that have left it, are gone already. A charge is counted past the limit, so later
calls wait for it; a counter keeps it up to the largest count its arithmetic holds exactly
(never less than the limit again), and the log adds at most the largest limit of entries (more
would change no reply: that many entries at one time fill every window until they leave).

A script and its reference differ only where the difference changes no reply and no stored
state (``tests/algorithms/test_property.py`` checks both), for the script's speed: each
difference is written in the script's header and in the reference's module docstring. One
difference is the backend's, not an algorithm's: the memory keyspace expires keys on the ``now``
of the calls (the client's clock when one is given), while a server expires them on its own
clock; the margin (ARGV 5) keeps every key that much longer than its state, to cover the two
clocks' difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from .._model.errors import ConfigError
from .._model.rates import Rate
from .keyspace import Keyspace

__all__ = [
    "CHARGE",
    "CONSUMES",
    "HIT",
    "MAX_COUNTER_LIMIT",
    "PEEK",
    "REFUND",
    "RELEASE",
    "RESERVE",
    "RETRY_NEVER",
    "RETRY_NONE",
    "SETTLES",
    "Algorithm",
    "Args",
    "Limits",
    "Reply",
    "decode_args",
    "encode_args",
]

HIT, PEEK, RELEASE, RESERVE, CHARGE, REFUND = 0, 1, 2, 3, 4, 5
#: The modes that consume when every rate admits.
CONSUMES = (HIT, RESERVE)
#: The modes that settle a reservation: they write without asking the limit, then reply as a
#: peek of cost 1.
SETTLES = (CHARGE, REFUND)

#: The largest limit the O(1) counter scripts take. Lua numbers are doubles, exact only to
#: 2**53; with limits up to 2**52 every sum of a count and a cost that can still be admitted
#: stays below 2**53.
MAX_COUNTER_LIMIT = 2**52
RETRY_NONE = -1
RETRY_NEVER = -2

Reply = list[int]


@dataclass(frozen=True, slots=True)
class Args:
    """ARGV decoded, with ``now`` resolved to a time."""

    now: int
    cost: int
    mode: int
    token: str
    margin_ms: int
    rates: tuple[tuple[int, int], ...]
    extra: tuple[int, ...]

    @property
    def consumes(self) -> bool:
        """Whether this call may consume (a hit or a reserve); peeks and releases of counters
        never do."""
        return self.mode in CONSUMES

    def settled(self) -> Args:
        """The peek of cost 1 a charge or a refund replies as, once it has written."""
        return replace(self, cost=1, mode=PEEK)


def encode_args(
    now: int,
    *,
    cost: int,
    mode: int,
    token: str,
    margin_ms: int,
    rates: Sequence[tuple[int, int]],
    extra: Sequence[int] = (),
) -> tuple[int | str, ...]:
    """ARGV for a script call (see the module docstring)."""
    flat: list[int | str] = [now, cost, mode, token, margin_ms, len(rates)]
    for limit, window in rates:
        flat += (limit, window)
    flat += extra
    return tuple(flat)


def decode_args(args: Sequence[int | str], now: int) -> Args:
    """Decode ARGV as the memory backend receives it; ``now`` replaces a 0 in ARGV[1]."""
    n = int(args[5])
    rates = tuple((int(args[6 + 2 * i]), int(args[7 + 2 * i])) for i in range(n))
    given = int(args[0])
    return Args(
        now=given if given > 0 else now,
        cost=int(args[1]),
        mode=int(args[2]),
        token=str(args[3]),
        margin_ms=int(args[4]),
        rates=rates,
        extra=tuple(int(arg) for arg in args[6 + 2 * n :]),
    )


class Limits(Protocol):
    """What an algorithm reads of a policy (``Policy`` has it). ``Policy`` looks its algorithm
    up in the registry when it is made, so the algorithms name this shape, not the class."""

    @property
    def name(self) -> str: ...
    @property
    def algorithm(self) -> str: ...
    @property
    def rates(self) -> tuple[Rate, ...]: ...
    @property
    def burst(self) -> int | None: ...
    @property
    def max_log_entries(self) -> int: ...
    @property
    def max_limit(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Algorithm:
    """One algorithm: its script, its key suffixes, its reference and its policy checks."""

    name: str
    script: str
    suffixes: tuple[str, ...]
    reference: Callable[[Keyspace, tuple[str, ...], Args], Reply]
    validate: Callable[[Limits], None]
    extra_args: Callable[[Limits], tuple[int, ...]] = lambda policy: ()


def check_limits(policy: Limits, bound: int = MAX_COUNTER_LIMIT) -> None:
    """Refuse limits above ``bound`` for exact arithmetic in the scripts' doubles."""
    for rate in policy.rates:
        if rate.limit > bound:
            raise ConfigError(
                f"policy {policy.name!r}: {policy.algorithm} takes limits up to {bound} for "
                f"exact arithmetic in Lua (doubles), and {rate} exceeds it"
            )
