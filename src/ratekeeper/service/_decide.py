"""One ``ShouldRateLimit`` call, on the service's own copy of Envoy's messages: resolve each
descriptor against the loaded configuration, decide every one through ``AsyncLimiter`` (at once,
so concurrent descriptors and RPCs share round trips through its batching) and build the
response. The gRPC and the HTTP JSON front ends only translate bytes to and from these messages.

As in envoyproxy/ratelimit, every descriptor of a request is decided, and counted, even when
another one is over its limit: the answer is OVER_LIMIT if any descriptor is. ratekeeper never
writes a denial, so a descriptor over its limit is not charged (upstream counts it too); one
within its limit is charged although the request as a whole is refused. A rule with
``charge_over_limit`` (or every rule, with the Decider's ``charge_over_limit``) is counted as
upstream counts: a denied call's hits are added too (``AsyncLimiter.charge``), its answer
still the hit's (OVER_LIMIT when its hits did not fit).

On the wire, as upstream: ``duration_until_reset`` in whole seconds, rounded up (upstream's
``unit - now % unit`` on whole seconds; ``exact_durations`` keeps the fraction), and the window's
end for a fixed window that nothing was counted in yet (a peek) or a rule that denies all;
the empty domain and the empty descriptor list refused with upstream's messages
(:class:`UpstreamRefusal`, gRPC UNKNOWN), a descriptor without entries left unlimited;
``shadow_mode`` (global) answers OK overall whatever the statuses say; ``dynamic_metadata``
fills the response's ``dynamic_metadata`` as upstream's ``RESPONSE_DYNAMIC_METADATA`` does.

Reservations (HTTP ``/reserve`` and ``/settle``): :meth:`Decider.reserve` decides a request as
:meth:`Decider.should_rate_limit` does, reserving each descriptor's hits instead, and hands
back a token (``_tokens``) per reservation held; a request refused as a whole holds nothing (the
reservations it made are cancelled, ``_ROUND`` at a time, a failure logged once per request).
:meth:`Decider.settle` reads a token, finds its rule in the configuration in force, marks the
token used in the store (so a token settles once, whichever worker or replica gets it) and
settles or cancels it. The mark must be the store's own answer: when the store could not write
or read it (an error, a degraded decision of a failure mode, an open breaker), the settle is
refused (``StorageError``, HTTP 503) and changes nothing, whatever the failure mode.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from .._algorithms.policy import Policy
from .._http import response_headers
from .._limiters.limiter import AsyncLimiter
from .._limiters.reservation import AsyncReservation
from .._model.decision import Decision
from .._model.errors import ConfigError, StorageError, StorageUnavailable
from .._model.rates import MAX_INT, Rate
from ._config import LimitRule, ServiceConfig, rule_policy_name
from ._metrics import ServiceMetrics
from ._tokens import CLOCK_SLACK, Held, TokenRefused, Tokens
from ._upstream import limit_headers
from .rls_pb2 import HeaderValue, RateLimitDescriptor, RateLimitRequest, RateLimitResponse

__all__ = [
    "DEFAULT_LIMIT_HEADERS",
    "UNLIMITED_REMAINING",
    "BadRequest",
    "Decider",
    "UpstreamRefusal",
]

log = logging.getLogger("ratekeeper.service")


# --- the pieces of an answer, as envoyproxy/ratelimit shapes them (pure) --------------------

#: ``limit_remaining`` of an unlimited descriptor, as upstream answers (the largest uint32).
UNLIMITED_REMAINING = 2**32 - 1

_OK = RateLimitResponse.OK
_OVER_LIMIT = RateLimitResponse.OVER_LIMIT
_RateLimit = RateLimitResponse.RateLimit
_OverrideUnit = RateLimitDescriptor.RateLimitUnit
#: An override's unit number -> its name (UNKNOWN and numbers the enum lacks are refused).
_OVERRIDE_UNITS = {number: name for name, number in _OverrideUnit.items() if number}
#: Unit name -> the response's enum value (``Unit.Value`` is a Python-level lookup).
_UNITS = dict(RateLimitResponse.RateLimit.Unit.items())


class BadRequest(ValueError):
    """A request the service cannot decide: an empty entry key, a bad ``limit`` override, bytes
    that are not a request. gRPC answers ``grpc_code`` (INVALID_ARGUMENT), HTTP 400."""

    grpc_code = "INVALID_ARGUMENT"


class UpstreamRefusal(BadRequest):
    """A request envoyproxy/ratelimit refuses with an error of its own (no domain, no
    descriptors), answered as it answers: gRPC UNKNOWN with its message, HTTP 400."""

    grpc_code = "UNKNOWN"


def entries_of(descriptor: RateLimitDescriptor) -> list[tuple[str, str]]:
    # A descriptor without entries matches no rule (upstream answers it OK, unlimited).
    entries = [(entry.key, entry.value) for entry in descriptor.entries]
    for key, _ in entries:
        if not key:
            raise BadRequest("a descriptor entry has an empty key")
    return entries


def override_of(descriptor: RateLimitDescriptor) -> tuple[int, str] | None:
    """A descriptor's ``limit`` override as ``(requests_per_unit, unit name)``, or None."""
    if not descriptor.HasField("limit"):
        return None
    limit = descriptor.limit
    if limit.unit == _OverrideUnit.UNKNOWN:
        raise BadRequest("a descriptor's limit override has no unit")
    unit = _OVERRIDE_UNITS.get(limit.unit)
    if unit is None:
        raise BadRequest(
            f"a descriptor's limit override has unit {limit.unit}, which is none of "
            + ", ".join(f"{number} ({name})" for number, name in _OVERRIDE_UNITS.items())
        )
    return limit.requests_per_unit, unit


def limit_message(rule: LimitRule, rate: Rate | None) -> RateLimitResponse.RateLimit:
    """The ``current_limit`` of ``rule`` when ``rate`` decided: with several limits on one
    rule, the one the decision names."""
    requests, unit = rule.current_limit(rate)
    limit = _RateLimit(requests_per_unit=min(requests, UNLIMITED_REMAINING), unit=_UNITS[unit])  # type: ignore[arg-type]
    if rule.name:
        limit.name = rule.name
    return limit


def set_duration(status: RateLimitResponse.DescriptorStatus, seconds: float, exact: bool) -> None:
    """Set ``duration_until_reset``: rounded up to whole seconds, as upstream's (``unit - now %
    unit`` on a clock of whole seconds is the fraction rounded up), or ``exact`` to the
    nanosecond."""
    duration = status.duration_until_reset
    if exact:
        # Duration.FromNanoseconds, without its Python-level normalising (never negative here)
        whole, nanos = divmod(max(0, math.ceil(seconds * 1e9)), 1_000_000_000)
        duration.seconds = whole
        duration.nanos = nanos
    else:
        duration.seconds = max(0, math.ceil(seconds))


def until_window_end(window: float, now: float) -> float:
    """Seconds from ``now`` to the end of the fixed window of ``window`` seconds it is in
    (windows are aligned to the epoch, as upstream's and ratekeeper's ``fixed_window``)."""
    return window - now % window


def _override_text(limit: RateLimitDescriptor.RateLimitOverride) -> str:
    """An override as upstream's metadata shows it (protobuf text form, zero fields left out)."""
    parts = []
    if limit.requests_per_unit:
        parts.append(f"requests_per_unit:{limit.requests_per_unit}")
    if limit.unit:
        parts.append(f"unit:{_OVERRIDE_UNITS.get(limit.unit, limit.unit)}")
    return " ".join(parts)


def _merge(into: dict[str, Any], metadata: Mapping[str, Any]) -> None:
    """Merge a rule's ``metadata`` as upstream does: a key already present keeps its value,
    except that two mappings are merged, recursively."""
    for key, value in metadata.items():
        if key not in into:
            into[key] = _plain(value)
        elif isinstance(into[key], dict) and isinstance(value, Mapping):
            _merge(into[key], value)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def dynamic_metadata(
    request: RateLimitRequest, passed: Sequence[LimitRule | None]
) -> dict[str, Any]:
    """The response's ``dynamic_metadata`` as upstream's ``RESPONSE_DYNAMIC_METADATA`` fills
    it: the domain, each descriptor (its entries as ``key=value``, its ``limit`` override and
    ``hitsAddend`` when given), the request's ``hitsAddend`` when not 0, and ``metadata``: the
    ``metadata`` of the rules of the descriptors that passed, merged."""
    descriptors = []
    for descriptor in request.descriptors:
        shown: dict[str, Any] = {
            "entries": [f"{entry.key}={entry.value}" for entry in descriptor.entries]
        }
        if descriptor.HasField("limit"):
            shown["limit"] = _override_text(descriptor.limit)
        if descriptor.HasField("hits_addend"):
            shown["hitsAddend"] = descriptor.hits_addend.value
        descriptors.append(shown)
    data: dict[str, Any] = {"domain": request.domain, "descriptors": descriptors}
    if request.hits_addend:
        data["hitsAddend"] = request.hits_addend
    merged: dict[str, Any] = {}
    for rule in passed:
        if rule is not None and rule.metadata:
            _merge(merged, rule.metadata)
    if merged:
        data["metadata"] = merged
    return data


def hits_of(request: RateLimitRequest, descriptor: RateLimitDescriptor) -> int:
    """A descriptor's hits: its own ``hits_addend`` when set (0 too), else the request's, else 1."""
    if descriptor.HasField("hits_addend"):
        return int(descriptor.hits_addend.value)
    return request.hits_addend or 1


def quota_overall(
    rules: Sequence[LimitRule | None],
    statuses: Sequence[RateLimitResponse.DescriptorStatus],
    everywhere: bool,
) -> RateLimitResponse.Code:
    """The overall code under quota mode, as upstream's: OVER_LIMIT when a descriptor that is
    not in quota mode is over its limit, or when every quota descriptor is (``everywhere``:
    upstream's global ``QUOTA_MODE``, every descriptor but the unlimited ones); the statuses
    keep saying which is over."""
    quota = over_quota = 0
    for rule, status in zip(rules, statuses, strict=True):
        if rule is not None and rule.unlimited:
            continue
        over = status.code == _OVER_LIMIT
        if everywhere or (rule is not None and rule.quota_mode):
            quota += 1
            over_quota += over
        elif over:
            return _OVER_LIMIT
    return _OVER_LIMIT if quota and quota == over_quota else _OK


def headline_of(decisions: Sequence[Decision]) -> Decision | None:
    """The decision the ``RateLimit`` headers describe: a denial with the longest wait, else
    the store decision with the fewest units left; None when the store decided nothing."""
    exact = [d for d in decisions if not d.degraded]
    if not exact:
        return None
    denied = [d for d in exact if not d.allowed]
    if denied:
        return max(denied, key=lambda d: d.retry_after or 0.0)
    return min(exact, key=lambda d: d.remaining)


# --- the decider -------------------------------------------------------------------------

#: Upstream's LIMIT_LIMIT_HEADER, LIMIT_REMAINING_HEADER and LIMIT_RESET_HEADER defaults.
DEFAULT_LIMIT_HEADERS = ("RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset")

_OK = RateLimitResponse.OK
_OVER_LIMIT = RateLimitResponse.OVER_LIMIT
#: Descriptors of one request asked of the store together (reserved, hit or cancelled): one
#: batched round trip of this many calls takes well under a millisecond on a healthy store (far
#: below the 20 ms timeout), so a request of thousands is a series of quick rounds.
_ROUND = 64
#: How long after its token's own expiry a settled token stays marked in the store: every
#: reader accepts a token until its expiry plus ``CLOCK_SLACK`` on its own clock, so the mark,
#: set on another host's clock, outlives that by the slack again.
_MARK_SLACK = 2 * CLOCK_SLACK
#: The policy name the settled tokens' marks are kept under (one gcra key per nonce).
_SETTLED = rule_policy_name("s", "settled")
#: Distinct mark lifetimes (whole seconds) whose Policy is kept for reuse.
_MARKS_KEPT = 4096


class _Job:
    """One descriptor to decide on the store."""

    __slots__ = ("entries", "hits", "identity", "index", "override", "own", "reservation", "rule")

    def __init__(self, index: int, rule: LimitRule, identity: str, hits: int, own: bool) -> None:
        self.index = index
        self.rule = rule
        self.identity = identity
        self.hits = hits  # 0: a peek
        self.own = own  # a rule of the configuration, not a request's override
        self.entries: list[tuple[str, str]] = []
        self.override: tuple[int, str] | None = None
        self.reservation: AsyncReservation | None = None  # one held, when reserving


class Decider:
    """Decides ``RateLimitRequest`` messages on ``limiter`` under ``config``.

    ``config`` may be replaced at any time (a reload): a call reads it once, at its start, so a
    request in flight finishes under the configuration it began with. ``response_headers``
    adds the IETF ``RateLimit`` and ``RateLimit-Policy`` fields (and ``Retry-After`` on a
    denial) to ``response_headers_to_add``. ``tokens`` signs and reads reservation tokens (by
    default under a random key: only this Decider can read them).

    Upstream's wire behaviour, each an option: ``exact_durations`` sends
    ``duration_until_reset`` to the nanosecond instead of upstream's whole seconds;
    ``shadow_mode`` (upstream's ``SHADOW_MODE``) answers OK overall whatever the descriptors'
    statuses; ``dynamic_metadata`` (upstream's ``RESPONSE_DYNAMIC_METADATA``) fills the
    response's ``dynamic_metadata``; ``charge_over_limit`` counts every rule's denied hits, as
    upstream does by default; ``quota_mode`` (upstream's ``QUOTA_MODE``) puts every descriptor in
    quota mode, as a rule's ``quota_mode`` does its own. ``clock`` (seconds since the epoch)
    gives the time to a fixed window's end when the store has not said it (nothing counted
    yet). ``limit_headers``
    (upstream's ``LIMIT_RESPONSE_HEADERS_ENABLED``) names the limit, remaining and reset
    headers added to ``response_headers_to_add`` (``_upstream.limit_headers``).
    """

    def __init__(
        self,
        limiter: AsyncLimiter,
        config: ServiceConfig,
        *,
        metrics: ServiceMetrics | None = None,
        response_headers: bool = False,
        tokens: Tokens | None = None,
        exact_durations: bool = False,
        shadow_mode: bool = False,
        dynamic_metadata: bool = False,
        charge_over_limit: bool = False,
        quota_mode: bool = False,
        clock: Callable[[], float] = time.time,
        limit_headers: tuple[str, str, str] | None = None,
    ) -> None:
        self.limiter = limiter
        self.config = config
        self.metrics = metrics
        self.response_headers = response_headers
        self.exact_durations = exact_durations
        self.shadow_mode = shadow_mode
        self.dynamic_metadata = dynamic_metadata
        self.charge_over_limit = charge_over_limit
        self.quota_mode = quota_mode
        self.clock = clock
        self.limit_headers = limit_headers
        self.tokens = tokens if tokens is not None else Tokens(secrets.token_bytes(32))
        # A token's nonce is hit once under _SETTLED, one unit per the seconds left until its
        # expiry plus _MARK_SLACK: a second settle of it is denied until then. Its lifetime in
        # whole seconds -> the Policy (the key is the name's and the nonce's, whatever the rate)
        self._marks: dict[int, Policy] = {}
        # id(rule) -> (rule, its current_limit message), for the configuration in force
        self._limits: dict[int, tuple[LimitRule, RateLimitResponse.RateLimit]] = {}
        self._limits_of: ServiceConfig | None = None

    async def should_rate_limit(self, request: RateLimitRequest) -> RateLimitResponse:
        """The response to ``request``. Raises :class:`BadRequest` for a request that cannot
        be decided and ``StorageError`` when the store failed and the failure mode is
        ``"raise"``."""
        response, _ = await self._answer(request, reserving=False)
        return response

    async def reserve(self, request: RateLimitRequest) -> tuple[RateLimitResponse, dict[int, str]]:
        """:meth:`should_rate_limit`, with each descriptor's hits reserved rather than hit: the
        response and a token per descriptor (by its index) whose reservation is held. A request
        refused as a whole (OVER_LIMIT) gets no token: the reservations it made are cancelled,
        and their statuses tell what is left after that. A peek (hits_addend 0), a descriptor
        without a limit and one that a failure mode admitted without the store reserve
        nothing the store holds; the last still gets a token (settling it charges the actual
        cost)."""
        response, jobs = await self._answer(request, reserving=True)
        if response.overall_code == _OVER_LIMIT:
            await self._cancel(jobs, response)
            return response, {}
        tokens: dict[int, str] = {}
        for job in jobs:
            reservation, policy = job.reservation, job.rule.policy
            if reservation is not None and policy is not None:
                tokens[job.index] = self.tokens.issue(
                    request.domain,
                    job.entries,
                    job.override,
                    policy.name,
                    job.hits,
                    reservation.stamp,
                )
        return response, tokens

    async def settle(self, token: str, actual: int | None) -> RateLimitResponse:
        """Settle the reservation ``token`` holds for ``actual`` (None: cancel it); a response
        with its descriptor's status as it stands after. Raises :class:`TokenRefused` for a
        token that is malformed, forged, expired, settled already, or whose rule is no longer
        configured (or now another rule), and ``StorageError`` as :meth:`should_rate_limit`.
        A token is marked used before its settle is sent: when the store fails, it is not
        settled twice. A mark the store did not answer itself (a degraded decision: the failure
        mode's, the breaker's) raises ``StorageError``: nothing is settled, whatever the failure
        mode, since the service cannot tell whether the token was settled already."""
        held = self.tokens.read(token)
        entries = list(held.entries)
        try:
            (rule,) = self.config.resolve(
                held.domain, [entries], overrides=None if held.limit is None else [held.limit]
            )
        except ConfigError:
            rule = None
        policy = None if rule is None else rule.policy
        if rule is None or policy is None or policy.name != held.policy:
            raise TokenRefused(
                410,
                f"the rule this reservation was made under (domain {held.domain!r}) is no longer "
                "in the configuration: its estimate stays counted",
            )
        try:
            marked = await self.limiter.hit(self._mark(held), held.nonce)
        except StorageError:
            if self.metrics is not None:
                self.metrics.unavailable()
            raise
        if marked.degraded:
            if self.metrics is not None:
                self.metrics.unavailable()
            raise StorageUnavailable(
                "could not mark the reservation settled in the store "
                f"({marked.reason or 'degraded'}): nothing was settled; retry later"
            )
        if not marked.allowed:
            raise TokenRefused(409, "this reservation was settled or cancelled already")
        identity = rule.identity_for(entries)
        reservation = self.limiter.resume(policy, identity, held.estimate, held.stamp)
        if actual is not None:
            decision = await reservation.settle(actual)
        else:
            cancelled = await reservation.cancel()
            # nothing to refund (a failure mode admitted it): where the descriptor stands
            decision = cancelled or await self.limiter.peek(policy, identity, 1)
        response = RateLimitResponse(overall_code=_OK)
        job = _Job(0, rule, identity, 1, held.limit is None)
        job.entries = entries
        if self._status(held.domain, response.statuses.add(code=_OK), job, decision, False):
            response.overall_code = _OVER_LIMIT
        return response

    def _mark(self, held: Held) -> Policy:
        """The policy ``held``'s nonce is marked settled under: one unit per the whole seconds
        from now to the token's own expiry plus ``_MARK_SLACK`` (at least 1)."""
        seconds = max(1, math.ceil(held.expires + _MARK_SLACK - self.tokens.clock()))
        policy = self._marks.get(seconds)
        if policy is None:
            if len(self._marks) >= _MARKS_KEPT:
                self._marks.clear()
            policy = self._marks[seconds] = Policy(_SETTLED, Rate(1, seconds), "gcra")
        return policy

    async def _cancel(self, jobs: list[_Job], response: RateLimitResponse) -> None:
        """Cancel the reservations of ``jobs`` (a request refused as a whole, or one that
        failed), ``_ROUND`` at a time; their statuses get what is left after. Cancels the
        store fails (or a failure mode answers) are logged in one line for the request: their
        estimates stay counted until their windows end."""
        held = [(job, job.reservation) for job in jobs if job.reservation is not None]
        failed = 0
        first: BaseException | str | None = None
        problem: BaseException | None = None
        for start in range(0, len(held), _ROUND):
            batch = held[start : start + _ROUND]
            results = await asyncio.gather(
                *(reservation.cancel() for _, reservation in batch), return_exceptions=True
            )
            for (job, _), result in zip(batch, results, strict=True):
                if isinstance(result, StorageError):
                    failed += 1
                    first = first if first is not None else result
                elif isinstance(result, BaseException):
                    failed += 1
                    problem = problem if problem is not None else result
                elif result is not None and result.degraded:
                    failed += 1
                    first = first if first is not None else f"{result.reason or 'degraded'}"
                elif result is not None:
                    response.statuses[job.index].limit_remaining = max(0, result.remaining)
        if failed:
            log.warning(
                "could not cancel %d of the %d reservations of a refused request of %d "
                "descriptors (first failure: %s); their estimates stay counted until their "
                "windows end",
                failed,
                len(held),
                len(response.statuses),
                first if first is not None else problem,
            )
        if problem is not None:
            raise problem

    async def _answer(
        self, request: RateLimitRequest, *, reserving: bool
    ) -> tuple[RateLimitResponse, list[_Job]]:
        """The response to ``request`` and the jobs the store decided; with ``reserving``,
        each job holds its reservation, when admitted (all cancelled when the store failed)."""
        config = self.config
        if config is not self._limits_of:  # a reload: the cached current_limits are its
            self._limits = {}
            self._limits_of = config
        domain = request.domain
        if not domain:
            raise UpstreamRefusal("rate limit domain must not be empty")
        descriptors = list(request.descriptors)
        if not descriptors:
            raise UpstreamRefusal("rate limit descriptor list must not be empty")
        entries = [entries_of(descriptor) for descriptor in descriptors]
        overrides: list[tuple[int, str] | None] | None = None
        for descriptor in descriptors:
            if descriptor.HasField("limit"):
                overrides = [override_of(descriptor) for descriptor in descriptors]
                break
        try:
            rules = config.resolve(domain, entries, overrides=overrides)
        except ConfigError as exc:  # an override the algorithm refuses
            raise BadRequest(f"a descriptor's limit override is invalid: {exc}") from None
        if self.metrics is not None and domain not in config.domains:
            self.metrics.domain_not_found(domain, len(descriptors))
        response = RateLimitResponse(overall_code=_OK)
        add = response.statuses.add
        statuses = [add(code=_OK) for _ in descriptors]
        jobs = self._jobs(request, descriptors, entries, overrides, rules, response, statuses)
        if not jobs:
            if self.limit_headers is not None:
                response.response_headers_to_add.extend(limit_headers(statuses, self.limit_headers))
            return self._finish(request, rules, response), jobs
        try:
            if len(jobs) == 1:
                decisions = [await self._decide(jobs[0], reserving)]
            else:
                decisions = await self._decide_all(jobs, reserving)
        except BaseException:
            if reserving:  # nothing is held for a request that failed
                await self._cancel(jobs, response)
            raise
        for job, decision in zip(jobs, decisions, strict=True):
            if self._status(domain, statuses[job.index], job, decision):
                response.overall_code = _OVER_LIMIT
        if self.response_headers:
            headline = headline_of(decisions)
            if headline is not None:
                response.response_headers_to_add.extend(
                    HeaderValue(key=name, value=value) for name, value in response_headers(headline)
                )
        if self.limit_headers is not None:
            invented = frozenset(
                job.index for job, d in zip(jobs, decisions, strict=True) if d.degraded
            )
            response.response_headers_to_add.extend(
                limit_headers(statuses, self.limit_headers, invented)
            )
        return self._finish(request, rules, response), jobs

    def _finish(
        self,
        request: RateLimitRequest,
        rules: Sequence[LimitRule | None],
        response: RateLimitResponse,
    ) -> RateLimitResponse:
        """The options applied to the whole response: quota mode, dynamic metadata, global
        shadow mode."""
        if self.quota_mode or any(rule is not None and rule.quota_mode for rule in rules):
            response.overall_code = quota_overall(rules, response.statuses, self.quota_mode)
        if self.dynamic_metadata:
            statuses = response.statuses
            passed = [  # as upstream: an unlimited descriptor's metadata is not sent
                rule
                for rule, status in zip(rules, statuses, strict=True)
                if status.code != _OVER_LIMIT and (rule is None or not rule.unlimited)
            ]
            response.dynamic_metadata.update(dynamic_metadata(request, passed))
        if self.shadow_mode and response.overall_code == _OVER_LIMIT:
            # upstream's SHADOW_MODE: the statuses still say which descriptor is over
            response.overall_code = _OK
            if self.metrics is not None:
                self.metrics.global_shadow_mode()
        return response

    def _jobs(
        self,
        request: RateLimitRequest,
        descriptors: list[RateLimitDescriptor],
        entries: list[list[tuple[str, str]]],
        overrides: list[tuple[int, str] | None] | None,
        rules: list[LimitRule | None],
        response: RateLimitResponse,
        statuses: list[RateLimitResponse.DescriptorStatus],
    ) -> list[_Job]:
        """Answer the descriptors the store need not decide; the others to decide."""
        domain = request.domain
        jobs: list[_Job] = []
        for index, rule in enumerate(rules):
            if rule is None:
                continue  # no limit applies: OK, no current_limit, remaining 0 (as upstream)
            status = statuses[index]
            if rule.unlimited:
                status.limit_remaining = UNLIMITED_REMAINING
                continue
            override = None if overrides is None else overrides[index]
            own = override is None  # a rule of the configuration
            if rule.policy is None:  # requests_per_unit 0: upstream denies every request
                status.current_limit.CopyFrom(self._limit(rule, None, own))
                # upstream says when the unit's window ends
                until = until_window_end(rule.window, self.clock())
                set_duration(status, until, self.exact_durations)
                if not rule.shadow_mode:
                    status.code = _OVER_LIMIT
                    response.overall_code = _OVER_LIMIT
                if self.metrics is not None:
                    hits = hits_of(request, descriptors[index])
                    self.metrics.denied_all(domain, rule.stat_key_for(entries[index]), rule, hits)
                continue
            hits = hits_of(request, descriptors[index])
            job = _Job(index, rule, rule.identity_for(entries[index]), min(hits, MAX_INT), own)
            job.entries = entries[index]
            job.override = override
            jobs.append(job)
        return jobs

    def _limit(self, rule: LimitRule, rate: Rate | None, own: bool) -> RateLimitResponse.RateLimit:
        """``rule``'s ``current_limit`` message; built once per rule of the configuration
        that has one limit (it never changes), each time for an override or several limits."""
        if not own or len(rule.limits) > 1:
            return limit_message(rule, rate)
        cached = self._limits.get(id(rule))
        if cached is None or cached[0] is not rule:
            cached = self._limits[id(rule)] = (rule, limit_message(rule, None))
        return cached[1]

    def _status(
        self,
        domain: str,
        status: RateLimitResponse.DescriptorStatus,
        job: _Job,
        decision: Decision,
        counted: bool = True,
    ) -> bool:
        """Fill in one descriptor's status; True when it is over its limit. A peek (0 hits) is
        never over: it consumes nothing, as upstream's hits_addend 0 adds nothing. A degraded
        decision's numbers are the failure mode's: only its code and wait are reported.
        ``counted``: a decision of the request (not a settle's), for the metrics."""
        rule = job.rule
        status.current_limit.CopyFrom(self._limit(rule, decision.rate, job.own))
        over = not decision.allowed and job.hits > 0
        exact = self.exact_durations
        if decision.degraded:
            if over:
                status.code = _OVER_LIMIT
                if decision.retry_after is not None and math.isfinite(decision.retry_after):
                    set_duration(status, decision.retry_after, exact)
        else:
            status.limit_remaining = 0 if over else max(0, decision.remaining)
            until = decision.reset_after
            if until <= 0 and rule.policy is not None and rule.policy.algorithm == "fixed_window":
                # nothing counted in the window yet (a peek): it still ends on the clock
                until = until_window_end(decision.rate.period_ms / 1000, self.clock())
            set_duration(status, until, exact)
            if over and not rule.shadow_mode:
                status.code = _OVER_LIMIT
        if counted and self.metrics is not None:
            stat_key = rule.stat_key_for(job.entries)
            self.metrics.decided(domain, stat_key, rule, decision, over, job.hits)
        return status.code == _OVER_LIMIT

    async def _decide_all(self, jobs: list[_Job], reserving: bool) -> list[Decision]:
        """The jobs' decisions, asked at most ``_ROUND`` at a time: a request of thousands of
        descriptors goes to the store in bounded rounds, each as quick as a small request's,
        so it is never a slow call (which the breaker would hold against the store, and so
        against every other caller), and other requests' calls go between its rounds."""
        decided: list[Decision] = []
        for start in range(0, len(jobs), _ROUND):
            results = await asyncio.gather(
                *(self._decide(job, reserving) for job in jobs[start : start + _ROUND]),
                return_exceptions=True,
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
                decided.append(result)
        return decided

    async def _decide(self, job: _Job, reserving: bool) -> Decision:
        policy = job.rule.policy
        assert policy is not None  # unlimited rules are answered without the store
        try:
            if job.hits == 0:
                # A peek (per-descriptor hits_addend 0): the state now, nothing consumed.
                return await self.limiter.peek(policy, job.identity, 1)
            if reserving:
                reservation = await self.limiter.reserve(policy, job.identity, job.hits)
                if reservation.held:
                    job.reservation = reservation
                return reservation.decision
            decision = await self.limiter.hit(policy, job.identity, job.hits)
            if decision.allowed or decision.degraded:
                return decision
            if job.rule.charge_over_limit or self.charge_over_limit:
                # Counted although denied, as upstream counts (and as a response-phase cost,
                # Envoy's apply_on_stream_done, must be: the work is done). The answer stays
                # the hit's: over the limit, with where the descriptor stands after the charge.
                charged = await self.limiter.charge(policy, job.identity, job.hits)
                if charged.allowed:  # refunds in between made room for a next unit
                    return replace(charged, allowed=False, retry_after=decision.retry_after)
                return charged
            return decision
        except StorageError:
            if self.metrics is not None:
                self.metrics.unavailable()
            raise
