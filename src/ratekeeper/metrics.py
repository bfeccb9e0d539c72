"""Metrics hooks, and an adapter for Prometheus (``pip install 'ratekeeper[prometheus]'``).

Pass ``metrics=`` to a limiter: an object with the three methods of :class:`Metrics` (subclass it
and override what you need). The limiter calls them after each decision, each store call and
each breaker transition; nothing inside the algorithms is timed.
"""

from __future__ import annotations

from typing import Any

from ._breaker import BreakerState
from ._decision import Decision

__all__ = ["Metrics", "PrometheusMetrics"]


class Metrics:
    """The hook interface; every method does nothing by default."""

    def decision(self, decision: Decision) -> None:
        """After every decision: ``decision.degraded`` and ``decision.reason`` say how it was
        made (``"deny_cache"`` for a local answer to a recent exact denial)."""

    def store_call(self, seconds: float, ok: bool) -> None:
        """After every store call, with its wall time and whether it succeeded."""

    def breaker_transition(self, old: BreakerState, new: BreakerState) -> None:
        """When the circuit breaker changes state."""


#: Histogram buckets for store latency, in seconds: 100 us to 1 s.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

_STATE_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class PrometheusMetrics(Metrics):
    """Exports ratekeeper's metrics with ``prometheus-client``.

    * ``<ns>_decisions_total{policy, outcome}``: outcome ``allowed`` or ``denied``
    * ``<ns>_degraded_decisions_total{policy, reason}``
    * ``<ns>_deny_cache_hits_total{policy}``
    * ``<ns>_store_latency_seconds{outcome}``: a histogram; outcome ``ok`` or ``error``
    * ``<ns>_breaker_state``: 0 closed, 1 half-open, 2 open
    * ``<ns>_breaker_transitions_total{from_state, to_state}``
    """

    def __init__(self, registry: Any = None, namespace: str = "ratekeeper") -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:  # pragma: no cover - only without the extra
            from ._errors import ConfigError

            raise ConfigError(
                "PrometheusMetrics needs prometheus-client: pip install 'ratekeeper[prometheus]'"
            ) from exc
        if registry is None:
            registry = prom.REGISTRY
        self.decisions = prom.Counter(
            "decisions", "Rate limit decisions.", ["policy", "outcome"],
            namespace=namespace, registry=registry,
        )  # fmt: skip
        self.degraded = prom.Counter(
            "degraded_decisions", "Decisions made by the failure mode, not the store.",
            ["policy", "reason"], namespace=namespace, registry=registry,
        )  # fmt: skip
        self.deny_cache_hits = prom.Counter(
            "deny_cache_hits", "Hits answered by the local cache of exact denials.",
            ["policy"], namespace=namespace, registry=registry,
        )  # fmt: skip
        self.latency = prom.Histogram(
            "store_latency_seconds", "Wall time of store calls.", ["outcome"],
            buckets=LATENCY_BUCKETS, namespace=namespace, registry=registry,
        )  # fmt: skip
        self.breaker_state = prom.Gauge(
            "breaker_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            namespace=namespace, registry=registry,
        )  # fmt: skip
        self.breaker_transitions = prom.Counter(
            "breaker_transitions", "Circuit breaker transitions.", ["from_state", "to_state"],
            namespace=namespace, registry=registry,
        )  # fmt: skip

    def decision(self, decision: Decision) -> None:
        self.decisions.labels(decision.policy, "allowed" if decision.allowed else "denied").inc()
        if decision.degraded:
            self.degraded.labels(decision.policy, decision.reason or "unknown").inc()
        elif decision.reason == "deny_cache":
            self.deny_cache_hits.labels(decision.policy).inc()

    def store_call(self, seconds: float, ok: bool) -> None:
        self.latency.labels("ok" if ok else "error").observe(seconds)

    def breaker_transition(self, old: BreakerState, new: BreakerState) -> None:
        self.breaker_state.set(_STATE_VALUES[new])
        self.breaker_transitions.labels(old.value, new.value).inc()
