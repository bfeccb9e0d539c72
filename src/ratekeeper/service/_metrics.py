"""The service's Prometheus metrics, served at ``GET /metrics``: ours, and envoyproxy/ratelimit's
names beside them, in one view across ``--workers N``.

The limiter's instruments (store latency, breaker state and transitions, degraded decisions by
policy and reason, deny-cache hits) come from :class:`ratekeeper.metrics.PrometheusMetrics` on
the same registry; this module adds what only the service knows:

* ``ratekeeper_service_decisions_total{domain, descriptor, outcome}``: one per decided
  descriptor; ``descriptor`` is the rule's stat key (upstream's, with ``detailed_metric``
  naming the values), ``outcome`` ``ok``, ``over_limit``, ``shadow_mode`` (over the limit,
  answered OK) or ``degraded_ok`` / ``degraded_over_limit`` (the failure mode decided)
  (``requests_per_unit: 0`` rules, which deny without the store, are not counted here)
* ``ratekeeper_service_hits_total{domain, descriptor, kind}``: hits (``hits_addend`` units),
  counted as upstream's base limiter counts them (:func:`hit_counts`): ``kind`` is
  ``total_hits``, ``within_limit``, ``near_limit`` (past ``near_limit_ratio`` of the limit,
  upstream's ``NEAR_LIMIT_RATIO``), ``over_limit`` or ``shadow_mode``
* ``ratekeeper_service_domain_not_found_total{domain}``: descriptors asked of a domain no file
  defines (at most ``_MAX_DOMAINS`` names per worker, then ``(other)``: the name is the client's)
* ``ratekeeper_service_request_duration_seconds{method}``: each call's count and latency
  (``ShouldRateLimit`` over gRPC; ``/json``, ``/reserve``, ``/settle`` over HTTP)
* ``ratekeeper_service_request_errors_total{method, error}``: calls answered with an error:
  ``store`` (UNAVAILABLE, 503), ``refused`` (upstream's own refusals: no domain, no
  descriptors), ``bad_request`` (INVALID_ARGUMENT, 400), ``token`` (a refused reservation token)
* ``ratekeeper_service_unavailable_total``: descriptors the store could not decide under
  ``failure_mode="raise"`` (the RPC failed with UNAVAILABLE)
* ``ratekeeper_service_global_shadow_mode_total``: requests ``--shadow-mode`` answered OK
  although a descriptor was over its limit (upstream's ``global_shadow_mode``)
* ``ratekeeper_service_config_reloads_total{outcome}``: ``ok`` or ``error``
* ``ratekeeper_service_config_loaded_timestamp_seconds``: when the configuration in force loaded
* ``ratekeeper_service_worker_info{pid}``: the process that answered the scrape

**Upstream's names** are computed at scrape time from ours (``_upstream.upstream_families``):
nothing is counted twice.

**One view across workers**: ``serve`` with ``--workers N`` gives the workers a private
directory (:class:`WorkerMetricsDir`) as prometheus-client's ``PROMETHEUS_MULTIPROC_DIR``; each
worker's counters live there and a scrape, on whichever worker, sums them all
(``MultiProcessCollector``). Only ``worker_info`` is the answering worker's own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from .._engine.metrics import PrometheusMetrics
from .._model.decision import Decision
from .._model.errors import StorageError
from ._config import LimitRule
from ._tokens import TokenRefused
from ._upstream import (
    LATENCY_BUCKETS,
    NEAR_LIMIT_RATIO,
    hit_counts,
    near_limit_threshold,
    upstream_families,
)

__all__ = ["NEAR_LIMIT_RATIO", "ServiceMetrics", "WorkerMetricsDir", "single_process_metrics"]

#: prometheus-client's variable for its multiprocess mode (and the old lowercase spelling).
_MULTIPROC_VARS = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
#: Labelled counters kept at hand (detailed_metric makes one per request value: bounded).
_MAX_CHILDREN = 10_000
#: Distinct unknown domains counted by name per worker; later ones count as ``(other)``.
_MAX_DOMAINS = 1_000
_OTHER_DOMAIN = "(other)"


# -- recording ---------------------------------------------------------------------------------


def error_kind(exc: BaseException) -> str:
    """The ``error`` label of a call that failed with ``exc``."""
    if isinstance(exc, StorageError):
        return "store"
    if isinstance(exc, TokenRefused):
        return "token"
    # BadRequest's gRPC code: UNKNOWN for upstream's own refusals (UpstreamRefusal)
    code = getattr(exc, "grpc_code", None)
    if code == "UNKNOWN":
        return "refused"
    return "bad_request" if code is not None else "error"


class _View:
    """What a scrape renders: collected families, then upstream's computed from them."""

    def __init__(self, *sources: Any) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Any]:
        families = [family for source in self.sources for family in source.collect()]
        yield from families
        yield from upstream_families(families)


class ServiceMetrics:
    """The service's counters and the limiter's hook (``limiter_metrics``), on ``registry``
    (a new ``prometheus_client.CollectorRegistry`` by default).

    ``multiprocess_dir``: the workers' shared directory (:class:`WorkerMetricsDir`), which
    must be prometheus-client's ``PROMETHEUS_MULTIPROC_DIR`` from before it was imported; a
    scrape then sums every worker's counts. ``near_limit_ratio`` is upstream's
    ``NEAR_LIMIT_RATIO``."""

    def __init__(
        self,
        registry: Any = None,
        *,
        multiprocess_dir: str | None = None,
        near_limit_ratio: float = NEAR_LIMIT_RATIO,
    ) -> None:
        import prometheus_client as prom

        if not 0 <= near_limit_ratio <= 1:
            raise ValueError(f"near_limit_ratio must be 0 to 1, got {near_limit_ratio!r}")
        if multiprocess_dir is not None:
            from prometheus_client import values

            if (
                not getattr(values.ValueClass, "_multiprocess", False)
                or os.environ.get(_MULTIPROC_VARS[0]) != multiprocess_dir
            ):
                raise RuntimeError(
                    f"prometheus-client is not in multiprocess mode on {multiprocess_dir}: "
                    f"{_MULTIPROC_VARS[0]} must name it before prometheus_client is imported"
                )
        if registry is None:
            registry = prom.CollectorRegistry()
        self.registry = registry
        self.multiprocess_dir = multiprocess_dir
        self.near_limit_ratio = near_limit_ratio
        self.limiter_metrics = PrometheusMetrics(registry=registry)
        options: dict[str, Any] = {"namespace": "ratekeeper_service", "registry": registry}
        self.decisions = prom.Counter(
            "decisions",
            "Descriptors decided, by domain, descriptor (stat key) and outcome.",
            ("domain", "descriptor", "outcome"),
            **options,
        )
        self.hits = prom.Counter(
            "hits",
            "Hits (hits_addend units) by domain, descriptor (stat key) and kind, counted as "
            "envoyproxy/ratelimit counts them: total_hits, within_limit, near_limit, "
            "over_limit, shadow_mode.",
            ("domain", "descriptor", "kind"),
            **options,
        )
        self.domains_not_found = prom.Counter(
            "domain_not_found",
            "Descriptors asked of a domain that no configuration file defines.",
            ("domain",),
            **options,
        )
        self.durations = prom.Histogram(
            "request_duration_seconds",
            "Calls answered (gRPC ShouldRateLimit, HTTP /json, /reserve, /settle) and their "
            "latency in seconds.",
            ("method",),
            buckets=LATENCY_BUCKETS,
            **options,
        )
        self.errors = prom.Counter(
            "request_errors",
            "Calls answered with an error, by method and error: store, refused, bad_request, "
            "token.",
            ("method", "error"),
            **options,
        )
        self.unavailable_total = prom.Counter(
            "unavailable",
            "Descriptors the store could not decide under failure_mode=raise.",
            **options,
        )
        self.shadowed = prom.Counter(
            "global_shadow_mode",
            "Requests answered OK by --shadow-mode although a descriptor was over its limit.",
            **options,
        )
        self.reloads = prom.Counter(
            "config_reloads", "Configuration reloads, by outcome.", ("outcome",), **options
        )
        self.loaded_at = prom.Gauge(
            "config_loaded_timestamp_seconds",
            "When the configuration in force was loaded (Unix time).",
            multiprocess_mode="max",
            **options,
        )
        self._children: dict[tuple[str, str, str], Any] = {}
        self._hit_children: dict[tuple[str, str, str], Any] = {}
        self._timers: dict[str, Any] = {}
        self._near: dict[int, int] = {}
        self._unknown_domains: set[str] = set()
        # Which worker answered a scrape (with --workers, the kernel picks one per
        # connection): the one thing a scrape shows of its own worker only.
        self._local = prom.CollectorRegistry()
        prom.Info(
            "worker",
            "The worker process serving this scrape.",
            namespace="ratekeeper_service",
            registry=self._local,
        ).info({"pid": str(os.getpid())})
        if multiprocess_dir is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            shared = prom.CollectorRegistry()
            MultiProcessCollector(shared, path=multiprocess_dir)  # type: ignore[no-untyped-call]
            self._view = _View(shared, self._local)
        else:
            self._view = _View(registry, self._local)

    def decided(
        self,
        domain: str,
        stat_key: str,
        rule: LimitRule,
        decision: Decision,
        over: bool,
        hits: int = 1,
    ) -> None:
        """Count one decided descriptor of ``hits`` hits (0: a peek, which counts no hits)."""
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
        if hits <= 0:
            return
        limit = decision.limit
        if decision.degraded:  # the failure mode's numbers are invented: no near_limit
            counts = (0, 0, hits, 0) if over else (hits, 0, 0, 0)
        elif over:
            # nothing was written: ``remaining`` is what was left before
            remaining = min(max(decision.remaining, 0), hits - 1)
            counts = hit_counts(limit, limit - remaining, hits, self._near_of(limit), False)
        else:
            used_before = max(0, limit - max(decision.remaining, 0) - hits)
            counts = hit_counts(limit, used_before, hits, self._near_of(limit), False)
        within, near, over_hits, _ = counts
        self._add_hits(domain, stat_key, "total_hits", hits)
        self._add_hits(domain, stat_key, "within_limit", within)
        self._add_hits(domain, stat_key, "near_limit", near)
        self._add_hits(domain, stat_key, "over_limit", over_hits)
        if rule.shadow_mode:
            self._add_hits(domain, stat_key, "shadow_mode", over_hits)

    def denied_all(self, domain: str, stat_key: str, rule: LimitRule, hits: int) -> None:
        """A ``requests_per_unit: 0`` rule answered ``hits`` without the store: upstream's
        hits over a limit of 0."""
        if hits <= 0:
            return
        self._add_hits(domain, stat_key, "total_hits", hits)
        self._add_hits(domain, stat_key, "over_limit", hits)
        if rule.shadow_mode:
            self._add_hits(domain, stat_key, "shadow_mode", hits)

    def _near_of(self, limit: int) -> int:
        near = self._near.get(limit)
        if near is None:
            if len(self._near) >= _MAX_CHILDREN:
                self._near.clear()
            near = self._near[limit] = near_limit_threshold(limit, self.near_limit_ratio)
        return near

    def _add_hits(self, domain: str, stat_key: str, kind: str, amount: int) -> None:
        if amount <= 0:  # a series appears with its first count, as upstream's do
            return
        labels = (domain, stat_key, kind)
        child = self._hit_children.get(labels)
        if child is None:
            if len(self._hit_children) >= _MAX_CHILDREN:
                self._hit_children.clear()
            child = self._hit_children[labels] = self.hits.labels(*labels)
        child.inc(amount)

    def domain_not_found(self, domain: str, descriptors: int) -> None:
        """``descriptors`` descriptors asked of ``domain``, which no file defines."""
        if domain not in self._unknown_domains:
            if len(self._unknown_domains) >= _MAX_DOMAINS:
                domain = _OTHER_DOMAIN
            else:
                self._unknown_domains.add(domain)
        self.domains_not_found.labels(domain).inc(descriptors)

    def answered(self, method: str, started: float, error: BaseException | None = None) -> None:
        """A call to ``method`` begun at ``started`` (``time.perf_counter()``) was answered,
        with ``error`` when it failed."""
        timer = self._timers.get(method)
        if timer is None:  # a handful of methods
            timer = self._timers[method] = self.durations.labels(method)
        timer.observe(time.perf_counter() - started)
        if error is not None:
            self.errors.labels(method, error_kind(error)).inc()

    def unavailable(self) -> None:
        self.unavailable_total.inc()

    def global_shadow_mode(self) -> None:
        self.shadowed.inc()

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels("ok" if ok else "error").inc()
        if ok:
            self.loaded_at.set(time.time())

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type: ours (every worker's, summed, in
        multiprocess mode), then upstream's names computed from them."""
        import prometheus_client as prom

        return prom.generate_latest(self._view), prom.CONTENT_TYPE_LATEST


class WorkerMetricsDir:
    """The private ``PROMETHEUS_MULTIPROC_DIR`` of one ``serve --workers N``: made on entry
    (mode 0700), removed on exit, set in the environment only while workers start
    (:meth:`starting`), so nothing reaches a directory the user named for their own
    processes."""

    def __init__(self) -> None:
        self.path = ""

    def __enter__(self) -> WorkerMetricsDir:
        self.path = tempfile.mkdtemp(prefix="ratekeeper-serve-metrics-")
        return self

    def __exit__(self, *exc_info: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    @contextlib.contextmanager
    def starting(self) -> Iterator[str]:
        """The environment workers start with: this directory as prometheus-client's, the
        user's own (either spelling) put back after."""
        saved = {name: os.environ.pop(name) for name in _MULTIPROC_VARS if name in os.environ}
        os.environ[_MULTIPROC_VARS[0]] = self.path
        try:
            yield self.path
        finally:
            del os.environ[_MULTIPROC_VARS[0]]
            os.environ.update(saved)

    def exited(self, pid: int | None) -> None:
        """A worker exited: drop its live gauges (prometheus-client's ``mark_process_dead``)."""
        if pid is not None:
            from prometheus_client.multiprocess import mark_process_dead

            mark_process_dead(pid, self.path)  # type: ignore[no-untyped-call]


def single_process_metrics() -> None:
    """One worker keeps its metrics in its own memory: a ``PROMETHEUS_MULTIPROC_DIR`` the user
    set (for their own processes) must not put ours in their directory. Call it before
    prometheus_client is imported."""
    for name in _MULTIPROC_VARS:
        os.environ.pop(name, None)
