"""The web layer's vocabulary: what a rule's choices may be, what happens to a request
without an identity or a preflight, where the decisions are stored on a request."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .._algorithms.policy import Policy
from .._model.decision import Decision
from ._request import Request

log = logging.getLogger("ratekeeper")

#: What happens to a request whose key function finds no identity: ``"client_ip"`` limits it by
#: its address under :func:`anonymous_identity`, ``"reject"`` answers 400, ``"allow"`` passes it
#: on unlimited (by that policy).
MissingIdentity = Literal["client_ip", "reject", "allow"]
MISSING_IDENTITY: tuple[MissingIdentity, ...] = ("client_ip", "reject", "allow")

#: What happens to a CORS preflight that a rule without an explicit "OPTIONS" matches:
#: ``"exempt"`` passes it on uncharged, ``"charge"`` charges it like any other request.
Preflight = Literal["exempt", "charge"]
PREFLIGHT: tuple[Preflight, ...] = ("exempt", "charge")

#: The ``detail`` of the 400 that ``missing_identity="reject"`` answers.
MISSING_IDENTITY_DETAIL = "The request carries no client identity, which this endpoint requires."

#: The key the decisions charged for a request are stored under: ``scope["state"][STATE_KEY]``
#: (``request.state.ratekeeper`` on Starlette, FastAPI and Litestar) and ``environ[STATE_KEY]``.
STATE_KEY = "ratekeeper"
#: Where a handler reports the real cost of its request for a ``reported_cost=True`` rule:
#: ``request.state.ratekeeper_cost = tokens`` (ASGI), ``environ["ratekeeper_cost"]`` (WSGI,
#: Flask's ``request.environ``), ``request.ratekeeper_cost`` (Django).
COST_KEY = "ratekeeper_cost"


#: A rule's policy: a Policy, None (not limited), or a callable of the request returning one
#: (sync, or async under an async driver).
PolicyChoice = Policy | Callable[[Request], "Policy | Awaitable[Policy | None] | None"] | None
#: A key: a callable of the request returning the identity or None (sync, or async).
KeyChoice = Callable[[Request], "str | Awaitable[str | None] | None"]
#: A cost: an int >= 1, or a callable of the request returning one (sync, or async).
CostChoice = int | Callable[[Request], "int | Awaitable[int]"]
#: Called with the response's status code: whether the request is charged.
DeductWhen = Callable[[int], bool]
#: A rule's ``reported_cost``: False; True (the cost the handler stored under ``COST_KEY``);
#: or a plain function of the response returning the cost (an int >= 0), or None to keep the
#: estimate. The response is the framework's own (Django, Flask) or, in the ASGI and WSGI
#: middlewares, a :class:`ResponseView`.
ReportedCost = bool | Callable[[Any], "int | None"]


@dataclass(frozen=True, slots=True)
class ResponseView:
    """A response as the ASGI and WSGI middlewares see it, for a ``reported_cost`` function,
    once its last chunk is ready: ``status``; ``headers``, names in lower case (the last value
    of a repeated name); ``state``, where the handler may have written (the ASGI scope's
    ``state``, ``request.state`` on Starlette and FastAPI; the WSGI environ)."""

    status: int
    headers: Mapping[str, str]
    state: Mapping[str, Any]


#: Builds a denial response: (decision, request) -> (status, headers, body).
DeniedResponse = Callable[[Decision, Request], tuple[int, list[tuple[str, str]], bytes]]


def _is_async(func: Any) -> bool:
    """Whether calling ``func`` gives an awaitable to await: a coroutine function, a partial
    of one, or an object whose ``__call__`` is one. Decided once, at configuration time."""
    return inspect.iscoroutinefunction(func) or (
        not inspect.isroutine(func) and inspect.iscoroutinefunction(getattr(func, "__call__", None))  # noqa: B004
    )
