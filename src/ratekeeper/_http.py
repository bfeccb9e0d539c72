"""Framework-free HTTP pieces shared by the ASGI and WSGI middleware: the request view, rules,
and the response headers and body. Pure functions, no I/O.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from ._decision import Decision
from ._errors import ConfigError
from ._policy import Policy

__all__ = [
    "DeniedResponse",
    "KeyFunc",
    "Limiting",
    "Outcome",
    "Request",
    "Rule",
    "match_rule",
    "problem_body",
    "rate_limit_headers",
    "response_headers",
]


@dataclass(frozen=True, slots=True)
class Request:
    """What a key function sees of a request, the same under ASGI and WSGI.

    ``headers`` maps lower-case names to values; repeated headers are joined with ``", "`` in
    the order received, as RFC 9110 allows for list-valued fields. ``peer`` is the address of
    the connecting socket (the last proxy, if any), or None when the server does not say.
    ``raw`` is the ASGI scope or the WSGI environ, for key functions that need more.
    """

    method: str
    path: str
    headers: Mapping[str, str]
    peer: str | None
    raw: Any = field(default=None, compare=False, repr=False)


#: A key function returns the identity for a request, or None when it has none.
KeyFunc = Callable[[Request], "str | None"]

#: Builds a denial response: (decision, request) -> (status, headers, body).
DeniedResponse = Callable[[Decision, Request], tuple[int, list[tuple[str, str]], bytes]]


@dataclass(frozen=True, slots=True)
class Rule:
    """A route: requests whose method and path match are limited by ``policy``.

    ``path`` is a glob (``/api/*``, ``/users/*/avatar``; ``*`` matches anything, including
    ``/``) or a compiled regular expression (matched with ``fullmatch``). ``methods`` is a set
    of upper-case methods, or None for any. ``key`` overrides the middleware's key function;
    ``cost`` is what one request spends; ``shadow`` decides and sets headers but never blocks.
    ``policy=None`` exempts matching requests (health checks).
    """

    path: str | re.Pattern[str]
    policy: Policy | None
    methods: frozenset[str] | None = None
    key: KeyFunc | None = None
    cost: int = 1
    shadow: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, re.Pattern)):
            raise ConfigError(f"rule path must be a str or a compiled regex, got {self.path!r}")
        if self.policy is not None and not isinstance(self.policy, Policy):
            raise ConfigError(f"rule policy must be a Policy or None, got {self.policy!r}")
        if self.methods is not None:
            methods = frozenset(m.upper() for m in self.methods)
            object.__setattr__(self, "methods", methods)
        if isinstance(self.cost, bool) or not isinstance(self.cost, int) or self.cost < 1:
            raise ConfigError(f"rule cost must be an int >= 1, got {self.cost!r}")

    def matches(self, method: str, path: str) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        if isinstance(self.path, str):
            return fnmatchcase(path, self.path)
        return self.path.fullmatch(path) is not None


def make_rules(
    policy: Policy | None, rules: Iterable[Rule], exempt: Iterable[str | re.Pattern[str]]
) -> tuple[Rule, ...]:
    """Exemptions first, then the rules in order, then the default policy for every path."""
    out = [Rule(path, None) for path in exempt]
    for rule in rules:
        if not isinstance(rule, Rule):
            raise ConfigError(f"rules must be Rule values, got {rule!r}")
        out.append(rule)
    if policy is not None:
        if not isinstance(policy, Policy):
            raise ConfigError(f"policy must be a Policy, got {type(policy).__name__}")
        out.append(Rule("*", policy))
    if not any(rule.policy is not None for rule in out):
        raise ConfigError("the middleware needs a policy, or rules with policies")
    return tuple(out)


def match_rule(rules: Sequence[Rule], method: str, path: str) -> Rule | None:
    """The first rule that matches; None when no rule does."""
    for rule in rules:
        if rule.matches(method, path):
            return rule
    return None


def rate_limit_headers(decision: Decision, *, legacy: bool = False) -> list[tuple[str, str]]:
    """The IETF ``RateLimit-Policy`` and ``RateLimit`` headers (draft-ietf-httpapi-ratelimit-
    headers) for a decision, plus ``Retry-After`` on a denial and, if asked, the legacy
    ``X-RateLimit-*`` trio. The policy name is a quoted sf-string; times are whole seconds,
    rounded up, so a client that waits them is never early."""
    rate = decision.rate
    name = decision.policy  # policy names never need escaping in an sf-string
    reset = math.ceil(decision.reset_after)
    headers = [
        ("RateLimit-Policy", f'"{name}";q={rate.limit};w={math.ceil(rate.period)}'),
        ("RateLimit", f'"{name}";r={decision.remaining};t={reset}'),
    ]
    if decision.retry_after is not None and math.isfinite(decision.retry_after):
        headers.append(("Retry-After", str(max(1, math.ceil(decision.retry_after)))))
    if legacy:
        headers += [
            ("X-RateLimit-Limit", str(rate.limit)),
            ("X-RateLimit-Remaining", str(decision.remaining)),
            ("X-RateLimit-Reset", str(reset)),
        ]
    return headers


def response_headers(decision: Decision, *, legacy: bool = False) -> list[tuple[str, str]]:
    """The headers a middleware adds. A degraded decision's numbers are made up by the failure
    mode, so it gets none, except ``Retry-After`` on a denial."""
    if decision.degraded:
        if decision.allowed:
            return []
        return [h for h in rate_limit_headers(decision) if h[0] == "Retry-After"]
    return rate_limit_headers(decision, legacy=legacy)


def default_denied(
    decision: Decision, request: Request
) -> tuple[int, list[tuple[str, str]], bytes]:
    """The default denial: 429 with an RFC 9457 problem+json body."""
    return 429, [("Content-Type", "application/problem+json")], problem_body(decision)


def problem_body(decision: Decision) -> bytes:
    """An RFC 9457 ``application/problem+json`` body for a 429."""
    problem: dict[str, Any] = {
        "type": "about:blank",
        "title": "Too Many Requests",
        "status": 429,
        "detail": f"Rate limit exceeded for policy {decision.policy!r} ({decision.rate}).",
        "policy": decision.policy,
    }
    if decision.retry_after is not None and math.isfinite(decision.retry_after):
        problem["retry_after"] = math.ceil(decision.retry_after * 1000) / 1000
    return json.dumps(problem, separators=(",", ":")).encode()


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


@dataclass(frozen=True, slots=True)
class Outcome:
    """What to do with a request after its decision: block it with ``response``, or pass it
    on and add ``headers`` to the app's response."""

    blocked: bool
    headers: list[tuple[str, str]]
    response: tuple[int, list[tuple[str, str]], bytes] | None = None


class Limiting:
    """The middleware's configuration and every choice it makes, without I/O: which rule and
    identity a request gets, and what the decision means for the response. The ASGI and WSGI
    middleware, the FastAPI dependency and the Flask decorator only do the I/O around it."""

    __slots__ = ("denied", "key", "legacy_headers", "rules", "shadow")

    def __init__(
        self,
        *,
        policy: Policy | None = None,
        key: KeyFunc | None = None,
        rules: Iterable[Rule] = (),
        exempt: Iterable[str | re.Pattern[str]] = (),
        shadow: bool = False,
        legacy_headers: bool = False,
        denied: DeniedResponse | None = None,
    ) -> None:
        from .identity import client_ip

        self.rules = make_rules(policy, rules, exempt)
        self.key = key if key is not None else client_ip()
        self.shadow = shadow
        self.legacy_headers = legacy_headers
        self.denied = denied if denied is not None else default_denied

    def route(self, request: Request) -> tuple[Rule, Policy, str] | None:
        """(rule, policy, identity) for a request to limit; None to pass it through untouched
        (exempt, no rule, or no identity)."""
        rule = match_rule(self.rules, request.method, request.path)
        if rule is None or rule.policy is None:
            return None
        identity = (rule.key or self.key)(request)
        if identity is None:
            return None
        return rule, rule.policy, identity

    def outcome(self, rule: Rule, decision: Decision, request: Request) -> Outcome:
        """Block (unless in shadow mode) or pass on, with the headers either way."""
        headers = response_headers(decision, legacy=self.legacy_headers)
        if not decision.allowed and not (self.shadow or rule.shadow):
            status, extra, body = self.denied(decision, request)
            return Outcome(
                True, headers, (status, with_length(merge_headers(extra, headers), body), body)
            )
        # Passed on (allowed, or shadow mode): no Retry-After, the client need not wait.
        return Outcome(False, [h for h in headers if h[0] != "Retry-After"])
