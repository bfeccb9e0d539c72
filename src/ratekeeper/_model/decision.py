"""``Decision``: the immutable result of one check."""

from __future__ import annotations

from dataclasses import dataclass

from .rates import Rate

__all__ = ["Decision"]


@dataclass(frozen=True, slots=True)
class Decision:
    """What the limiter decided for one ``hit`` or ``peek``.

    ``limit``, ``remaining`` and ``reset_after`` come from the rate that constrains most: on a
    denial the denying rate with the longest wait, otherwise the rate with the fewest units left.

    Attributes:
        allowed: the request may proceed (for ``peek``: a hit of that cost would pass now).
        limit: the constraining rate's limit.
        remaining: units of cost still available in that rate's window after this call.
        reset_after: seconds until that rate's window is completely free again.
        retry_after: exact seconds until a request of the same cost could pass; ``None`` when
            allowed, ``math.inf`` when the cost exceeds a limit and can never pass.
        policy: the policy's name.
        rate: the constraining rate.
        degraded: the store could not decide and the failure mode did (see ``reason``).
        reason: why the store was not asked: ``None`` when it decided; ``"deny_cache"`` when a
            recent exact denial answered locally (not degraded); for degraded decisions the
            failure, ``"breaker_open"``, ``"timeout"``, ``"unavailable"`` or ``"store_error"``,
            and the mode that decided: ``"open"``, ``"closed"`` or ``"local"``, as
            ``"timeout/open"``.
    """

    allowed: bool
    limit: int
    remaining: int
    reset_after: float
    retry_after: float | None
    policy: str
    rate: Rate
    degraded: bool = False
    reason: str | None = None


_new = object.__new__
(
    _allowed,
    _limit,
    _remaining,
    _reset_after,
    _retry_after,
    _policy,
    _rate,
    _degraded,
    _reason,
) = (getattr(Decision, name).__set__ for name in Decision.__slots__)


def make_decision(
    allowed: bool,
    limit: int,
    remaining: int,
    reset_after: float,
    retry_after: float | None,
    policy: str,
    rate: Rate,
    degraded: bool = False,
    reason: str | None = None,
) -> Decision:
    """``Decision(...)`` for the hot paths, at half the cost: the frozen dataclass's
    ``__init__`` goes through ``object.__setattr__`` once per field; this sets the slots
    directly. Equal to ``Decision`` built the usual way (tests check it)."""
    d: Decision = _new(Decision)
    _allowed(d, allowed)
    _limit(d, limit)
    _remaining(d, remaining)
    _reset_after(d, reset_after)
    _retry_after(d, retry_after)
    _policy(d, policy)
    _rate(d, rate)
    _degraded(d, degraded)
    _reason(d, reason)
    return d
