"""The decision for a request, without I/O: :class:`Limiting` yields the store calls it needs
(:class:`StoreCall`) and awaitables from async callables, and is sent their answers."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .._algorithms.policy import Policy
from .._engine.core import check_actual
from .._model.decision import Decision
from .._model.errors import ConfigError
from ._base import (
    MISSING_IDENTITY,
    PREFLIGHT,
    DeductWhen,
    DeniedResponse,
    KeyChoice,
    MissingIdentity,
    PolicyChoice,
    Preflight,
    _is_async,
)
from ._identity import client_ip
from ._render import (
    default_denied,
    merge_headers,
    missing_identity_response,
    response_headers,
    with_length,
)
from ._request import Request
from ._rules import Rule, anonymous_identity, check_charged, is_preflight, make_rules
from ._steps import Admission, Charge, Settle, Steps, StoreCall

log = logging.getLogger("ratekeeper")


# --- the decision for a request ---------------------------------------------------------------


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
    * ``settles_reported``: whether the driver calls :meth:`finish` when the response ends
      (rules with ``reported_cost`` are refused otherwise: ``fastapi_dependency`` cannot).

    **Stacked policies.** A request is admitted only when every policy that applies admits
    it. They are asked one after another (two policies never share a cluster slot: each
    policy's keys carry their own hash tag, so one script call cannot cover both), in this
    order, stopping at the first denial:

    1. the local deny cache of every policy to be hit (no store call): a denial cached there
       answers at once and consumes nothing from any policy;
    2. the reservation of every ``deduct_when`` policy's cost (cancelled if a later policy
       denies, or once the status says the outcome does not count);
    3. the hit of the rule's policy, then the hit of the application policy.

    So a denial by the rule's policy consumes nothing from the application policy, and a
    denial by the application policy after the rule's admitted has consumed the rule's cost
    from the rule's policy; further requests denied while that denial is in the deny cache
    consume nothing. A ``deduct_when`` policy's reservation is cancelled when any policy
    denies the request, so a denial before the handler consumes nothing from it.
    """

    __slots__ = (
        "_application",
        "_application_key",
        "_compiled",
        "_key",
        "_peer",
        "_warned_costs",
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
        settles_reported: bool = False,
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
        check_charged(application_policy, "application_policy")
        for name, func in (("key", key), ("application_key", application_key)):
            if func is not None and not callable(func):
                raise ConfigError(f"{name} must be a callable of the request, got {func!r}")
        if application_key is not None and application_policy is None:
            raise ConfigError("application_key needs an application_policy")
        self.rules = make_rules(policy, rules, exempt)
        if not settles_reported and any(rule.reported_cost is not False for rule in self.rules):
            raise ConfigError(
                "reported_cost is settled when the response ends, which a dependency does not "
                "see: use a Rule of the ASGI middleware for this route"
            )
        if application_policy is None and not any(r.policy is not None for r in self.rules):
            raise ConfigError("the middleware needs a policy, or rules with policies")
        self.asynchronous = asynchronous
        self._peer = client_ip()
        #: (route, policy) whose bad reported cost was logged already.
        self._warned_costs: set[tuple[str, str]] = set()
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
                if compiled.rule.reported_cost is not False:
                    path = compiled.rule.path
                    route = path if isinstance(path, str) else path.pattern
                    found = replace(found, reported=compiled.rule.reported_cost, route=route)
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
        now = [c for c in charges if not c.deferred]
        later = tuple(c for c in charges if c.deferred)
        # 1. A denial in the local deny cache answers at once, consuming nothing.
        for charge in now if len(charges) > 1 else ():
            if not charge.shadow:
                cached = yield StoreCall(charge.policy, charge.identity, charge.cost, cached=True)
                if cached is not None:
                    return self._deny([cached], cached, request)
        decided: list[Decision] = []
        # 2. Outcome-counted policies: a reservation of the cost, held while the handler runs
        #    (so at most the limit can be counted or in flight at once), settled by its status.
        reserved: list[Any] = []
        for charge in later:
            reservation = yield StoreCall(charge.policy, charge.identity, charge.cost, reserve=True)
            reserved.append(reservation)
            if not reservation.allowed and not charge.shadow:
                held = yield from self._cancel(reserved)
                return self._deny(held, reservation.decision, request)
        # 3. The hits, the rule's policy first.
        for charge in now:
            decision = yield StoreCall(charge.policy, charge.identity, charge.cost)
            decided.append(decision)
            if not decision.allowed and not charge.shadow:
                held = yield from self._cancel(reserved)  # the handler will not run
                return self._deny([*decided, *held], decision, request)
        if later:
            return Admission(tuple(decided), [], None, later, tuple(reserved))
        return Admission(tuple(decided), self._passed(decided))

    @staticmethod
    def _cancel(reserved: Sequence[Any]) -> Steps:
        """Cancel the reservations still held; the decisions after (each one's own where
        nothing was refunded)."""
        after: list[Decision] = []
        for reservation in reserved:
            decision = (yield Settle(reservation)) if reservation.held else None
            after.append(reservation.decision if decision is None else decision)
        return after

    def settle(self, admission: Admission, status: int) -> Steps:
        """Settle the deferred policies' reservations by ``deduct_when(status)``: kept where
        it counts the outcome (nothing to send), cancelled where it does not. A generator of
        steps returning the headers to add to the response (every decision of the request:
        the kept reservations', and where the others' cancels left them). Run it once the
        status is known, before the response starts."""
        before = admission.decisions
        charged: list[Decision] = []
        shown: list[Decision] = []  # the rule's policy first, as in the hits
        for charge, reservation in zip(admission.deferred, admission.reserved, strict=True):
            if charge.deduct_when is None or charge.deduct_when(status):
                if reservation.held:
                    if charge.reported is False:  # else settled when the response ends
                        reservation.keep()
                    charged.append(reservation.decision)
                shown.append(reservation.decision)
            else:
                (after,) = yield from self._cancel([reservation])
                shown.append(after)
        admission.decisions = (*charged, *before)
        admission.shown = (*shown, *before)
        return self._passed(admission.shown)

    @staticmethod
    def reports(admission: Admission) -> bool:
        """Whether the driver must call :meth:`finish` when the response ends."""
        return any(charge.reported is not False for charge in admission.deferred)

    def finish(
        self, admission: Admission, response: Any, stored: Any, complete: bool = True
    ) -> Steps:
        """Once the response's last chunk is ready: settle the reservations of
        ``reported_cost`` rules to the cost reported, ``stored`` (what the handler stored
        under ``COST_KEY``) for ``reported_cost=True``, else the rule's function of
        ``response``. None (nothing reported) keeps the estimate. A reported cost that is not
        a whole number from 0 to 2**53 is the handler's bug, found as the response ends: the
        estimate stays charged and a warning names the route and the policy (once per rule
        and policy), and the response completes (raising here would cut it short).

        ``complete=False``: the response was abandoned before its last chunk (the client
        went away). What was reported so far is charged, or the estimate if that is more:
        the work the estimate admitted may be done whether or not the client read it, and
        leaving early must not cost less than staying."""
        for charge, reservation in zip(admission.deferred, admission.reserved, strict=True):
            reported = charge.reported
            if reported is False or not reservation.held:
                continue
            actual = stored if reported is True else reported(response)
            if actual is None:
                reservation.keep()
                continue
            try:
                check_actual(actual)  # what a settle takes: a whole number from 0 to 2**53
            except ConfigError:
                reservation.keep()
                self._bad_cost(charge, actual)
                continue
            if not complete and actual <= charge.cost:
                reservation.keep()  # abandoned: the estimate, which is more
                continue
            yield Settle(reservation, actual)

    def _bad_cost(self, charge: Charge, actual: object) -> None:
        """Log a bad reported cost, once per route and policy."""
        warned = (charge.route, charge.policy.name)
        if warned in self._warned_costs:
            return
        self._warned_costs.add(warned)  # bounded: one entry per rule and policy
        log.warning(
            "ratekeeper: route %s, policy %r: the reported cost must be a whole number from 0 "
            "to 2**53 (or None to keep the estimate), got %r; the estimate stays charged "
            "(said once for this route and policy)",
            charge.route,
            charge.policy.name,
            actual,
        )

    def _passed(self, decisions: Sequence[Decision]) -> list[tuple[str, str]]:
        # Passed on (allowed, or shadow mode): no Retry-After, the client need not wait.
        return response_headers(decisions, legacy=self.legacy_headers, retry_after=False)

    def _deny(self, decisions: Sequence[Decision], denial: Decision, request: Request) -> Admission:
        headers = response_headers(decisions, legacy=self.legacy_headers)
        status, extra, body = self.denied(denial, request)
        response = (status, with_length(merge_headers(extra, headers), body), body)
        return Admission(tuple(d for d in decisions if d.allowed), headers, response)
