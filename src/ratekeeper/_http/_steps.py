"""What :class:`~._limiting.Limiting` hands its drivers (``_drivers``): the steps it yields
(a store call, a reservation to settle, an awaitable) and what it decides for a request (an
:class:`Admission`, with the :class:`Charge` of each policy)."""

from __future__ import annotations

from collections.abc import Awaitable, Generator
from dataclasses import dataclass
from typing import Any

from .._algorithms.policy import Policy
from .._model.decision import Decision
from ._base import DeductWhen, ReportedCost

__all__ = ["Admission", "Charge", "Settle", "Step", "Steps", "StoreCall"]


@dataclass(frozen=True, slots=True)
class StoreCall:
    """A store call the driver makes: ``limiter.peek`` if ``peek``, ``limiter.reserve`` if
    ``reserve`` (answered with the reservation), else ``limiter.hit``; for ``cached``, the
    limiter's local deny cache only (no store call): a cached denial of that hit, or None."""

    policy: Policy
    identity: str
    cost: int
    peek: bool = False
    cached: bool = False
    reserve: bool = False


@dataclass(frozen=True, slots=True)
class Settle:
    """A reservation the driver settles for ``actual`` (``reservation.settle(actual)``), or
    cancels when ``actual`` is None (``reservation.cancel()``), awaited on asyncio; answered
    with the decision after it, or None."""

    reservation: Any
    actual: int | None = None


@dataclass(frozen=True, slots=True)
class Charge:
    """One policy to charge for a request: ``cost`` of ``policy`` for ``identity``.
    ``deduct_when`` set: charged after the response, when it says so. ``reported``: the
    rule's ``reported_cost``: the cost is an estimate, settled to the cost the handler
    reports once the response ends."""

    policy: Policy
    identity: str
    cost: int
    shadow: bool
    deduct_when: DeductWhen | None = None
    reported: ReportedCost = False
    #: The rule's path (its glob, or its regular expression's pattern), for messages.
    route: str = ""

    @property
    def deferred(self) -> bool:
        """Whether it is reserved before the handler and settled after."""
        return self.deduct_when is not None or self.reported is not False


@dataclass(slots=True)
class Admission:
    """What :meth:`Limiting.admit` decided for a request that a policy applies to.

    ``response`` set: answer it at once (a denial, or the 400 of ``missing_identity=
    "reject"``), with no call to the app. Otherwise pass it on: ``headers`` are those to add
    to the app's response when nothing is ``deferred``; ``decisions`` are the decisions
    charged (for the handler). ``deferred`` charges wait for the status (:meth:`Limiting.
    settle`); ``reserved`` are their reservations (a ``Reservation`` or ``AsyncReservation``
    each), in the same order; once settled, ``shown`` are the decisions its headers describe.
    """

    decisions: tuple[Decision, ...]
    headers: list[tuple[str, str]]
    response: tuple[int, list[tuple[str, str]], bytes] | None = None
    deferred: tuple[Charge, ...] = ()
    reserved: tuple[Any, ...] = ()
    shown: tuple[Decision, ...] = ()

    @property
    def blocked(self) -> bool:
        return self.response is not None


#: What ``admit`` and ``settle`` yield: a store call, a reservation to cancel, or an awaitable
#: from an async callable.
Step = StoreCall | Settle | Awaitable[Any]
Steps = Generator[Step, Any, Any]
