"""Framework-free HTTP rules shared by every web integration: the request view, rules, which
requests are charged and to which policies (chosen per request, stacked, counted on the
outcome), and the response headers and body. No I/O.

The decision for a request is a generator, :meth:`Limiting.admit`, that yields what it needs
done and is sent the answers: a :class:`StoreCall` (the driver answers with ``limiter.hit`` or
``limiter.peek``, or with ``limiter``'s local deny cache for a ``cached`` call) or an awaitable
from a user's async callable (an async driver awaits it; a sync ``Limiting`` refuses async
callables when configured). :func:`drive_sync` and :func:`drive_async` are those drivers: every
integration (ASGI, WSGI, FastAPI, Flask, Django) only moves requests and responses around them.

A request is handled in two steps:

1. ``admit(request)`` returns None (pass it on untouched) or an :class:`Admission`: a response
   to answer at once (``blocked``), or headers to add to the app's response and the decisions
   charged (``decisions``, for the handler);
2. when an admission has ``deferred`` charges (rules with ``deduct_when`` or
   ``reported_cost``), ``settle(admission, status)`` charges those the status calls for, once
   the app's status is known, and returns the headers to send;
3. with ``reported_cost``, ``finish(admission, response, stored)`` settles the reported cost
   when the last chunk of the body is ready (``_streams`` wraps a body so).

Its modules: ``_base`` (the vocabulary: choices, constants), ``_rules`` (which requests a policy
applies to), ``_render`` (headers and 429 bodies), ``_limiting`` (the decision for a request,
no I/O), ``_steps`` (what it yields and returns), ``_drivers`` (running it, blocking or
asyncio), ``_streams`` (bodies that settle before their last chunk), ``_middleware`` (what the
ASGI and WSGI middlewares share), ``_nested`` (several limiters on one request: a decorator
or dependency behind a middleware, one set of headers) and ``_workers`` (``memory://`` under
several workers), ``_request`` (the request view every integration builds) and ``_identity``
(the key functions; ``ratekeeper.identity`` is their public face).
"""

from __future__ import annotations

from ._base import (
    COST_KEY,
    STATE_KEY,
    CostChoice,
    DeductWhen,
    DeniedResponse,
    KeyChoice,
    MissingIdentity,
    PolicyChoice,
    Preflight,
    ReportedCost,
    ResponseView,
    _is_async,
)
from ._drivers import drive_async, drive_blocking, drive_sync
from ._limiting import Limiting
from ._middleware import EndpointOptions, Middleware, MiddlewareOptions, endpoint_limiting
from ._nested import SHOWN_KEY, add_charged, answered, shown_headers
from ._render import (
    headers_for,
    merge_headers,
    missing_identity_response,
    problem_body,
    rate_limit_headers,
    response_headers,
)
from ._request import KeyFunc, LazyHeaders, Request
from ._rules import Rule, anonymous_identity, is_preflight, make_rules, match_rule
from ._steps import Admission, Charge, Settle, Steps, StoreCall
from ._streams import LastChunk, last_chunk_async
from ._workers import several_workers, warn_memory_under_workers

__all__ = [
    "COST_KEY",
    "SHOWN_KEY",
    "STATE_KEY",
    "Admission",
    "Charge",
    "CostChoice",
    "DeductWhen",
    "DeniedResponse",
    "EndpointOptions",
    "KeyChoice",
    "KeyFunc",
    "LastChunk",
    "LazyHeaders",
    "Limiting",
    "Middleware",
    "MiddlewareOptions",
    "MissingIdentity",
    "PolicyChoice",
    "Preflight",
    "ReportedCost",
    "Request",
    "ResponseView",
    "Rule",
    "Settle",
    "Steps",
    "StoreCall",
    "_is_async",
    "add_charged",
    "anonymous_identity",
    "answered",
    "drive_async",
    "drive_blocking",
    "drive_sync",
    "endpoint_limiting",
    "headers_for",
    "is_preflight",
    "last_chunk_async",
    "make_rules",
    "match_rule",
    "merge_headers",
    "missing_identity_response",
    "problem_body",
    "rate_limit_headers",
    "response_headers",
    "several_workers",
    "shown_headers",
    "warn_memory_under_workers",
]
