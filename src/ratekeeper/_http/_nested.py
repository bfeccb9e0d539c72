"""Several limiters on one request: a ``@ratelimit`` view, a ``fastapi_dependency`` or a
``flask_limit`` behind one of our middlewares (or beside another such limiter), all adding
their headers to one response.

Each records on the request what that response's RateLimit headers describe, a :class:`Shown`
under :data:`SHOWN_KEY` in the request's state (``scope["state"]`` on ASGI, the environ on
WSGI: for Django, ``request.scope["state"]`` or ``request.META``), and the limiter around it
reads it when it adds its own headers:

* a limiter that answers the request itself (a 429, the 400 of ``missing_identity="reject"``)
  records :data:`ANSWERED`: its response stands as it is, headers and all;
* a limiter that passes the request on shows its own decisions and those recorded, in one
  rendering (:func:`response_headers`: ``RateLimit`` is the one of them all that constrains
  most), and records them all for the limiter around it.

The decisions each limiter charged are added to ``state[STATE_KEY]`` by :func:`add_charged`.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._model.decision import Decision
from ._base import STATE_KEY
from ._render import response_headers

__all__ = ["ANSWERED", "SHOWN_KEY", "Shown", "add_charged", "answered", "shown_headers"]

#: The key, in a request's state, of what its response's RateLimit headers describe so far.
SHOWN_KEY = "ratekeeper.shown"


@dataclass(frozen=True, slots=True)
class Shown:
    """What the RateLimit headers of a response describe: ``decisions`` (the legacy headers
    too when ``legacy``); or, when ``answered``, a response a limiter answered itself."""

    decisions: tuple[Decision, ...] = ()
    legacy: bool = False
    answered: bool = False


#: Recorded by a limiter that answers the request itself: the limiters around leave it alone.
ANSWERED = Shown(answered=True)

State = MutableMapping[str, Any]


def answered(state: State) -> None:
    """Record that a limiter answered the request itself (a denial, a rejection)."""
    state[SHOWN_KEY] = ANSWERED


def shown_headers(
    state: State,
    decisions: Sequence[Decision],
    headers: list[tuple[str, str]],
    *,
    legacy: bool,
    record: bool = True,
) -> list[tuple[str, str]] | None:
    """The headers a limiter that passed the request on adds to the response: ``headers``
    (its own, of ``decisions``) when no other limiter recorded any; None when one answered
    the request (the response stands as it is); else the headers of its decisions and of
    those recorded, which it records in turn unless not ``record`` (the ASGI and WSGI
    middlewares: no limiter of ours is around them)."""
    inner: Shown | None = state.get(SHOWN_KEY)
    if inner is None:
        if record:
            state[SHOWN_KEY] = Shown(tuple(decisions), legacy)
        return headers
    if inner.answered:
        return None
    shown = Shown((*decisions, *inner.decisions), legacy or inner.legacy)
    if record:
        state[SHOWN_KEY] = shown
    return response_headers(shown.decisions, legacy=shown.legacy, retry_after=False)


def add_charged(state: State, decisions: tuple[Decision, ...]) -> None:
    """Add ``decisions`` to those charged for the request, ``state[STATE_KEY]`` (the
    middleware's, then an endpoint's)."""
    state[STATE_KEY] = (*state.get(STATE_KEY, ()), *decisions)
