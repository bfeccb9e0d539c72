"""The sans-I/O core shared by ``Limiter`` and ``AsyncLimiter``.

It turns (policy, identity, cost) into a script call (script, keys, args) and a script reply into
a ``Decision``. The limiters only move these between the core and a storage, so the sync and
async APIs cannot drift apart.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass

from .._algorithms import (
    CHARGE,
    HIT,
    PEEK,
    REFUND,
    RELEASE,
    RESERVE,
    RETRY_NEVER,
    RETRY_NONE,
    encode_args,
    get_algorithm,
)
from .._algorithms.policy import Policy
from .._algorithms.scripts import Script, load_script
from .._model.clock import Clock
from .._model.decision import Decision, make_decision
from .._model.errors import ConfigError
from .._model.rates import MAX_INT
from .keys import DEFAULT_KEY_PREFIX, Identity, KeyBuilder

__all__ = ["TTL_MARGIN_MS", "Call", "Core"]

#: Extra lifetime of every key beyond its longest window, for clock skew between client and store.
TTL_MARGIN_MS = 1_000


@dataclass(slots=True)
class Call:
    """One script call, ready for a storage to run. Treat it as immutable (it is not frozen:
    a frozen dataclass costs a microsecond more to build, on every call)."""

    script: Script
    keys: tuple[str, ...]
    args: tuple[int | str, ...]
    policy: Policy
    token: str
    cost: int
    mode: int


class _Tokens:
    """Unique tokens: a random per-process nonce plus a counter; renewed in forked children."""

    def __init__(self) -> None:
        self._renew()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._nonce = os.urandom(6).hex()
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._nonce}{next(self._counter):x}"


_TOKENS = _Tokens()

#: (policy, script, key suffixes, the ARGV that follows the per-call part)
_Plan = tuple[Policy, Script, tuple[str, ...], tuple[int | str, ...]]
_MAX_PLANS = 1024


def _check_cost(cost: int) -> int:
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise ConfigError(f"cost must be an int, got {cost!r}")
    if not 1 <= cost <= MAX_INT:
        raise ConfigError(f"cost must be between 1 and 2**53, got {cost}")
    return cost


def check_actual(actual: int) -> int:
    """A settled cost: an int from 0 (nothing was used) to 2**53."""
    if isinstance(actual, bool) or not isinstance(actual, int) or not 0 <= actual <= MAX_INT:
        raise ConfigError(f"actual must be an int between 0 and 2**53, got {actual!r}")
    return actual


def _check_policy(policy: Policy) -> None:
    if not isinstance(policy, Policy):
        raise ConfigError(f"policy must be a Policy, got {type(policy).__name__}")


class Core:
    """Builds calls and reads replies. Holds no I/O and no mutable state but a token counter."""

    __slots__ = ("_plans", "clock", "keys")

    def __init__(self, *, key_prefix: str = DEFAULT_KEY_PREFIX, clock: Clock | None = None) -> None:
        if clock is not None and not callable(clock):
            raise ConfigError(f"clock must be callable and return epoch seconds, got {clock!r}")
        self.keys = KeyBuilder(key_prefix)
        self.clock = clock
        self._plans: dict[int, _Plan] = {}

    def _now(self) -> int:
        if self.clock is None:
            return 0
        now = self.clock()
        us = int(now * 1_000_000)
        if not 0 < us <= MAX_INT:
            raise ConfigError(f"clock returned {now!r}: expected positive epoch seconds")
        return us

    def _call(
        self,
        policy: Policy,
        identity: Identity,
        cost: int,
        mode: int,
        token: str,
        keys: tuple[str, ...] | None = None,
    ) -> Call:
        """The call for a ``policy`` already checked; ``keys``, if given, are its keys for
        ``identity`` (from ``keys_of``), not built twice."""
        if type(cost) is not int or not 1 <= cost <= MAX_INT:
            _check_cost(cost)
        plan = self._plans.get(id(policy))
        if plan is None or plan[0] is not policy:
            plan = self._plan(policy)
        if keys is None:
            keys = self.keys.keys(policy.name, identity, plan[2])
        now = 0 if self.clock is None else self._now()
        return Call(
            plan[1],
            keys,
            (now, cost, mode, token, TTL_MARGIN_MS, *plan[3]),
            policy,
            token,
            cost,
            mode,
        )

    def _plan(self, policy: Policy) -> _Plan:
        """What every call under ``policy`` shares: its script, key suffixes and the ARGV after
        the per-call part. Kept by the policy's id, with the policy itself to tell a recycled
        id apart (and so keep it alive); bounded."""
        algorithm = get_algorithm(policy.algorithm)
        args = encode_args(
            0,
            cost=1,
            mode=HIT,
            token="",
            margin_ms=TTL_MARGIN_MS,
            rates=[(rate.limit, rate.period_us) for rate in policy.rates],
            extra=algorithm.extra_args(policy),
        )
        plan = (policy, load_script(algorithm.script), algorithm.suffixes, args[5:])
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[id(policy)] = plan
        return plan

    def rebind(self, call: Call, policy: Policy) -> Call:
        """``call`` for another policy of the same name and algorithm (the local fallback's
        scaled copy): same keys, token, cost and mode, new rates."""
        algorithm = get_algorithm(policy.algorithm)
        args = encode_args(
            self._now(),
            cost=call.cost,
            mode=call.mode,
            token=call.token,
            margin_ms=TTL_MARGIN_MS,
            rates=[(rate.limit, rate.period_us) for rate in policy.rates],
            extra=algorithm.extra_args(policy),
        )
        return Call(call.script, call.keys, args, policy, call.token, call.cost, call.mode)

    def hit_call(
        self,
        policy: Policy,
        identity: Identity,
        cost: int,
        keys: tuple[str, ...] | None = None,
    ) -> Call:
        """The call that consumes ``cost`` for ``identity`` if every rate admits it (``keys``:
        its keys from ``keys_of``, if the caller has them already)."""
        if type(policy) is not Policy:
            _check_policy(policy)
        if policy.algorithm == "concurrency":
            raise ConfigError(
                f"policy {policy.name!r} hands out leases: use acquire(), which returns a lease "
                "to release, instead of hit()"
            )
        return self._call(policy, identity, cost, HIT, _TOKENS.next(), keys)

    def keys_of(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        """The keys of ``identity`` under ``policy`` (a checked Policy); the first is the one a
        cached denial is filed under."""
        plan = self._plans.get(id(policy))
        if plan is None or plan[0] is not policy:
            plan = self._plan(policy)
        return self.keys.keys(policy.name, identity, plan[2])

    def first_key(self, policy: Policy, identity: Identity) -> str:
        """The key a cached denial of ``identity`` under ``policy`` is filed under."""
        return self.keys_of(policy, identity)[0]

    def peek_call(self, policy: Policy, identity: Identity, cost: int) -> Call:
        """The call that tells whether ``cost`` would be admitted, consuming nothing."""
        _check_policy(policy)
        return self._call(policy, identity, cost, PEEK, "")

    def acquire_call(self, policy: Policy, identity: Identity, cost: int) -> Call:
        """The call that takes a lease of ``cost`` units under a concurrency policy."""
        _check_policy(policy)
        if policy.algorithm != "concurrency":
            raise ConfigError(
                f"acquire() takes a concurrency policy; {policy.name!r} uses "
                f"{policy.algorithm!r}: use hit()"
            )
        return self._call(policy, identity, cost, HIT, _TOKENS.next())

    def reserve_call(self, policy: Policy, identity: Identity, cost: int) -> Call:
        """The call that consumes ``cost`` as a reservation, if every rate admits it; its
        reply ends with the reservation's stamp (``stamp``)."""
        if type(policy) is not Policy:
            _check_policy(policy)
        if policy.algorithm == "concurrency":
            raise ConfigError(
                f"policy {policy.name!r} hands out leases, which are reservations already: "
                "use acquire() and release the lease; reserve() takes a rate policy"
            )
        return self._call(policy, identity, cost, RESERVE, _TOKENS.next())

    @staticmethod
    def stamp(call: Call, reply: list[int]) -> int | None:
        """The stamp of the reservation ``call`` made (None: nothing was reserved)."""
        return int(reply[-1]) if len(reply) > 1 + 3 * len(call.policy.rates) else None

    def settle_call(self, reserved: Call, stamp: int | None, actual: int) -> Call:
        """The call that settles the reservation ``reserved`` made at ``stamp`` for ``actual``:
        a refund of the difference, or a charge of the rest; for a reservation the store never
        held (``stamp`` None: a failure mode admitted it), a charge of all of ``actual``."""
        check_actual(actual)
        if stamp is None:
            return self._adjust(reserved, CHARGE, actual, "")
        delta = actual - reserved.cost
        if delta > 0:
            return self._adjust(reserved, CHARGE, delta, "")
        return self._adjust(reserved, REFUND, -delta, str(stamp))

    def charge_call(self, policy: Policy, identity: Identity, cost: int) -> Call:
        """The call that adds ``cost`` whatever the limit (work already done), then tells
        where the identity stands."""
        reserved = self.reserve_call(policy, identity, 1)  # checks the policy; builds the keys
        return self._adjust(reserved, CHARGE, _check_cost(cost), "")

    def _adjust(self, reserved: Call, mode: int, cost: int, token: str) -> Call:
        policy = reserved.policy
        plan = self._plans.get(id(policy))
        if plan is None or plan[0] is not policy:
            plan = self._plan(policy)
        args = (self._now(), cost, mode, token, TTL_MARGIN_MS, *plan[3])
        return Call(plan[1], reserved.keys, args, policy, token, cost, mode)

    def release_call(self, acquired: Call, identity: Identity) -> Call:
        """The call that gives back the lease taken by ``acquired``."""
        return self._call(
            acquired.policy, identity, acquired.cost, RELEASE, acquired.token, acquired.keys
        )

    def reset_keys(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        """The keys that ``reset`` deletes."""
        _check_policy(policy)
        return self.keys.keys(policy.name, identity, get_algorithm(policy.algorithm).suffixes)

    @staticmethod
    def decision_of(call: Call, reply: list[int]) -> Decision:
        """Read a script reply into a Decision.

        A denial is described by the denying rate with the longest wait. Otherwise (an
        admission, or a release of a lease no longer held, which denies nothing) by the rate
        with the fewest units left, then the longest wait to reset.
        """
        policy = call.policy
        allowed = int(reply[0]) == 1
        if len(policy.rates) == 1:
            best = 0
            rows = [(int(reply[1]), int(reply[2]), int(reply[3]))]
        else:
            rows = [
                (int(reply[1 + 3 * i]), int(reply[2 + 3 * i]), int(reply[3 + 3 * i]))
                for i in range(len(policy.rates))
            ]
            denying = [i for i, row in enumerate(rows) if row[2] != RETRY_NONE]
            if not allowed and denying:
                best = max(
                    denying,
                    key=lambda i: (
                        math.inf if rows[i][2] == RETRY_NEVER else rows[i][2],
                        rows[i][1],
                    ),
                )
            else:
                best = max(range(len(rows)), key=lambda i: (-rows[i][0], rows[i][1]))
        remaining, reset, retry = rows[best]
        retry_after: float | None = None
        if not allowed and retry != RETRY_NONE:
            retry_after = math.inf if retry == RETRY_NEVER else retry / 1_000_000
        rate = policy.rates[best]
        return make_decision(
            allowed, rate.limit, remaining, reset / 1_000_000, retry_after, policy.name, rate
        )
