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
2. when an admission has ``deferred`` charges (rules with ``deduct_when``), ``settle(admission,
   status)`` charges those the status calls for, once the app's status is known, and returns
   the headers to send.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import re
import threading
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, Literal

from ._decision import Decision
from ._errors import ConfigError
from ._policy import Policy
from ._request import KeyFunc, LazyHeaders, Request
from .identity import client_ip

if TYPE_CHECKING:
    from ._limiter import AsyncLimiter, Limiter

__all__ = [
    "Admission",
    "Charge",
    "CostChoice",
    "DeductWhen",
    "DeniedResponse",
    "KeyChoice",
    "KeyFunc",
    "LazyHeaders",
    "Limiting",
    "MissingIdentity",
    "PolicyChoice",
    "Preflight",
    "Request",
    "Rule",
    "StoreCall",
    "anonymous_identity",
    "drive_async",
    "drive_blocking",
    "drive_sync",
    "headers_for",
    "is_preflight",
    "match_rule",
    "problem_body",
    "rate_limit_headers",
    "response_headers",
    "warn_memory_under_workers",
]

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


#: A rule's policy: a Policy, None (not limited), or a callable of the request returning one
#: (sync, or async under an async driver).
PolicyChoice = Policy | Callable[[Request], "Policy | Awaitable[Policy | None] | None"] | None
#: A key: a callable of the request returning the identity or None (sync, or async).
KeyChoice = Callable[[Request], "str | Awaitable[str | None] | None"]
#: A cost: an int >= 1, or a callable of the request returning one (sync, or async).
CostChoice = int | Callable[[Request], "int | Awaitable[int]"]
#: Called with the response's status code: whether the request is charged.
DeductWhen = Callable[[int], bool]

#: Builds a denial response: (decision, request) -> (status, headers, body).
DeniedResponse = Callable[[Decision, Request], tuple[int, list[tuple[str, str]], bytes]]


def _is_async(func: Any) -> bool:
    """Whether calling ``func`` gives an awaitable to await: a coroutine function, a partial
    of one, or an object whose ``__call__`` is one. Decided once, at configuration time."""
    return inspect.iscoroutinefunction(func) or (
        not inspect.isroutine(func) and inspect.iscoroutinefunction(getattr(func, "__call__", None))  # noqa: B004
    )


@dataclass(frozen=True, slots=True)
class Rule:
    """A route: requests whose method and path match are limited by ``policy``.

    ``path`` is a glob (``/api/*``, ``/users/*/avatar``; ``*`` matches anything, including
    ``/``) or a compiled regular expression (matched with ``fullmatch``). ``methods`` is a set
    of methods (any case), or None for any; they match as frameworks route them: Starlette,
    Flask and Django's class-based views serve HEAD with the GET handler, so a rule naming GET
    also charges HEAD. A rule that names "OPTIONS" charges every OPTIONS request, CORS
    preflights included.

    ``policy`` is a Policy; None, which exempts matching requests from every policy (health
    checks); or a callable of the :class:`Request` returning a Policy or None (None: this rule
    does not limit the request, an application policy still does). ``key`` overrides the
    middleware's key function; ``cost`` is what one request spends, an int or a callable of
    the request. Under ASGI each callable may be sync or ``async def``.

    ``deduct_when`` counts on the outcome: a callable of the response's status code. The
    request is refused before the handler runs when the budget is already spent (a peek, which
    consumes nothing), and charged once the status is known, only when ``deduct_when(status)``
    is true: ``deduct_when=lambda status: status == 401`` counts failed logins.

    ``shadow`` decides and sets headers but never blocks.
    """

    path: str | re.Pattern[str]
    policy: PolicyChoice
    methods: AbstractSet[str] | None = None
    key: KeyChoice | None = None
    cost: CostChoice = 1
    shadow: bool = False
    deduct_when: DeductWhen | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, re.Pattern)):
            raise ConfigError(f"rule path must be a str or a compiled regex, got {self.path!r}")
        if not (self.policy is None or isinstance(self.policy, Policy) or callable(self.policy)):
            raise ConfigError(
                f"rule policy must be a Policy, None or a callable of the request returning "
                f"one, got {self.policy!r}"
            )
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

    def matches(self, method: str, path: str) -> bool:
        if self.methods is not None and not (
            method in self.methods or (method == "HEAD" and "GET" in self.methods)
        ):
            return False
        if isinstance(self.path, str):
            return fnmatchcase(path, self.path)
        return self.path.fullmatch(path) is not None


def _check_cost(cost: Any, what: str) -> int:
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ConfigError(f"{what} must be an int >= 1, got {cost!r}")
    return cost


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


# --- the decision for a request ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoreCall:
    """A store call the driver makes: ``limiter.peek`` if ``peek``, else ``limiter.hit``;
    for ``cached``, the limiter's local deny cache only (no store call): a cached denial of
    that hit, or None."""

    policy: Policy
    identity: str
    cost: int
    peek: bool = False
    cached: bool = False


@dataclass(frozen=True, slots=True)
class Charge:
    """One policy to charge for a request: ``cost`` of ``policy`` for ``identity``.
    ``deduct_when`` set: charged after the response, when it says so."""

    policy: Policy
    identity: str
    cost: int
    shadow: bool
    deduct_when: DeductWhen | None = None


@dataclass(slots=True)
class Admission:
    """What :meth:`Limiting.admit` decided for a request that a policy applies to.

    ``response`` set: answer it at once (a denial, or the 400 of ``missing_identity=
    "reject"``), with no call to the app. Otherwise pass it on: ``headers`` are those to add
    to the app's response when nothing is ``deferred``; ``decisions`` are the decisions
    charged (for the handler). ``deferred`` charges wait for the status (:meth:`Limiting.
    settle`); ``peeked`` are their peeks, in the same order.
    """

    decisions: tuple[Decision, ...]
    headers: list[tuple[str, str]]
    response: tuple[int, list[tuple[str, str]], bytes] | None = None
    deferred: tuple[Charge, ...] = ()
    peeked: tuple[Decision, ...] = ()

    @property
    def blocked(self) -> bool:
        return self.response is not None


#: What ``admit`` and ``settle`` yield: a store call, or an awaitable from an async callable.
Step = StoreCall | Awaitable[Any]
Steps = Generator[Step, Any, Any]


@dataclass(frozen=True, slots=True)
class _Choice:
    """A configured value or a callable of the request; ``awaited`` when it is async."""

    value: Any
    func: Callable[[Request], Any] | None
    awaited: bool
    where: str


def _choice(value: Any, where: str, asynchronous: bool) -> _Choice:
    if isinstance(value, Policy) or value is None or not callable(value):
        return _Choice(value, None, False, where)
    awaited = _is_async(value)
    if awaited and not asynchronous:
        raise ConfigError(
            f"{where} is async ({value!r}): this integration runs sync code; use a plain "
            "function, or the ASGI middleware"
        )
    return _Choice(None, value, awaited, where)


@dataclass(frozen=True, slots=True)
class _Compiled:
    rule: Rule
    policy: _Choice
    key: _Choice | None
    cost: _Choice


class Limiting:
    """The middleware's configuration and every choice it makes, without I/O: which policies
    a request is charged to, for which identity and cost, in which order, and what the
    decisions mean for the response. The integrations only drive it (:func:`drive_sync`,
    :func:`drive_async`) and move the request and response.

    Options (those of the middleware):

    * ``policy``, ``rules``, ``exempt``: the default policy for every path no rule matches;
      the rules, first match wins; paths never limited by anything.
    * ``key``: the default key function (default: ``client_ip()``, the socket peer).
    * ``application_policy``: a Policy, or a callable of the request returning one or None,
      charged on every request that is not exempt, in addition to the matching rule's
      policy; ``application_key`` its key function (default: ``key``). Its cost is 1.
    * ``shadow``, ``legacy_headers``, ``denied``, ``missing_identity``, ``preflight``: see
      the middleware. ``missing_identity`` applies per policy: ``"allow"`` skips the policy
      whose key found no identity.
    * ``enabled``: False passes every request on untouched, without a store call.
    * ``asynchronous``: whether the driver can await (async callables are refused otherwise).

    **Stacked policies.** A request is admitted only when every policy that applies admits
    it. They are asked one after another (two policies never share a cluster slot: each
    policy's keys carry their own hash tag, so one script call cannot cover both), in this
    order, stopping at the first denial:

    1. the local deny cache of every policy to be hit (no store call): a denial cached there
       answers at once and consumes nothing from any policy;
    2. the peek of every ``deduct_when`` policy (consumes nothing);
    3. the hit of the rule's policy, then the hit of the application policy.

    So a denial by the rule's policy consumes nothing from the application policy, and a
    denial by the application policy after the rule's admitted has consumed the rule's cost
    from the rule's policy; further requests denied while that denial is in the deny cache
    consume nothing. A ``deduct_when`` policy is charged only after the response, so a
    denial by any policy before the handler consumes nothing from it.
    """

    __slots__ = (
        "_application",
        "_application_key",
        "_compiled",
        "_key",
        "_peer",
        "asynchronous",
        "denied",
        "enabled",
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
        key: KeyChoice | None = None,
        rules: Iterable[Rule] = (),
        exempt: Iterable[str | re.Pattern[str]] = (),
        shadow: bool = False,
        legacy_headers: bool = False,
        denied: DeniedResponse | None = None,
        missing_identity: MissingIdentity = "client_ip",
        preflight: Preflight = "exempt",
        application_policy: PolicyChoice = None,
        application_key: KeyChoice | None = None,
        enabled: bool = True,
        asynchronous: bool = False,
    ) -> None:
        if missing_identity not in MISSING_IDENTITY:
            raise ConfigError(
                f"missing_identity must be one of {', '.join(map(repr, MISSING_IDENTITY))}, "
                f"got {missing_identity!r}"
            )
        if preflight not in PREFLIGHT:
            raise ConfigError(
                f"preflight must be one of {', '.join(map(repr, PREFLIGHT))}, got {preflight!r}"
            )
        if not isinstance(enabled, bool):
            raise ConfigError(f"enabled must be True or False, got {enabled!r}")
        if not (
            application_policy is None
            or isinstance(application_policy, Policy)
            or callable(application_policy)
        ):
            raise ConfigError(
                f"application_policy must be a Policy or a callable of the request returning "
                f"one, got {application_policy!r}"
            )
        for name, func in (("key", key), ("application_key", application_key)):
            if func is not None and not callable(func):
                raise ConfigError(f"{name} must be a callable of the request, got {func!r}")
        if application_key is not None and application_policy is None:
            raise ConfigError("application_key needs an application_policy")
        self.rules = make_rules(policy, rules, exempt)
        if application_policy is None and not any(r.policy is not None for r in self.rules):
            raise ConfigError("the middleware needs a policy, or rules with policies")
        self.asynchronous = asynchronous
        self._peer = client_ip()
        self.key = key if key is not None else self._peer
        self._key = _choice(self.key, "key", asynchronous)
        self._compiled = tuple(
            _Compiled(
                rule,
                _choice(rule.policy, f"policy of rule {rule.path!r}", asynchronous),
                None
                if rule.key is None
                else _choice(rule.key, f"key of rule {rule.path!r}", asynchronous),
                _choice(rule.cost, f"cost of rule {rule.path!r}", asynchronous),
            )
            for rule in self.rules
        )
        self._application = (
            None
            if application_policy is None
            else _choice(application_policy, "application_policy", asynchronous)
        )
        self._application_key = (
            self._key
            if application_key is None
            else _choice(application_key, "application_key", asynchronous)
        )
        self.shadow = shadow
        self.legacy_headers = legacy_headers
        self.denied = denied if denied is not None else default_denied
        self.missing_identity = missing_identity
        self.preflight = preflight
        self.enabled = enabled

    def _match(self, request: Request) -> _Compiled | None:
        method, path = request.method, request.path
        for compiled in self._compiled:
            if compiled.rule.matches(method, path):
                return compiled
        return None

    @staticmethod
    def _choose(choice: _Choice, request: Request) -> Steps:
        """The value of a choice for ``request``: a generator, so an async callable's
        awaitable goes to the driver."""
        assert choice.func is not None
        value = choice.func(request)
        if choice.awaited:
            value = yield value
        return value

    @staticmethod
    def _wrong(choice: _Choice, value: Any, expected: str) -> TypeError:
        """The bug a callable's wrong result is: reported, never taken for a pass."""
        if inspect.isawaitable(value):
            # A sync-looking callable that returns an awaitable (a lambda around a coroutine
            # function): how to call it was decided at configuration time.
            if inspect.iscoroutine(value):
                value.close()
            return TypeError(
                f"the {choice.where} returned an awaitable but is not a coroutine function: "
                "declare it with async def"
            )
        return TypeError(f"the {choice.where} returned {value!r}, not {expected}")

    def _charge(
        self,
        pchoice: _Choice,
        kchoice: _Choice,
        cchoice: _Choice | None,
        shadow: bool,
        deduct_when: DeductWhen | None,
        request: Request,
        identities: dict[int, str | None],
    ) -> Steps:
        """The :class:`Charge` of one policy for ``request``; None when it does not apply;
        an :class:`Admission` to answer at once (``missing_identity="reject"``)."""
        if pchoice.func is None:
            policy = pchoice.value
        else:
            policy = yield from self._choose(pchoice, request)
        if policy is None:
            return None
        if not isinstance(policy, Policy):
            raise self._wrong(pchoice, policy, "a Policy or None")
        if id(kchoice) in identities:
            identity = identities[id(kchoice)]
        else:
            identity = yield from self._choose(kchoice, request)
            if identity is not None and not isinstance(identity, str):
                raise self._wrong(kchoice, identity, "a str or None")
            identities[id(kchoice)] = identity
        if identity is None:
            if self.missing_identity == "client_ip":
                identity = anonymous_identity(self._peer(request))
            elif self.missing_identity == "reject" and not shadow:
                return Admission((), [], missing_identity_response())
            else:
                return None
        cost = 1
        if cchoice is not None:
            if cchoice.func is None:
                cost = cchoice.value
            else:
                cost = yield from self._choose(cchoice, request)
                if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
                    raise self._wrong(cchoice, cost, "an int >= 1")
        return Charge(policy, identity, cost, shadow, deduct_when)

    def admit(self, request: Request) -> Steps:
        """Decide a request: a generator of steps for a driver, returning None (pass it on
        untouched: disabled, exempt, no policy applies, an exempt CORS preflight) or an
        :class:`Admission`."""
        if not self.enabled:
            return None
        compiled = self._match(request)
        if compiled is not None and compiled.rule.policy is None:
            return None  # exempt from every policy
        if compiled is None and self._application is None:
            return None
        methods = compiled.rule.methods if compiled is not None else None
        if (
            self.preflight == "exempt"
            and (methods is None or "OPTIONS" not in methods)
            and is_preflight(request)
        ):
            return None

        identities: dict[int, str | None] = {}  # per key function: evaluated once a request
        charges: list[Charge] = []
        if compiled is not None:
            found = yield from self._charge(
                compiled.policy,
                compiled.key if compiled.key is not None else self._key,
                compiled.cost,
                self.shadow or compiled.rule.shadow,
                compiled.rule.deduct_when,
                request,
                identities,
            )
            if isinstance(found, Admission):
                return found
            if found is not None:
                charges.append(found)
        if self._application is not None:
            found = yield from self._charge(
                self._application,
                self._application_key,
                None,
                self.shadow,
                None,
                request,
                identities,
            )
            if isinstance(found, Admission):
                return found
            if found is not None:
                charges.append(found)
        if not charges:
            return None
        now = [c for c in charges if c.deduct_when is None]
        later = tuple(c for c in charges if c.deduct_when is not None)
        # 1. A denial in the local deny cache answers at once, consuming nothing.
        for charge in now if len(charges) > 1 else ():
            if not charge.shadow:
                cached = yield StoreCall(charge.policy, charge.identity, charge.cost, cached=True)
                if cached is not None:
                    return self._deny([cached], cached, request)
        decided: list[Decision] = []
        # 2. Outcome-counted policies: a peek, refused before the handler when already spent.
        peeked: list[Decision] = []
        for charge in later:
            decision = yield StoreCall(charge.policy, charge.identity, charge.cost, peek=True)
            peeked.append(decision)
            if not decision.allowed and not charge.shadow:
                return self._deny([*decided, decision], decision, request)
        # 3. The hits, the rule's policy first.
        for charge in now:
            decision = yield StoreCall(charge.policy, charge.identity, charge.cost)
            decided.append(decision)
            if not decision.allowed and not charge.shadow:
                return self._deny([*decided, *peeked], decision, request)
        if later:
            return Admission(tuple(decided), [], None, later, tuple(peeked))
        return Admission(tuple(decided), self._passed(decided))

    def settle(self, admission: Admission, status: int) -> Steps:
        """Charge the deferred policies that ``deduct_when(status)`` calls for: a generator
        of steps returning the headers to add to the response (every decision of the
        request: charged ones, and the peeks of those not charged). Run it once the status is
        known, before the response starts."""
        before = admission.decisions
        charged: list[Decision] = []
        shown: list[Decision] = []  # the rule's policy first, as in the hits
        for charge, peek in zip(admission.deferred, admission.peeked, strict=True):
            if charge.deduct_when is not None and charge.deduct_when(status):
                decision = yield StoreCall(charge.policy, charge.identity, charge.cost)
                charged.append(decision)
                shown.append(decision)
            else:
                shown.append(peek)
        admission.decisions = (*charged, *before)
        return self._passed([*shown, *before])

    def _passed(self, decisions: Sequence[Decision]) -> list[tuple[str, str]]:
        # Passed on (allowed, or shadow mode): no Retry-After, the client need not wait.
        return response_headers(decisions, legacy=self.legacy_headers, retry_after=False)

    def _deny(self, decisions: Sequence[Decision], denial: Decision, request: Request) -> Admission:
        headers = response_headers(decisions, legacy=self.legacy_headers)
        status, extra, body = self.denied(denial, request)
        response = (status, with_length(merge_headers(extra, headers), body), body)
        return Admission(tuple(d for d in decisions if d.allowed), headers, response)


# --- drivers ------------------------------------------------------------------------------------


def _cached(limiter: Limiter | AsyncLimiter, call: StoreCall) -> Decision | None:
    """A denial of ``call`` in the limiter's local deny cache, or None: no store call."""
    guard = limiter._guard
    if not guard.caches(call.policy):
        return None
    key = limiter._core.first_key(call.policy, call.identity)
    if call.cost == 1:
        return guard.cached(key)
    deny = guard._deny
    return None if deny is None else deny.lookup(key, call.cost)


def _call_blocking(limiter: Limiter, step: StoreCall) -> Any:
    """One store call of ``admit`` or ``settle`` on a blocking limiter."""
    if step.cached:
        return _cached(limiter, step)
    if step.peek:
        return limiter.peek(step.policy, step.identity, step.cost)
    return limiter.hit(step.policy, step.identity, step.cost)


def drive_sync(steps: Steps, limiter: Limiter) -> Any:
    """Run ``admit`` or ``settle`` on a blocking limiter; their result."""
    reply: Any = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        if type(step) is not StoreCall:
            raise TypeError(f"a sync driver cannot await {step!r}")
        reply = _call_blocking(limiter, step)


async def drive_blocking(steps: Steps, limiter: Limiter) -> Any:
    """Run ``admit`` or ``settle`` with a blocking limiter's store calls, awaiting async
    callables: for an async view on an event loop that lives for one request (Django under
    WSGI), where an asyncio connection would outlive its loop."""
    reply: Any = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        if type(step) is StoreCall:
            reply = _call_blocking(limiter, step)
        else:
            reply = await step  # type: ignore[misc]


async def drive_async(steps: Steps, limiter: AsyncLimiter) -> Any:
    """Run ``admit`` or ``settle`` on an asyncio limiter, awaiting async callables; their
    result."""
    reply: Any = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        if type(step) is StoreCall:
            if step.cached:
                reply = _cached(limiter, step)
            elif step.peek:
                reply = await limiter.peek(step.policy, step.identity, step.cost)
            else:
                reply = await limiter.hit(step.policy, step.identity, step.cost)
        else:
            reply = await step  # type: ignore[misc]


# --- memory:// under several workers -----------------------------------------------------------

_SERVERS = ("gunicorn", "uvicorn", "hypercorn", "granian")
_WORKER_FLAGS = ("-w", "--workers")
_warned = False
_warned_lock = threading.Lock()


def _server(argv: Sequence[str]) -> str | None:
    """The server a command line runs (``gunicorn ...``, ``python -m uvicorn ...``, gunicorn's
    retitled ``gunicorn: master [app]``), or None."""
    for word in argv[:3]:
        name = os.path.basename(word)
        for server in _SERVERS:
            if name.startswith(server) or word.endswith(f"/{server}/__main__.py"):
                return server
    return None


def _workers_flag(argv: Sequence[str]) -> int | None:
    """The worker count a command line gives with ``-w``/``--workers``, or None."""
    for i, word in enumerate(argv):
        value = None
        if word in _WORKER_FLAGS and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith("--workers="):
            value = word.partition("=")[2]
        elif word.startswith("-w") and word[2:].isdigit():
            value = word[2:]
        if value is not None and value.isdigit():
            return int(value)
    return None


def several_workers(
    environ: Mapping[str, str],
    parent_argv: Sequence[str],
    own_argv: Sequence[str] = (),
    parent_children: int = 0,
) -> str | None:
    """Why this process is evidently one of several workers, or None.

    Evident means: ``WEB_CONCURRENCY`` above 1 (gunicorn and uvicorn take it for their worker
    count); or this process is gunicorn, uvicorn, hypercorn or granian started with
    ``-w``/``--workers`` above 1 (a supervisor that loads the app before forking its workers,
    as ``gunicorn --preload`` does); or its parent is one of them, started with more than one
    worker, or (a count from a config file, a retitled ``gunicorn: master``) with
    ``parent_children`` of 2 or more."""
    concurrency = environ.get("WEB_CONCURRENCY", "").strip()
    if concurrency.isdigit() and int(concurrency) > 1:
        return f"WEB_CONCURRENCY={concurrency}"
    for argv, children in ((own_argv, 0), (parent_argv, parent_children)):
        server = _server(argv)
        if server is None:
            continue
        workers = _workers_flag(argv)
        if workers is not None and workers > 1:
            return f"{server} with {workers} workers"
        if workers is None and children > 1:
            return f"{server} with {children} worker processes"
    return None


def _argv(pid: int | str) -> list[str]:
    """A process's command line (Linux ``/proc``; elsewhere: none)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _children(pid: int) -> int:
    """How many child processes ``pid`` has (Linux ``/proc``; elsewhere: 0)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return len(f.read().split())
    except OSError:
        return 0


def warn_memory_under_workers(limiter: Limiter | AsyncLimiter, where: str) -> bool:
    """Log a warning, once a process, when ``limiter`` is on ``memory://`` and this process is
    evidently one of several workers: each worker would admit the whole limit. Whether it
    warned."""
    global _warned
    from ._storage.memory import AsyncMemoryStorage, MemoryStorage

    if _warned or not isinstance(limiter.storage, (MemoryStorage, AsyncMemoryStorage)):
        return False
    parent = os.getppid()
    why = several_workers(os.environ, _argv(parent), _argv("self"), _children(parent))
    if why is None:
        return False
    with _warned_lock:
        warn, _warned = not _warned, True
    if warn:
        log.warning(
            "ratekeeper: %s is on memory:// in a process that is one of several workers "
            "(%s): each worker keeps its own counts and admits the whole limit; use a Redis "
            "or Valkey URL",
            where,
            why,
        )
    return warn
