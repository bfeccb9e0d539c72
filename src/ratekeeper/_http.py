"""Framework-free HTTP pieces shared by the ASGI and WSGI middleware: the request view, rules,
which requests are charged (methods as frameworks route them, CORS preflights, requests with no
identity), and the response headers and body. Pure functions, no I/O.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal

from ._decision import Decision
from ._errors import ConfigError
from ._policy import Policy

__all__ = [
    "DeniedResponse",
    "KeyFunc",
    "Limiting",
    "MissingIdentity",
    "Outcome",
    "Preflight",
    "Request",
    "Route",
    "Rule",
    "anonymous_identity",
    "is_preflight",
    "match_rule",
    "problem_body",
    "rate_limit_headers",
    "response_headers",
]

#: What happens to a request whose key function finds no identity: ``"client_ip"`` limits it by
#: its address under :func:`anonymous_identity`, ``"reject"`` answers 400, ``"allow"`` passes it
#: on unlimited.
MissingIdentity = Literal["client_ip", "reject", "allow"]
MISSING_IDENTITY: tuple[MissingIdentity, ...] = ("client_ip", "reject", "allow")

#: What happens to a CORS preflight that a rule without an explicit "OPTIONS" matches:
#: ``"exempt"`` passes it on uncharged, ``"charge"`` charges it like any other request.
Preflight = Literal["exempt", "charge"]
PREFLIGHT: tuple[Preflight, ...] = ("exempt", "charge")

#: The ``detail`` of the 400 that ``missing_identity="reject"`` answers.
MISSING_IDENTITY_DETAIL = "The request carries no client identity, which this endpoint requires."


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
    of methods (any case), or None for any; they match as frameworks route them: Starlette,
    Flask and Django's class-based views serve HEAD with the GET handler, so a rule naming GET
    also charges HEAD. A rule that names "OPTIONS" charges every OPTIONS request, CORS
    preflights included. ``key`` overrides the middleware's key function; ``cost`` is what
    one request spends; ``shadow`` decides and sets headers but never blocks.
    ``policy=None`` exempts matching requests (health checks).
    """

    path: str | re.Pattern[str]
    policy: Policy | None
    methods: AbstractSet[str] | None = None
    key: KeyFunc | None = None
    cost: int = 1
    shadow: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, re.Pattern)):
            raise ConfigError(f"rule path must be a str or a compiled regex, got {self.path!r}")
        if self.policy is not None and not isinstance(self.policy, Policy):
            raise ConfigError(f"rule policy must be a Policy or None, got {self.policy!r}")
        if self.methods is not None:
            if isinstance(self.methods, str) or not all(
                isinstance(m, str) and m for m in self.methods
            ):
                raise ConfigError(
                    f"rule methods must be a set of method names such as {{'GET'}}, "
                    f"got {self.methods!r}"
                )
            methods = frozenset(m.upper() for m in self.methods)
            if not methods:
                raise ConfigError("rule methods must name at least one method (None for any)")
            object.__setattr__(self, "methods", methods)
        if isinstance(self.cost, bool) or not isinstance(self.cost, int) or self.cost < 1:
            raise ConfigError(f"rule cost must be an int >= 1, got {self.cost!r}")

    def matches(self, method: str, path: str) -> bool:
        if self.methods is not None and not (
            method in self.methods or (method == "HEAD" and "GET" in self.methods)
        ):
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


def is_preflight(request: Request) -> bool:
    """Whether a request is a CORS preflight: OPTIONS with ``Origin`` and
    ``Access-Control-Request-Method`` (the test Starlette's ``CORSMiddleware`` makes). Browsers
    send one on their own before a cross-origin request, and then send that request."""
    return (
        request.method == "OPTIONS"
        and "origin" in request.headers
        and "access-control-request-method" in request.headers
    )


def anonymous_identity(address: str | None) -> str:
    """The identity ``missing_identity="client_ip"`` gives a request its key function found
    none for: ``anonymous:`` and the address ``client_ip()`` gives its socket peer
    (``anonymous:ip:203.0.113.7``), or ``anonymous:no-address`` for every request whose peer
    is no address (a Unix socket, a test client's ``"testclient"``).

    No key function of ``ratekeeper.identity`` returns this: ``header()`` gives ``<name>:<32
    hex digits>`` and ``client_ip()`` gives ``ip:...``, so an anonymous client never shares a
    budget with a real API key or with a client identified by ``client_ip()`` itself."""
    return f"anonymous:{address}" if address is not None else "anonymous:no-address"


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
class Route:
    """A request to charge: ``cost`` of ``policy`` for ``identity``, under ``rule``."""

    rule: Rule
    policy: Policy
    identity: str


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
    middleware, the FastAPI dependency and the Flask decorator only do the I/O around it.

    ``missing_identity`` says what a request gets when its key function returns None (a
    ``header()`` without ``fallback``, a custom key function): ``"client_ip"`` (the default) is
    limited by its socket peer's address, under :func:`anonymous_identity`; ``"reject"`` is
    answered 400 with problem+json (in shadow mode it is passed on: shadow mode never blocks);
    ``"allow"`` is passed on unlimited. ``preflight`` says what a CORS preflight (see
    :func:`is_preflight`) gets from a rule that does not name "OPTIONS": ``"exempt"`` (the
    default) passes it on uncharged, as the browser sends the real request next, which is
    charged; ``"charge"`` charges it. A rule naming "OPTIONS" always charges it.
    """

    __slots__ = (
        "_peer",
        "denied",
        "key",
        "legacy_headers",
        "missing_identity",
        "preflight",
        "rules",
        "shadow",
    )

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
        missing_identity: MissingIdentity = "client_ip",
        preflight: Preflight = "exempt",
    ) -> None:
        from .identity import client_ip

        if missing_identity not in MISSING_IDENTITY:
            raise ConfigError(
                f"missing_identity must be one of {', '.join(map(repr, MISSING_IDENTITY))}, "
                f"got {missing_identity!r}"
            )
        if preflight not in PREFLIGHT:
            raise ConfigError(
                f"preflight must be one of {', '.join(map(repr, PREFLIGHT))}, got {preflight!r}"
            )
        self.rules = make_rules(policy, rules, exempt)
        self._peer = client_ip()
        self.key = key if key is not None else self._peer
        self.shadow = shadow
        self.legacy_headers = legacy_headers
        self.denied = denied if denied is not None else default_denied
        self.missing_identity = missing_identity
        self.preflight = preflight

    def route(self, request: Request) -> Route | Outcome | None:
        """The :class:`Route` of a request to charge; an :class:`Outcome` to answer at once
        (``missing_identity="reject"``); None to pass it on untouched (exempt, no rule, a CORS
        preflight the rule does not charge, or ``missing_identity="allow"``)."""
        rule = match_rule(self.rules, request.method, request.path)
        if rule is None or rule.policy is None:
            return None
        if (
            self.preflight == "exempt"
            and (rule.methods is None or "OPTIONS" not in rule.methods)
            and is_preflight(request)
        ):
            return None
        identity = (rule.key or self.key)(request)
        if identity is None:
            if self.missing_identity == "client_ip":
                identity = anonymous_identity(self._peer(request))
            elif self.missing_identity == "reject" and not (self.shadow or rule.shadow):
                # A fresh one each time: a WSGI server may add to the header list it is given.
                return Outcome(True, [], missing_identity_response())
            else:
                return None
        return Route(rule, rule.policy, identity)

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
