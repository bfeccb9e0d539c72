"""The ``local`` failure mode: an in-process limiter at this instance's share of each limit,
which decides while the store cannot. The guard chooses the failure mode; this module is the
one of them that keeps state."""

from __future__ import annotations

import math

from .._algorithms.policy import Policy
from .._model.decision import Decision
from .._model.options import AutoShare
from .._model.rates import Rate
from .._storage.memory import MemoryStorage
from .core import Call, Core
from .fleet import Fleet

__all__ = ["LOCAL_MAX_KEYS", "LocalFallback"]

#: Keys the ``local`` failure mode keeps (least recently written evicted first): under a flood
#: of rotated identities during an outage, the process grows by about 12 MB at most
#: (the failure-mode tests measure 500,000 identities).
LOCAL_MAX_KEYS = 10_000
#: Scaled policies kept (one per policy and share; a fleet count that changes adds one).
_MAX_LOCAL_POLICIES = 1024


class LocalFallback:
    """The in-process limiter of one limiter's ``local`` failure mode."""

    def __init__(self, core: Core, share: float | AutoShare, fleet: Fleet | None) -> None:
        self.core = core
        self.share = share
        self.fleet = fleet
        self.storage = MemoryStorage(max_keys=LOCAL_MAX_KEYS)
        self._policies: dict[tuple[Policy, float], Policy | None] = {}

    def answer(self, call: Call) -> Decision | None:
        """``call`` decided at this instance's share of each limit; None when that share is
        nothing (an auto share with no fleet count yet, or a limit smaller than the fleet)."""
        policy = call.policy
        if self.fleet is None:
            assert isinstance(self.share, float)
            share: float = self.share
        else:
            count = self.fleet.count
            if count is None:
                return None
            share = count
        try:
            local = self._policies[policy, share]
        except KeyError:
            local = self._policies[policy, share] = self._scaled(policy, share)
        if local is None:
            return None
        rebound = self.core.rebind(call, local)
        return self.core.decision_of(
            rebound, self.storage.run(rebound.script, rebound.keys, rebound.args)
        )

    def forget(self, keys: tuple[str, ...]) -> None:
        """After a reset: the local state of these keys is gone too."""
        self.storage.delete(keys)

    def _scaled(self, policy: Policy, share: float) -> Policy | None:
        """``policy`` with each limit (and burst) scaled: a float share of it, at least 1; or,
        for an auto share (``share`` an int, the fleet count), ``limit // count``, so that the
        fleet never grants more than the limit in all (None if a limit rounds to 0)."""
        if isinstance(share, int):
            count = share
            limits = [r.limit // count for r in policy.rates]
            burst = None if policy.burst is None else policy.burst // count
            if min(limits) == 0 or burst == 0:
                return None
        else:
            limits = [max(1, math.floor(r.limit * share)) for r in policy.rates]
            burst = None if policy.burst is None else max(1, math.floor(policy.burst * share))
        if len(self._policies) >= _MAX_LOCAL_POLICIES:
            self._policies.clear()
        return Policy(
            policy.name,
            [Rate(limit, r.period) for limit, r in zip(limits, policy.rates, strict=True)],
            policy.algorithm,
            burst=burst,
            max_log_entries=policy.max_log_entries,
        )
