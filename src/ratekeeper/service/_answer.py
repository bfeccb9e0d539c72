"""The pieces of a ``ShouldRateLimit`` answer as envoyproxy/ratelimit shapes them, pure: the
requests it refuses, a descriptor's entries, override and hits, ``duration_until_reset`` in
whole seconds, ``current_limit``, the overall code under quota mode, the decision the
``RateLimit`` headers describe and the response's ``dynamic_metadata``. :mod:`._decide` puts
them together around the store's decisions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._model.decision import Decision
from .._model.rates import Rate
from ._config import LimitRule
from .rls_pb2 import RateLimitDescriptor, RateLimitRequest, RateLimitResponse

__all__ = [
    "UNLIMITED_REMAINING",
    "BadRequest",
    "UpstreamRefusal",
    "dynamic_metadata",
    "entries_of",
    "headline_of",
    "hits_of",
    "limit_message",
    "override_of",
    "quota_overall",
    "set_duration",
    "until_window_end",
]

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
