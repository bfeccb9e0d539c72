"""Rendering a decision: the IETF ``RateLimit``/``RateLimit-Policy`` headers (and the legacy
``X-RateLimit-*`` ones), ``Retry-After``, and the RFC 9457 problem body of a 429."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from .._model.decision import Decision
from ._base import MISSING_IDENTITY_DETAIL
from ._request import Request

# --- rendering --------------------------------------------------------------------------------


def _constraining(decisions: Sequence[Decision]) -> Decision:
    """The decision that constrains most: a denial (the longest wait); else the fewest units
    left, then the longest wait until the window is free."""
    denied = [d for d in decisions if not d.allowed]
    if denied:
        return max(denied, key=lambda d: math.inf if d.retry_after is None else d.retry_after)
    return min(decisions, key=lambda d: (d.remaining, -d.reset_after))


#: The ``RateLimit-Policy`` item of each (policy name, rate) seen: they repeat on every request.
_policy_items: dict[tuple[str, Any], str] = {}
_MAX_ITEMS = 1024


def _policy_item(decision: Decision) -> str:
    key = (decision.policy, decision.rate)
    item = _policy_items.get(key)
    if item is None:
        # Policy names never need escaping in an sf-string (see Policy).
        rate = decision.rate
        item = f'"{decision.policy}";q={rate.limit};w={math.ceil(rate.period)}'
        if len(_policy_items) >= _MAX_ITEMS:
            _policy_items.clear()
        _policy_items[key] = item
    return item


def headers_for(
    decisions: Sequence[Decision], *, legacy: bool = False, retry_after: bool = True
) -> list[tuple[str, str]]:
    """The IETF ``RateLimit-Policy`` and ``RateLimit`` headers (draft-ietf-httpapi-ratelimit-
    headers) for the decisions of one request: ``RateLimit-Policy`` lists every policy, in
    order (a structured-field list); ``RateLimit`` reports the one that constrains most (see
    :func:`_constraining`), as does ``Retry-After`` on a denial (unless ``retry_after`` is
    false: a response that is passed on need not wait) and, if asked, the legacy
    ``X-RateLimit-*`` trio. Policy names are quoted sf-strings; times are whole seconds,
    rounded up, so a client that waits them is never early."""
    if not decisions:
        return []
    if len(decisions) == 1:
        top = decisions[0]
        listed = _policy_item(top)
    else:
        top = _constraining(decisions)
        listed = ", ".join([_policy_item(d) for d in decisions])
    reset = math.ceil(top.reset_after)
    headers = [
        ("RateLimit-Policy", listed),
        ("RateLimit", f'"{top.policy}";r={top.remaining};t={reset}'),
    ]
    if retry_after and top.retry_after is not None and math.isfinite(top.retry_after):
        headers.append(("Retry-After", str(max(1, math.ceil(top.retry_after)))))
    if legacy:
        headers += [
            ("X-RateLimit-Limit", str(top.rate.limit)),
            ("X-RateLimit-Remaining", str(top.remaining)),
            ("X-RateLimit-Reset", str(reset)),
        ]
    return headers


def rate_limit_headers(decision: Decision, *, legacy: bool = False) -> list[tuple[str, str]]:
    """:func:`headers_for` one decision."""
    return headers_for((decision,), legacy=legacy)


def response_headers(
    decisions: Decision | Sequence[Decision], *, legacy: bool = False, retry_after: bool = True
) -> list[tuple[str, str]]:
    """The headers a middleware adds for the decisions of a request. A degraded decision's
    numbers are made up by the failure mode, so it is left out, except for the
    ``Retry-After`` of a degraded denial."""
    if isinstance(decisions, Decision):
        decisions = (decisions,)
    if len(decisions) == 1 and not decisions[0].degraded:  # the usual case, built directly
        return headers_for(decisions, legacy=legacy, retry_after=retry_after)
    exact = [d for d in decisions if not d.degraded]
    headers = headers_for(exact, legacy=legacy, retry_after=retry_after)
    denied = [d for d in decisions if d.degraded and not d.allowed]
    if retry_after and denied and not any(name == "Retry-After" for name, _ in headers):
        headers += [h for h in headers_for(denied) if h[0] == "Retry-After"]
    return headers


def default_denied(
    decision: Decision, request: Request
) -> tuple[int, list[tuple[str, str]], bytes]:
    """The default denial: 429 with an RFC 9457 problem+json body."""
    return 429, [("Content-Type", "application/problem+json")], problem_body(decision)


def missing_identity_response() -> tuple[int, list[tuple[str, str]], bytes]:
    """The answer of ``missing_identity="reject"``: 400 with an RFC 9457 problem+json body."""
    problem = {
        "type": "about:blank",
        "title": "Bad Request",
        "status": 400,
        "detail": MISSING_IDENTITY_DETAIL,
    }
    body = json.dumps(problem, separators=(",", ":")).encode()
    return 400, with_length([("Content-Type", "application/problem+json")], body), body


#: The part of the 429 body before ``retry_after``, per (policy name, rate).
_problem_heads: dict[tuple[str, Any], str] = {}


def problem_body(decision: Decision) -> bytes:
    """An RFC 9457 ``application/problem+json`` body for a 429 (compact JSON)."""
    key = (decision.policy, decision.rate)
    head = _problem_heads.get(key)
    if head is None:
        problem = {
            "type": "about:blank",
            "title": "Too Many Requests",
            "status": 429,
            "detail": f"Rate limit exceeded for policy {decision.policy!r} ({decision.rate}).",
            "policy": decision.policy,
        }
        head = json.dumps(problem, separators=(",", ":"))[:-1]
        if len(_problem_heads) >= _MAX_ITEMS:
            _problem_heads.clear()
        _problem_heads[key] = head
    retry = decision.retry_after
    if retry is not None and math.isfinite(retry):
        # float repr is what json.dumps writes for a float
        return f'{head},"retry_after":{math.ceil(retry * 1000) / 1000!r}}}'.encode()
    return f"{head}}}".encode()


def with_length(headers: Iterable[tuple[str, str]], body: bytes) -> list[tuple[str, str]]:
    """``headers`` with exactly one Content-Length, the body's."""
    kept = [(n, v) for n, v in headers if n.lower() != "content-length"]
    return [*kept, ("Content-Length", str(len(body)))]


def merge_headers(
    app_headers: Iterable[tuple[str, str]], ours: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The app's headers without any it shares a name with ours, then ours: never a duplicate."""
    names = {name.lower() for name, _ in ours}
    return [(n, v) for n, v in app_headers if n.lower() not in names] + list(ours)
