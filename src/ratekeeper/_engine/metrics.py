"""The metrics hooks and their Prometheus and OpenTelemetry adapters; users import them from
``ratekeeper.metrics``, whose docstring describes them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .._model.decision import Decision
from .._model.errors import ConfigError
from .breaker import BreakerState

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter, MeterProvider

__all__ = ["INSTRUMENTS", "Instrument", "Metrics", "OTelMetrics", "PrometheusMetrics"]


class Metrics:
    """The hook interface; every method does nothing by default."""

    def decision(self, decision: Decision) -> None:
        """After every decision: ``decision.degraded`` and ``decision.reason`` say how it was
        made (``"deny_cache"`` for a local answer to a recent exact denial)."""

    def store_call(self, seconds: float, ok: bool) -> None:
        """After every store call, with the store's time for it (from the write of its last
        round trip to its reply's arrival in this process) and whether it succeeded."""

    def loop_lag(self, seconds: float) -> None:
        """After every store call that succeeded, how long its reply waited in this process
        after it arrived, until the caller resumed: an asyncio limiter's event-loop lag (a
        busy loop reads replies late), a blocking one's wait for its thread to run. The
        application's latency, not the store's: never held against the store."""

    def breaker_transition(self, old: BreakerState, new: BreakerState) -> None:
        """When the store's circuit breaker changes state (one server; on a cluster or
        Sentinel, the breaker of calls not yet placed on a node)."""

    def node_breaker_added(self, node: str) -> None:
        """A cluster primary or a Sentinel-named primary, ``node`` (``host:port``), got a
        breaker of its own, closed (on its first call)."""

    def node_breaker_transition(self, node: str, old: BreakerState, new: BreakerState) -> None:
        """When the breaker of ``node`` changes state. By default, ``breaker_transition``."""
        self.breaker_transition(old, new)


@dataclass(frozen=True, slots=True)
class Instrument:
    """One metric, as every adapter exports it.

    ``prometheus`` and ``otel`` are the names after the namespace (``<ns>_`` and ``<ns>.``;
    prometheus-client adds ``_total`` to counters). ``unit`` is the UCUM unit OpenTelemetry
    records. ``labels`` are the Prometheus label names; OpenTelemetry attributes are the same
    names under the namespace (``ratekeeper.policy``).

    Kind ``state`` is the breaker's state, exported as each system expects it: Prometheus as a
    gauge of the state's number (0 closed, 1 half-open, 2 open) per ``node``, OpenTelemetry as
    an UpDownCounter of breakers in each state and node (the pattern of OpenTelemetry's
    ``db.client.connection.count``), which sums across limiters and instances. ``node`` is
    ``host:port`` of a cluster primary or Sentinel-named primary, each of which has a breaker of
    its own, and empty for the store's one breaker.
    """

    kind: Literal["counter", "histogram", "state"]
    prometheus: str
    otel: str
    unit: str
    description: str
    labels: tuple[str, ...] = ()

    @property
    def prometheus_labels(self) -> tuple[str, ...]:
        """The Prometheus label names: the state's value is its number, not a label."""
        return self.labels[1:] if self.kind == "state" else self.labels


DECISIONS = Instrument(
    "counter", "decisions", "decisions", "{decision}", "Rate limit decisions",
    ("policy", "outcome"),
)  # fmt: skip
DEGRADED = Instrument(
    "counter", "degraded_decisions", "degraded_decisions", "{decision}",
    "Decisions made by the failure mode, not the store", ("policy", "reason"),
)  # fmt: skip
DENY_CACHE_HITS = Instrument(
    "counter", "deny_cache_hits", "deny_cache.hits", "{hit}",
    "Hits answered by the local cache of exact denials", ("policy",),
)  # fmt: skip
STORE_LATENCY = Instrument(
    "histogram", "store_latency_seconds", "store.duration", "s",
    "The store's time for a call: from the write to the reply's arrival", ("outcome",),
)  # fmt: skip
LOOP_LAG = Instrument(
    "histogram", "loop_lag_seconds", "loop.lag", "s",
    "How long store replies waited in this process for the caller to resume (event-loop lag)",
)  # fmt: skip
BREAKER_STATE = Instrument(
    "state", "breaker_state", "breakers", "{breaker}", "Circuit breaker state",
    ("breaker.state", "node"),
)  # fmt: skip
BREAKER_TRANSITIONS = Instrument(
    "counter", "breaker_transitions", "breaker.transitions", "{transition}",
    "Circuit breaker transitions", ("from_state", "to_state", "node"),
)  # fmt: skip

#: Every instrument both adapters export; each adapter's docstring gives the names it exports.
INSTRUMENTS = (DECISIONS, DEGRADED, DENY_CACHE_HITS, STORE_LATENCY, LOOP_LAG, BREAKER_STATE,
               BREAKER_TRANSITIONS)  # fmt: skip

#: Histogram buckets for store latency, in seconds: 100 us to 1 s.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

_STATE_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class _Exporter(Metrics):
    """What each hook counts, once for every adapter: they only write to their library."""

    def _add(self, instrument: Instrument, values: tuple[str, ...]) -> None:
        raise NotImplementedError

    def _record(self, instrument: Instrument, values: tuple[str, ...], value: float) -> None:
        raise NotImplementedError

    def _set_state(self, node: str, old: BreakerState | None, new: BreakerState) -> None:
        raise NotImplementedError

    def decision(self, decision: Decision) -> None:
        self._add(DECISIONS, (decision.policy, "allowed" if decision.allowed else "denied"))
        if decision.degraded:
            self._add(DEGRADED, (decision.policy, decision.reason or "unknown"))
        elif decision.reason == "deny_cache":
            self._add(DENY_CACHE_HITS, (decision.policy,))

    def store_call(self, seconds: float, ok: bool) -> None:
        self._record(STORE_LATENCY, ("ok" if ok else "error",), seconds)

    def loop_lag(self, seconds: float) -> None:
        self._record(LOOP_LAG, (), seconds)

    def breaker_transition(self, old: BreakerState, new: BreakerState) -> None:
        self.node_breaker_transition("", old, new)

    def node_breaker_added(self, node: str) -> None:
        self._set_state(node, None, BreakerState.CLOSED)

    def node_breaker_transition(self, node: str, old: BreakerState, new: BreakerState) -> None:
        self._set_state(node, old, new)
        self._add(BREAKER_TRANSITIONS, (old.value, new.value, node))


def _missing(adapter: str, package: str, extra: str) -> ConfigError:
    return ConfigError(f"{adapter} needs {package}: pip install 'ratekeeper[{extra}]'")


class PrometheusMetrics(_Exporter):
    """Exports :data:`INSTRUMENTS` with ``prometheus-client``, each named ``<ns>_<name>``:

    * ``<ns>_decisions_total{policy, outcome}``: outcome ``allowed`` or ``denied``
    * ``<ns>_degraded_decisions_total{policy, reason}``
    * ``<ns>_deny_cache_hits_total{policy}``
    * ``<ns>_store_latency_seconds{outcome}``: a histogram of the store's time (the write to
      the reply's arrival); outcome ``ok`` or ``error``
    * ``<ns>_loop_lag_seconds``: a histogram of how long replies waited in the process for
      their callers to resume (event-loop lag)
    * ``<ns>_breaker_state{node}``: 0 closed, 1 half-open, 2 open
    * ``<ns>_breaker_transitions_total{from_state, to_state, node}``

    ``node`` is ``host:port`` of a cluster primary or of a Sentinel-named primary (each has a
    breaker of its own), and empty for the one breaker of a single server.

    ``registry`` defaults to prometheus-client's global one.
    """

    def __init__(self, registry: Any = None, namespace: str = "ratekeeper") -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise _missing("PrometheusMetrics", "prometheus-client", "prometheus") from exc
        if registry is None:
            registry = prom.REGISTRY
        kind = {"counter": prom.Counter, "histogram": prom.Histogram, "state": prom.Gauge}
        made: dict[Instrument, Any] = {}
        for instrument in INSTRUMENTS:
            options: dict[str, Any] = {"namespace": namespace, "registry": registry}
            description = f"{instrument.description}."
            if instrument.kind == "histogram":
                options["buckets"] = LATENCY_BUCKETS
            elif instrument.kind == "state":
                description = f"{instrument.description}: 0 closed, 1 half-open, 2 open."
            made[instrument] = kind[instrument.kind](
                instrument.prometheus, description, instrument.prometheus_labels, **options
            )
        self._made = made
        self.decisions = made[DECISIONS]
        self.degraded = made[DEGRADED]
        self.deny_cache_hits = made[DENY_CACHE_HITS]
        self.latency = made[STORE_LATENCY]
        self.breaker_state = made[BREAKER_STATE]
        self.breaker_transitions = made[BREAKER_TRANSITIONS]
        self._set_state("", None, BreakerState.CLOSED)

    def _add(self, instrument: Instrument, values: tuple[str, ...]) -> None:
        self._made[instrument].labels(*values).inc()

    def _record(self, instrument: Instrument, values: tuple[str, ...], value: float) -> None:
        made = self._made[instrument]
        (made.labels(*values) if values else made).observe(value)

    def _set_state(self, node: str, old: BreakerState | None, new: BreakerState) -> None:
        self.breaker_state.labels(node).set(_STATE_VALUES[new])


class OTelMetrics(_Exporter):
    """Exports :data:`INSTRUMENTS` with the OpenTelemetry metrics API, each named
    ``<ns>.<name>``, with attributes ``<ns>.<label>``:

    * ``<ns>.decisions`` (counter, ``{decision}``): ``<ns>.policy``, ``<ns>.outcome``
      (``allowed`` or ``denied``)
    * ``<ns>.degraded_decisions`` (counter, ``{decision}``): ``<ns>.policy``, ``<ns>.reason``
    * ``<ns>.deny_cache.hits`` (counter, ``{hit}``): ``<ns>.policy``
    * ``<ns>.store.duration`` (histogram, ``s``): ``<ns>.outcome`` (``ok`` or ``error``);
      the same bucket boundaries as Prometheus, given as advice the SDK's views may override
    * ``<ns>.loop.lag`` (histogram, ``s``): how long replies waited in the process for their
      callers to resume (event-loop lag), with the same boundaries
    * ``<ns>.breakers`` (UpDownCounter, ``{breaker}``): ``<ns>.breaker.state`` (``closed``,
      ``half_open`` or ``open``), ``<ns>.node``: the number of breakers in each state. Each
      adapter counts the store's one breaker (node empty), closed from the start, and each
      node's (``host:port`` of a cluster primary or a Sentinel-named primary) from its first
      call; adapters on one provider add up, so one per limiter shows how many are open
    * ``<ns>.breaker.transitions`` (counter, ``{transition}``): ``<ns>.from_state``,
      ``<ns>.to_state``, ``<ns>.node``

    The instruments come from ``meter`` if given, else from a meter named ``ratekeeper`` of
    ``meter_provider``, by default the global provider (``opentelemetry.metrics``'s
    ``set_meter_provider``; until one is set, the API's proxy forwards to it once it is).
    """

    def __init__(
        self,
        meter_provider: MeterProvider | None = None,
        *,
        meter: Meter | None = None,
        namespace: str = "ratekeeper",
    ) -> None:
        try:
            from opentelemetry import metrics as otel
        except ImportError as exc:
            raise _missing("OTelMetrics", "opentelemetry-api", "otel") from exc
        from .._version import __version__

        if meter is not None and meter_provider is not None:
            raise ConfigError("OTelMetrics takes a meter_provider or a meter, not both")
        if meter is None:
            meter = otel.get_meter("ratekeeper", __version__, meter_provider=meter_provider)
        self.meter = meter
        self._namespace = namespace
        made: dict[Instrument, Any] = {}
        for instrument in INSTRUMENTS:
            name = f"{namespace}.{instrument.otel}"
            description = f"{instrument.description}."
            if instrument.kind == "state":
                description = f"{instrument.description}: the number of breakers in each state."
            common = {"unit": instrument.unit, "description": description}
            if instrument.kind == "counter":
                made[instrument] = meter.create_counter(name, **common)
            elif instrument.kind == "histogram":
                made[instrument] = meter.create_histogram(
                    name, explicit_bucket_boundaries_advisory=LATENCY_BUCKETS, **common
                )
            else:
                made[instrument] = meter.create_up_down_counter(name, **common)
        self._made = made
        self._set_state("", None, BreakerState.CLOSED)

    def _attributes(self, instrument: Instrument, values: Iterable[str]) -> dict[str, str]:
        return {
            f"{self._namespace}.{label}": value
            for label, value in zip(instrument.labels, values, strict=True)
        }

    def _add(self, instrument: Instrument, values: tuple[str, ...]) -> None:
        self._made[instrument].add(1, self._attributes(instrument, values))

    def _record(self, instrument: Instrument, values: tuple[str, ...], value: float) -> None:
        self._made[instrument].record(value, self._attributes(instrument, values))

    def _set_state(self, node: str, old: BreakerState | None, new: BreakerState) -> None:
        breakers = self._made[BREAKER_STATE]
        if old is not None:
            breakers.add(-1, self._attributes(BREAKER_STATE, (old.value, node)))
        breakers.add(1, self._attributes(BREAKER_STATE, (new.value, node)))
