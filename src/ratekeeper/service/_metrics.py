"""The service's Prometheus metrics, on a registry of its own, served at ``GET /metrics``.

The limiter's instruments (store latency, breaker state and transitions, degraded decisions by
policy and reason, deny-cache hits) come from :class:`ratekeeper.metrics.PrometheusMetrics` on
the same registry; this module adds what only the service knows:

* ``ratekeeper_service_decisions_total{domain, descriptor, outcome}``: one per decided
  descriptor; ``descriptor`` is the rule's stat key (upstream's, with ``detailed_metric``
  naming the values), ``outcome`` ``ok``, ``over_limit``, ``shadow_mode`` (over the limit,
  answered OK) or ``degraded_ok`` / ``degraded_over_limit`` (the failure mode decided)
  (``requests_per_unit: 0`` rules, which deny without the store, are not counted here)
* ``ratekeeper_service_unavailable_total``: descriptors the store could not decide under
  ``failure_mode="raise"`` (the RPC failed with UNAVAILABLE)
* ``ratekeeper_service_config_reloads_total{outcome}``: ``ok`` or ``error``
* ``ratekeeper_service_config_loaded_timestamp_seconds``: when the configuration in force loaded
* ``ratekeeper_service_worker_info{pid}``: the process that answered the scrape
"""

from __future__ import annotations

import os
import time
from typing import Any

from .._decision import Decision
from ..metrics import PrometheusMetrics
from ._config import LimitRule

__all__ = ["ServiceMetrics"]

#: Labelled counters kept at hand (detailed_metric makes one per request value: bounded).
_MAX_CHILDREN = 10_000


class ServiceMetrics:
    """The service's counters and the limiter's hook (``limiter_metrics``), on ``registry``
    (a new ``prometheus_client.CollectorRegistry`` by default)."""

    def __init__(self, registry: Any = None) -> None:
        import prometheus_client as prom

        if registry is None:
            registry = prom.CollectorRegistry()
        self.registry = registry
        self.limiter_metrics = PrometheusMetrics(registry=registry)
        options: dict[str, Any] = {"namespace": "ratekeeper_service", "registry": registry}
        self.decisions = prom.Counter(
            "decisions",
            "Descriptors decided, by domain, descriptor (stat key) and outcome.",
            ("domain", "descriptor", "outcome"),
            **options,
        )
        self.unavailable_total = prom.Counter(
            "unavailable",
            "Descriptors the store could not decide under failure_mode=raise.",
            **options,
        )
        self.reloads = prom.Counter(
            "config_reloads", "Configuration reloads, by outcome.", ("outcome",), **options
        )
        self._children: dict[tuple[str, str, str], Any] = {}
        # Which worker answered a scrape (with --workers, the kernel picks one per connection).
        prom.Info("worker", "The worker process serving this scrape.", **options).info(
            {"pid": str(os.getpid())}
        )
        self.loaded_at = prom.Gauge(
            "config_loaded_timestamp_seconds",
            "When the configuration in force was loaded (Unix time).",
            **options,
        )

    def decided(
        self, domain: str, stat_key: str, rule: LimitRule, decision: Decision, over: bool
    ) -> None:
        if decision.degraded:
            outcome = "degraded_over_limit" if over else "degraded_ok"
        elif over:
            outcome = "shadow_mode" if rule.shadow_mode else "over_limit"
        else:
            outcome = "ok"
        labels = (domain, stat_key, outcome)
        child = self._children.get(labels)
        if child is None:  # labels() costs a lock and a tuple walk: once per label set
            if len(self._children) >= _MAX_CHILDREN:
                self._children.clear()
            child = self._children[labels] = self.decisions.labels(*labels)
        child.inc()

    def unavailable(self) -> None:
        self.unavailable_total.inc()

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels("ok" if ok else "error").inc()
        if ok:
            self.loaded_at.set(time.time())

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        import prometheus_client as prom

        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
