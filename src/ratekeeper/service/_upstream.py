"""What envoyproxy/ratelimit shows of its decisions, as it shows them, pure: its stats
accounting (``near_limit`` and ``NEAR_LIMIT_RATIO``, its ``src/limiter/base_limiter.go``), the
Prometheus names its sink gives those stats, and its ``LIMIT_RESPONSE_HEADERS_ENABLED`` headers.

**Names.** :func:`upstream_families` computes upstream's metric families from ours (collected
from ``_metrics``): each is the name and labels upstream's Prometheus sink (statsd_exporter's
mapper with its ``src/stats/prom/default_mapper.yaml``, which agrees with
``examples/prom-statsd-exporter/conf.yaml`` wherever that maps) gives its statsd stat:
``ratelimit_service_rate_limit_{total_hits,within_limit,near_limit,over_limit,shadow_mode}``
``{domain, key1[, key2]}`` from the stat key's first components, a stat it leaves unmapped
(``<domain>.domain_not_found``) under statsd_exporter's escaped name,
``ratelimit_service_config_load_{success,error}``,
``ratelimit_service_should_rate_limit_error{err_type}`` (``redis_error``, ``service_error``),
``ratelimit_service_total_requests{grpc_method}`` and the histogram
``ratelimit_service_response_time_seconds{grpc_method}`` (gRPC calls, as upstream's
interceptor counts them). They are exposed untyped: prometheus-client appends ``_total`` to a
counter's name, which would change the name upstream's dashboards query.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from .rls_pb2 import HeaderValue, RateLimitResponse

__all__ = [
    "LATENCY_BUCKETS",
    "NEAR_LIMIT_RATIO",
    "hit_counts",
    "limit_headers",
    "near_limit_threshold",
    "sanitize_stat_name",
    "upstream_families",
    "upstream_series",
]

#: Upstream's default ``NEAR_LIMIT_RATIO``.
NEAR_LIMIT_RATIO = 0.8
#: Go's ``prometheus.DefBuckets``: the buckets statsd_exporter gives a timer mapped to a
#: histogram (upstream's ``response_time``), so our latency histogram is upstream's too.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Upstream's per-descriptor stats.
_PER_DESCRIPTOR = frozenset(
    ("total_hits", "within_limit", "near_limit", "over_limit", "shadow_mode")
)
#: Our error kinds that upstream counts as ``should_rate_limit`` errors (gRPC and /json).
_UPSTREAM_ERRORS = {"store": "redis_error", "refused": "service_error"}
_SHOULD_RATE_LIMIT = ("ShouldRateLimit", "/json")
_GRPC_METHOD = "ShouldRateLimit"
#: Upstream's MaxUint32, where its search for the status closest to its limit starts.
_MAX_UINT32 = 2**32 - 1

_IPV4 = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}")
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")


# -- upstream's accounting (pure) --------------------------------------------------------------


def _float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def near_limit_threshold(limit: int, ratio: float) -> int:
    """Upstream's near-limit threshold: ``floor(float32(limit) * ratio)``, in float32 as its
    Go code computes it (the exact product of two float32 values fits a double, so rounding
    it to float32 once is Go's float32 multiplication)."""
    return math.floor(_float32(_float32(float(limit)) * _float32(ratio)))


def hit_counts(
    limit: int, used_before: int, hits: int, near: int, shadow: bool
) -> tuple[int, int, int, int]:
    """``(within_limit, near_limit, over_limit, shadow_mode)`` for ``hits`` landing on a
    counter at ``used_before`` of ``limit``, as upstream's base limiter counts them: over the
    limit, only the hits past it are ``over_limit`` (all of them when it was full already) and
    those between ``near`` (:func:`near_limit_threshold`) and the limit ``near_limit``; within
    it, every hit is ``within_limit`` and those past ``near`` also ``near_limit``;
    ``shadow_mode`` repeats ``over_limit`` for a rule in shadow mode."""
    after = used_before + hits
    if after > limit:
        if used_before >= limit:
            return 0, 0, hits, hits if shadow else 0
        over = after - limit
        return 0, limit - max(near, used_before), over, over if shadow else 0
    if after <= near:
        return hits, 0, 0, 0
    return hits, hits if used_before >= near else after - near, 0, 0


# -- upstream's names (pure) -------------------------------------------------------------------


def sanitize_stat_name(name: str) -> str:
    """Upstream's ``SanitizeStatName``: ``:`` and ``|`` to ``_`` (statsd's separators), and
    the dots of an IPv4 address to ``_``."""
    name = name.replace(":", "_").replace("|", "_")
    return _IPV4.sub(lambda found: found.group(0).replace(".", "_"), name)


def _escape(name: str) -> str:
    """statsd_exporter's name for a stat no mapping matches: every character other than a
    letter, digit or ``_`` becomes ``_`` (and a leading digit gets a ``_`` before it)."""
    escaped = _NOT_NAME.sub("_", name)
    return "_" + escaped if escaped[:1].isdigit() else escaped


def upstream_series(stat: str) -> tuple[str, dict[str, str]]:
    """The Prometheus name and labels upstream's Prometheus sink (statsd_exporter's mapper with
    its ``default_mapper.yaml``) gives the counter ``stat``, a statsd name such as
    ``ratelimit.service.rate_limit.api.user_bob.over_limit``."""
    parts = stat.split(".")
    if parts[:3] == ["ratelimit", "service", "rate_limit"]:
        if len(parts) >= 6 and parts[-1] in _PER_DESCRIPTOR:
            labels = {"domain": parts[3], "key1": parts[4]}
            if len(parts) >= 7:  # deeper components fold into key2's series
                labels["key2"] = parts[5]
            return f"ratelimit_service_rate_limit_{parts[-1]}", labels
    elif parts[:4] == ["ratelimit", "service", "call", "should_rate_limit"] and len(parts) == 5:
        return "ratelimit_service_should_rate_limit_error", {"err_type": parts[4]}
    elif parts[0] == "ratelimit_server" and len(parts) == 3 and parts[2] == "total_requests":
        return "ratelimit_service_total_requests", {"grpc_method": parts[1]}
    return _escape(stat), {}


class _Families:
    """Upstream's families as they are built: name -> (help, type, {sample key: value})."""

    def __init__(self) -> None:
        self.families: dict[str, tuple[str, str, dict[tuple[str, tuple[Any, ...]], float]]] = {}

    def add(
        self, name: str, labels: dict[str, str], value: float, sample: str = "", kind: str = ""
    ) -> None:
        doc = f"envoyproxy/ratelimit's {name}, as its Prometheus sink names it."
        family = self.families.setdefault(name, (doc, kind or "unknown", {}))
        key = (sample or name, tuple(sorted(labels.items())))
        family[2][key] = family[2].get(key, 0.0) + value

    def counter(self, stat: str, value: float) -> None:
        name, labels = upstream_series(stat)
        self.add(name, labels, value)

    def metrics(self) -> list[Any]:
        from prometheus_client.metrics_core import Metric

        out = []
        for name in sorted(self.families):
            doc, kind, samples = self.families[name]
            metric = Metric(name, doc, kind)
            for (sample, labels), value in samples.items():
                metric.add_sample(sample, dict(labels), value)
            out.append(metric)
        return out


def upstream_families(families: Iterable[Any]) -> list[Any]:
    """Upstream's metric families, computed from ours (collected ``families``): each sample of
    ours lands on the name and labels upstream's Prometheus sink gives the same count."""
    out = _Families()
    for family in families:
        name = family.name
        for sample in family.samples:
            labels = sample.labels
            if sample.name.endswith("_created"):
                continue
            if name == "ratekeeper_service_hits":
                key = sanitize_stat_name(labels["descriptor"])
                out.counter(f"ratelimit.service.rate_limit.{key}.{labels['kind']}", sample.value)
            elif name == "ratekeeper_service_domain_not_found":
                domain = sanitize_stat_name(labels["domain"])
                out.counter(f"ratelimit.service.rate_limit.{domain}.domain_not_found", sample.value)
            elif name == "ratekeeper_service_global_shadow_mode":
                out.counter("ratelimit.service.global_shadow_mode", sample.value)
            elif name == "ratekeeper_service_config_reloads":
                stat = "success" if labels["outcome"] == "ok" else "error"
                out.counter(f"ratelimit.service.config_load_{stat}", sample.value)
            elif name == "ratekeeper_service_request_errors":
                err_type = _UPSTREAM_ERRORS.get(labels["error"])
                if err_type is not None and labels["method"] in _SHOULD_RATE_LIMIT:
                    stat = f"ratelimit.service.call.should_rate_limit.{err_type}"
                    out.counter(stat, sample.value)
            elif name == "ratekeeper_service_request_duration_seconds":
                method = labels["method"]
                if method != _GRPC_METHOD:
                    continue  # upstream's interceptor times gRPC calls only
                timer = "ratelimit_service_response_time_seconds"
                suffix = sample.name[len(name) :]
                shown = {key: value for key, value in labels.items() if key != "method"}
                shown["grpc_method"] = method
                out.add(timer, shown, sample.value, timer + suffix, "histogram")
                if suffix == "_count":
                    out.counter(f"ratelimit_server.{method}.total_requests", sample.value)
    return out.metrics()


# -- upstream's LIMIT_RESPONSE_HEADERS_ENABLED headers (pure) ------------------------------------


def limit_headers(
    statuses: Sequence[RateLimitResponse.DescriptorStatus],
    names: tuple[str, str, str],
    skip: frozenset[int] = frozenset(),
) -> list[HeaderValue]:
    """Upstream's ``LIMIT_RESPONSE_HEADERS_ENABLED`` headers, named ``names``: the limit, the
    remaining units and the seconds to reset of the status it picks: the first with a
    ``current_limit`` and the fewest units left, unless a descriptor is over its limit (then
    the last such). The reset is the status's ``duration_until_reset`` in whole seconds
    (rounded up), as Envoy's own ``x-ratelimit-reset`` reads it. ``skip``: statuses whose
    numbers a failure mode invented (no headers when every one is skipped)."""
    chosen = None
    fewest = _MAX_UINT32
    for index, status in enumerate(statuses):
        if index in skip:
            continue
        if status.code == RateLimitResponse.OVER_LIMIT:
            chosen, fewest = status, 0
        elif status.HasField("current_limit") and status.limit_remaining < fewest:
            chosen, fewest = status, status.limit_remaining
    if chosen is None:
        return []
    reset = chosen.duration_until_reset
    values = (
        chosen.current_limit.requests_per_unit,
        chosen.limit_remaining,
        reset.seconds + (1 if reset.nanos > 0 else 0),
    )
    return [
        HeaderValue(key=key, value=str(value)) for key, value in zip(names, values, strict=True)
    ]
