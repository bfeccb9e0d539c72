"""The script call ``Limiter.hit`` would send, built with ratekeeper's own core (no I/O)."""

from __future__ import annotations

from ratekeeper._core import Call, Core
from ratekeeper._keys import Identity
from ratekeeper._policy import Policy

__all__ = ["hit_call"]


def hit_call(core: Core, policy: Policy, identity: Identity, cost: int = 1) -> Call:
    """``Core.hit`` where it exists, else the older ``Core.call(..., peek=False)``."""
    hit = getattr(core, "hit", None)
    if hit is not None:
        return hit(policy, identity, cost)  # type: ignore[no-any-return]
    return core.call(policy, identity, cost, peek=False)  # type: ignore[attr-defined,no-any-return]
