"""Reservations: consume an estimate now, then settle the real cost once the work is done.

``limiter.reserve(policy, identity, cost=estimate)`` is a hit that remembers where its units
were counted (the stamp the script returns). ``settle(actual)`` then charges exactly
``actual`` in one atomic call: it refunds the difference, or adds the rest even past the limit
(the work is done; later calls wait for it). ``cancel()`` refunds it all. Unsettled, a
reservation keeps its estimate: it never lets more through than was counted.

States: held (admitted, not yet settled), settled, cancelled; a denied reservation holds
nothing. Settling twice, after a cancel or a denial is a :class:`ReservationError`; a cancel
after a settle (or a second cancel) does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

from .._engine.core import Call, check_actual
from .._model.decision import Decision
from .._model.errors import ReservationError

__all__ = ["AsyncReservation", "Reservation"]

_HELD, _SETTLED, _CANCELLED, _DENIED = "held", "settled", "cancelled", "denied"

#: Settles ``call`` (made at ``stamp``) for ``actual``: the decision after it.
Settle = Callable[[Call, "int | None", int], Any]


class _Reserved:
    """What both kinds of reservation know: the call that made it, its decision, its stamp
    and its state."""

    __slots__ = ("_cancel_on_error", "_settle", "_state", "call", "decision", "stamp")

    def __init__(
        self,
        call: Call,
        decision: Decision,
        stamp: int | None,
        settle: Settle,
        cancel_on_error: bool,
    ) -> None:
        self.call = call
        self.decision = decision
        #: Where the store counted the estimate (None: it holds nothing of it: a failure mode
        #: admitted the reservation, so settling charges the whole actual cost).
        self.stamp = stamp
        self._settle = settle
        self._cancel_on_error = cancel_on_error
        self._state = _HELD if decision.allowed else _DENIED

    def __reduce__(self) -> Any:
        # A reservation is bound to the limiter that made it; another process resumes it.
        raise TypeError(
            f"a reservation cannot be pickled: it is bound to its limiter. Send its policy's "
            f"name, the identity, its estimate ({self.estimate}) and its stamp ({self.stamp!r}) "
            f"instead, and resume it where it is settled: limiter.resume(policy, identity, "
            f"estimate, stamp)"
        )

    @property
    def allowed(self) -> bool:
        """Whether the estimate was admitted: do the work only then."""
        return self.decision.allowed

    @property
    def estimate(self) -> int:
        """The cost reserved."""
        return self.call.cost

    @property
    def held(self) -> bool:
        """Admitted, and neither settled nor cancelled."""
        return self._state == _HELD

    def _settling(self, actual: int) -> Any:
        """The settle of ``actual``; raises when there is nothing to settle."""
        if self._state != _HELD:
            raise ReservationError(
                f"this reservation of {self.estimate} under {self.call.policy.name!r} was "
                f"{self._state}: it has nothing to settle"
            )
        check_actual(actual)
        # Once asked, never again, even when the store failed to answer: a call that timed out
        # may have run, and a second charge would double it.
        self._state = _SETTLED
        return self._settle(self.call, self.stamp, actual)

    def _cancelling(self) -> Any | None:
        """The refund of the estimate, or None when there is nothing to refund."""
        if self._state != _HELD:
            return None
        self._state = _CANCELLED
        if self.stamp is None:  # the store holds nothing of it
            return None
        return self._settle(self.call, self.stamp, 0)

    def keep(self) -> None:
        """Settle at the estimate, which the store holds already: nothing is sent. (A
        reservation never settled keeps it too; this only ends it, so that no settle or
        cancel can follow.)"""
        if self._state == _HELD:
            self._state = _SETTLED

    def _leaving(self, failed: bool) -> Any | None:
        """Leaving a ``with`` block: refund on an exception when asked, else keep the
        estimate."""
        if failed and self._cancel_on_error:
            return self._cancelling()
        self.keep()
        return None

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.call.policy.name!r} estimate={self.estimate} "
            f"{self._state}>"
        )


class Reservation(_Reserved):
    """A reservation from :meth:`Limiter.reserve`. Do the work only if :attr:`allowed`.

    >>> r = limiter.reserve(tokens, "key-7", cost=500)  # doctest: +SKIP
    >>> if r.allowed:  # doctest: +SKIP
    ...     used = call_the_model()
    ...     r.settle(used)
    """

    __slots__ = ()

    def settle(self, actual: int) -> Decision:
        """Charge exactly ``actual`` instead of the estimate (refund the difference, or add
        the rest even past the limit); the decision as it stands after."""
        return self._settling(actual)  # type: ignore[no-any-return]

    def cancel(self) -> Decision | None:
        """Refund the whole estimate; the decision after, or None when there was nothing to
        refund (denied, settled or cancelled already, or held by a failure mode only)."""
        return self._cancelling()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leaving(exc_type is not None)


class AsyncReservation(_Reserved):
    """A reservation from :meth:`AsyncLimiter.reserve`: ``settle`` and ``cancel`` are
    coroutines."""

    __slots__ = ()

    async def settle(self, actual: int) -> Decision:
        """:meth:`Reservation.settle`, awaited."""
        return await self._settling(actual)  # type: ignore[no-any-return]

    async def cancel(self) -> Decision | None:
        """:meth:`Reservation.cancel`, awaited."""
        pending = self._cancelling()
        return None if pending is None else await pending

    async def __aenter__(self) -> AsyncReservation:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pending = self._leaving(exc_type is not None)
        if pending is not None:
            await pending
