"""Rules: which requests a policy applies to (path, methods, exemptions), and the identity of
an anonymous client."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from .._algorithms.policy import Policy
from .._model.errors import ConfigError
from ._base import CostChoice, DeductWhen, KeyChoice, PolicyChoice, ReportedCost, _is_async
from ._request import Request

#: The methods of the IANA HTTP Method Registry, and PURGE (caches): what a rule may name.
HTTP_METHODS = frozenset(
    [
        "ACL",
        "BASELINE-CONTROL",
        "BIND",
        "CHECKIN",
        "CHECKOUT",
        "CONNECT",
        "COPY",
        "DELETE",
        "GET",
        "HEAD",
        "LABEL",
        "LINK",
        "LOCK",
        "MERGE",
        "MKACTIVITY",
        "MKCALENDAR",
        "MKCOL",
        "MKREDIRECTREF",
        "MKWORKSPACE",
        "MOVE",
        "OPTIONS",
        "ORDERPATCH",
        "PATCH",
        "POST",
        "PRI",
        "PROPFIND",
        "PROPPATCH",
        "PURGE",
        "PUT",
        "QUERY",
        "REBIND",
        "REPORT",
        "SEARCH",
        "TRACE",
        "UNBIND",
        "UNCHECKOUT",
        "UNLINK",
        "UNLOCK",
        "UPDATE",
        "UPDATEREDIRECTREF",
        "VERSION-CONTROL",
    ]
)


@dataclass(frozen=True, slots=True)
class Rule:
    """A route: requests whose method and path match are limited by ``policy``.

    ``path`` is a glob (``/api/*``, ``/users/*/avatar``; ``*`` matches anything, including
    ``/``) or a compiled regular expression (matched with ``fullmatch``). ``methods`` is a set
    of HTTP methods (any case; a name that is not one is a ConfigError), or None for any; a
    request's method matches in any case too. They match as frameworks route them: Starlette,
    Flask and Django's class-based views serve HEAD with the GET handler, so a rule naming GET
    also charges HEAD. A rule that names "OPTIONS" charges every OPTIONS request, CORS
    preflights included.

    ``policy`` is a Policy; None, which exempts matching requests from every policy (health
    checks); or a callable of the :class:`Request` returning a Policy or None (None: this rule
    does not limit the request, an application policy still does). ``key`` overrides the
    middleware's key function; ``cost`` is what one request spends, an int or a callable of
    the request. Under ASGI each callable may be sync or ``async def``.

    ``deduct_when`` counts on the outcome: a callable of the response's status code. The cost
    is reserved before the handler runs (the request is refused when it does not fit), kept
    once the status is known when ``deduct_when(status)`` is true, and refunded otherwise:
    ``deduct_when=lambda status: status == 401`` counts failed logins. So requests in flight
    count until they end: however many arrive at once, at most the limit reach the handler
    beyond those whose outcome did not count.

    ``reported_cost``: ``cost`` is an estimate, reserved before the handler runs and settled
    to the real cost just before the response's last chunk leaves, streamed or not. True: the
    cost the handler stores, ``request.state.ratekeeper_cost = tokens`` under ASGI
    (``scope["state"]``), ``environ["ratekeeper_cost"]`` under WSGI. Or a plain function of
    the response (a :class:`ResponseView`: status, headers, state) returning the cost:
    ``lambda response: int(response.headers["x-tokens-used"])``. None (nothing reported)
    keeps the estimate. With ``deduct_when`` too, an outcome that does not count refunds the
    estimate at the response start.

    ``shadow`` decides and sets headers but never blocks.
    """

    path: str | re.Pattern[str]
    policy: PolicyChoice
    methods: AbstractSet[str] | None = None
    key: KeyChoice | None = None
    cost: CostChoice = 1
    shadow: bool = False
    deduct_when: DeductWhen | None = None
    reported_cost: ReportedCost = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, re.Pattern)):
            raise ConfigError(f"rule path must be a str or a compiled regex, got {self.path!r}")
        if not (self.policy is None or isinstance(self.policy, Policy) or callable(self.policy)):
            raise ConfigError(
                f"rule policy must be a Policy, None or a callable of the request returning "
                f"one, got {self.policy!r}"
            )
        check_charged(self.policy, "rule policy")
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
            unknown = sorted(methods - HTTP_METHODS)
            if unknown:
                raise ConfigError(
                    f"rule methods {', '.join(map(repr, unknown))} are not HTTP methods (the "
                    "IANA registry's, and PURGE): a misspelt one would never match"
                )
            object.__setattr__(self, "methods", methods)
        if self.key is not None and not callable(self.key):
            raise ConfigError(f"rule key must be a callable of the request, got {self.key!r}")
        if not callable(self.cost):
            _check_cost(self.cost, "rule cost")
        if self.deduct_when is not None:
            if not callable(self.deduct_when):
                raise ConfigError(
                    f"rule deduct_when must be a callable of the status code, "
                    f"got {self.deduct_when!r}"
                )
            if _is_async(self.deduct_when):
                raise ConfigError("rule deduct_when must be a plain function of the status code")
            if self.policy is None:
                raise ConfigError("rule deduct_when needs a policy to charge")
        check_reported_cost(self.reported_cost, "rule reported_cost")
        if self.reported_cost is not False and self.policy is None:
            raise ConfigError("rule reported_cost needs a policy to charge")

    def matches(self, method: str, path: str) -> bool:
        if self.methods is not None and not (
            method in self.methods or (method == "HEAD" and "GET" in self.methods)
        ):
            return False
        if isinstance(self.path, str):
            return fnmatchcase(path, self.path)
        return self.path.fullmatch(path) is not None


def check_reported_cost(reported: Any, what: str) -> None:
    """A ``reported_cost`` choice: True, False, or a plain function of the response."""
    if isinstance(reported, bool):
        return
    if not callable(reported):
        raise ConfigError(
            f"{what} must be True, False or a function of the response, got {reported!r}"
        )
    if _is_async(reported):
        raise ConfigError(f"{what} must be a plain function of the response, not async")


def _check_cost(cost: Any, what: str) -> int:
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ConfigError(f"{what} must be an int >= 1, got {cost!r}")
    return cost


def check_charged(policy: object, what: str) -> None:
    """A policy a request is charged under: not a ``concurrency`` one, whose units are leases
    held while work runs (``limiter.acquire``), not charges."""
    if isinstance(policy, Policy) and policy.algorithm == "concurrency":
        raise ConfigError(
            f"{what} {policy.name!r} is a concurrency policy: requests hold its leases with "
            f"limiter.acquire(...) around the work (a middleware of your own), they are not "
            f"charged against it"
        )


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
