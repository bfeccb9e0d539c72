"""OpenTelemetry: ``OTelMetrics`` read back through the SDK's ``InMemoryMetricReader``.

The same sequences as tests/engine/test_metrics.py, with the same expected counts (its ``Counts``
tables), named the OpenTelemetry way: a switchable store for the exact scenario, a real store
that is down (a free port) for each failure mode, and every backend and API for the plain case.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    Histogram,
    InMemoryMetricReader,
    Sum,
)

from ratekeeper import ConfigError, Limiter, ManualClock, Policy
from ratekeeper._engine.breaker import BreakerState, CircuitBreaker
from ratekeeper._engine.metrics import (
    BREAKER_STATE,
    BREAKER_TRANSITIONS,
    DECISIONS,
    DEGRADED,
    INSTRUMENTS,
    LATENCY_BUCKETS,
    STORE_LATENCY,
    OTelMetrics,
)

from ..conftest import MakeLimiter
from ..support.servers import free_port
from .test_metrics import (
    BACKEND_COUNTS,
    RECOVERED_COUNTS,
    SCENARIO_COUNTS,
    Counts,
    build,
    on_backend,
    recover,
    scenario,
)

Points = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def sdk() -> Iterator[tuple[MeterProvider, InMemoryMetricReader]]:
    """An SDK provider whose metrics the test reads back."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield provider, reader
    provider.shutdown()


SDK = tuple[MeterProvider, InMemoryMetricReader]


def metrics_of(reader: InMemoryMetricReader) -> dict[str, Any]:
    """Every metric collected now, by name."""
    data = reader.get_metrics_data()
    assert data is not None
    found = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "ratekeeper"
            for metric in scope.metrics:
                found[metric.name] = metric
    return found


def points(reader: InMemoryMetricReader) -> Points:
    """Each data point's value: a counter's sum, a histogram's count; breakers only in the
    states some breaker is in (a state left again stays as a point of 0)."""
    found: Points = {}
    for name, metric in metrics_of(reader).items():
        for point in metric.data.data_points:
            if name.endswith(".breakers") and point.value == 0:
                continue
            attributes = tuple(sorted((k, str(v)) for k, v in point.attributes.items()))
            if isinstance(metric.data, Histogram):
                value = point.count
                assert sum(point.bucket_counts) == point.count
            else:
                assert isinstance(metric.data, Sum)
                value = point.value
            found[(name, attributes)] = value
    return found


def otel(counts: Counts, namespace: str = "ratekeeper") -> Points:
    """``counts`` as OpenTelemetry points: ``<ns>.<name>`` with ``<ns>.<label>`` attributes;
    the breaker's state number as one breaker in the state of that number."""
    found: Points = {}
    for (i, values), n in counts.items():
        state = i is BREAKER_STATE
        labels = zip(i.labels, (STATE_NAMES[int(n)], *values) if state else values, strict=True)
        attributes = tuple(sorted((f"{namespace}.{label}", v) for label, v in labels))
        found[(f"{namespace}.{i.otel}", attributes)] = 1 if state else n
    return found


STATE_NAMES = ["closed", "half_open", "open"]
HALF_OPEN = (
    "ratekeeper.breakers",
    (("ratekeeper.breaker.state", "half_open"), ("ratekeeper.node", "")),
)


def test_the_exact_scenario_and_recovery(sdk: SDK):
    provider, reader = sdk
    limiter, storage, breaker, breaker_clock = build(OTelMetrics(provider))
    with limiter:
        scenario(limiter, storage)
        assert breaker.state is BreakerState.OPEN
        assert points(reader) == otel(SCENARIO_COUNTS)

        storage.down = False
        breaker_clock.advance(1.0)
        assert breaker.state is BreakerState.HALF_OPEN
        assert points(reader)[HALF_OPEN] == 1
        assert otel({(BREAKER_STATE, ("",)): 1}) == {HALF_OPEN: 1}
        recover(limiter, breaker)
    assert points(reader) == otel(RECOVERED_COUNTS)


def test_names_units_descriptions_and_buckets(sdk: SDK):
    provider, reader = sdk
    limiter, storage, _, _ = build(OTelMetrics(provider))
    with limiter:
        scenario(limiter, storage)
    found = metrics_of(reader)
    assert sorted(found) == [
        "ratekeeper.breaker.transitions",
        "ratekeeper.breakers",
        "ratekeeper.decisions",
        "ratekeeper.degraded_decisions",
        "ratekeeper.deny_cache.hits",
        "ratekeeper.loop.lag",
        "ratekeeper.store.duration",
    ]
    for instrument in INSTRUMENTS:
        metric = found[f"ratekeeper.{instrument.otel}"]
        assert metric.unit == instrument.unit
        assert metric.description.startswith(instrument.description)
    assert found["ratekeeper.store.duration"].unit == "s"
    assert found["ratekeeper.decisions"].description == "Rate limit decisions."
    assert found["ratekeeper.breakers"].description == (
        "Circuit breaker state: the number of breakers in each state."
    )
    assert isinstance(found["ratekeeper.store.duration"].data, Histogram)
    breakers = found["ratekeeper.breakers"].data
    assert isinstance(breakers, Sum)
    assert not breakers.is_monotonic  # an UpDownCounter
    assert {p.attributes["ratekeeper.breaker.state"]: p.value for p in breakers.data_points} == {
        "closed": 0,
        "open": 1,
    }
    for name in ("decisions", "degraded_decisions", "deny_cache.hits", "breaker.transitions"):
        data = found[f"ratekeeper.{name}"].data
        assert isinstance(data, Sum)
        assert data.is_monotonic
    for name in ("store.duration", "loop.lag"):
        for point in found[f"ratekeeper.{name}"].data.data_points:
            assert tuple(point.explicit_bounds) == LATENCY_BUCKETS
            assert point.min >= 0


def test_a_meter_and_a_namespace(sdk: SDK):
    provider, reader = sdk
    meter = provider.get_meter("ratekeeper", "test")
    clock = ManualClock()
    breaker = CircuitBreaker(consecutive_failures=1_000, clock=ManualClock(50.0))
    metrics = OTelMetrics(meter=meter, namespace="shop")
    assert metrics.meter is meter
    policy = Policy("cart", "2/minute")
    with Limiter.from_url(
        "memory://", clock=clock, breaker=breaker, metrics=metrics, top_offenders=0
    ) as limiter:
        assert [limiter.hit(policy, "a").allowed for _ in range(3)] == [True, True, False]
    assert points(reader) == {
        ("shop.decisions", (("shop.outcome", "allowed"), ("shop.policy", "cart"))): 2,
        ("shop.decisions", (("shop.outcome", "denied"), ("shop.policy", "cart"))): 1,
        ("shop.store.duration", (("shop.outcome", "ok"),)): 3,
        ("shop.loop.lag", ()): 3,
        ("shop.breakers", (("shop.breaker.state", "closed"), ("shop.node", ""))): 1,  # not moved
    }


# -- a store that is down: each failure mode -------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "allowed"),
    [("open", [True] * 3), ("closed", [False] * 3), ("local", [True, True, False])],
)
def test_each_failure_mode_on_a_dead_store(
    mode: str, allowed: list[bool], key_prefix: str, sdk: SDK
):
    provider, reader = sdk
    breaker = CircuitBreaker(consecutive_failures=1_000, clock=ManualClock(50.0))
    policy = Policy("cart", "4/minute", failure_mode=mode)  # type: ignore[arg-type]
    with Limiter.from_url(
        f"redis://127.0.0.1:{free_port()}/0",
        key_prefix=key_prefix,
        breaker=breaker,
        local_share=0.5,
        metrics=OTelMetrics(provider),
        timeout=0.05,
        connect_timeout=0.05,
    ) as limiter:
        assert [limiter.hit(policy, "a").allowed for _ in range(3)] == allowed
    counts: Counts = {
        (DEGRADED, ("cart", f"unavailable/{mode}")): 3,
        (STORE_LATENCY, ("error",)): 3,
        (BREAKER_STATE, ("",)): 0,
    }
    for outcome in ("allowed", "denied"):
        if n := sum(a is (outcome == "allowed") for a in allowed):
            counts[(DECISIONS, ("cart", outcome))] = n
    assert points(reader) == otel(counts)


def test_the_breaker_opens_on_a_dead_store(key_prefix: str, sdk: SDK):
    provider, reader = sdk
    breaker = CircuitBreaker(consecutive_failures=2, open_for=1.0, clock=ManualClock(50.0))
    policy = Policy("cart", "4/minute", failure_mode="closed")
    with Limiter.from_url(
        f"redis://127.0.0.1:{free_port()}/0",
        key_prefix=key_prefix,
        breaker=breaker,
        metrics=OTelMetrics(provider),
        timeout=0.05,
        connect_timeout=0.05,
    ) as limiter:
        reasons = [limiter.hit(policy, "a").reason for _ in range(4)]
    assert reasons == ["unavailable/closed"] * 2 + ["breaker_open/closed"] * 2
    assert points(reader) == otel(
        {
            (DECISIONS, ("cart", "denied")): 4,
            (DEGRADED, ("cart", "unavailable/closed")): 2,
            (DEGRADED, ("cart", "breaker_open/closed")): 2,
            (STORE_LATENCY, ("error",)): 2,
            (BREAKER_STATE, ("",)): 2,
            (BREAKER_TRANSITIONS, ("closed", "open", "")): 1,
        }
    )


# -- every backend and API -------------------------------------------------------------------------


def test_otel_on_every_backend(make_limiter: MakeLimiter, backend: str, sdk: SDK):
    """memory://, Redis and Valkey, sync and async."""
    provider, reader = sdk
    on_backend(make_limiter, backend, OTelMetrics(provider))
    assert points(reader) == otel(BACKEND_COUNTS)


# -- construction ----------------------------------------------------------------------------------


GLOBAL_PROVIDER = """
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from ratekeeper import Limiter, Policy
from ratekeeper.metrics import OTelMetrics

adapter = OTelMetrics()  # before the application sets its provider: the API's proxy
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
with Limiter.from_url("memory://", metrics=adapter) as limiter:
    for _ in range(3):
        limiter.hit(Policy("g", "2/minute"), "a")
for resource in reader.get_metrics_data().resource_metrics:
    for scope in resource.scope_metrics:
        for metric in scope.metrics:
            if metric.name == "ratekeeper.decisions":
                for point in metric.data.data_points:
                    print(point.attributes["ratekeeper.outcome"], point.value)
"""


def test_the_global_provider_is_the_default_even_when_set_later():
    """In a fresh process: the global provider is set once per process."""
    out = subprocess.run(
        [sys.executable, "-c", GLOBAL_PROVIDER], capture_output=True, text=True, check=True
    ).stdout
    assert sorted(out.split("\n")) == ["", "allowed 2", "denied 1"]


def test_a_noop_provider_records_nothing_and_raises_nothing():
    metrics = OTelMetrics(NoOpMeterProvider())
    limiter, storage, _, _ = build(metrics)
    with limiter:
        assert len(scenario(limiter, storage)) == 12


def test_a_provider_and_a_meter_together_are_refused():
    provider = MeterProvider()
    with pytest.raises(ConfigError, match="meter_provider or a meter, not both"):
        OTelMetrics(provider, meter=provider.get_meter("x"))
    provider.shutdown()


def test_without_opentelemetry_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # import fails as if absent
    with pytest.raises(ConfigError, match=r"opentelemetry-api: pip install 'ratekeeper\[otel\]'"):
        OTelMetrics()


def test_importing_the_metrics_module_imports_neither_library():
    code = (
        "import sys, ratekeeper, ratekeeper.metrics; "
        "print(sorted(m for m in ('opentelemetry', 'prometheus_client') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
