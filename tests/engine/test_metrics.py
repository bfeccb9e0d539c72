"""Metrics: the Prometheus adapter's exact sample values, and a custom ``Metrics`` hook.

Most tests drive a limiter over a storage that can be switched off (the memory backend behind a
switch), with a ManualClock and a breaker on a fake clock, so every count is known exactly.
``test_prometheus_on_every_backend`` repeats the simple case on the real backends and APIs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import zlib
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from ratekeeper import (
    AsyncLimiter,
    ConfigError,
    Decision,
    Limiter,
    ManualClock,
    Policy,
    StorageUnavailable,
)
from ratekeeper._algorithms.scripts import Script
from ratekeeper._engine.breaker import BreakerState, CircuitBreaker
from ratekeeper._engine.metrics import (
    BREAKER_STATE,
    BREAKER_TRANSITIONS,
    DECISIONS,
    DEGRADED,
    DENY_CACHE_HITS,
    LOOP_LAG,
    STORE_LATENCY,
    Instrument,
    Metrics,
    PrometheusMetrics,
)
from ratekeeper.testing import AsyncFlakyStorage, FlakyStorage, RecordingMetrics

from ..conftest import MakeLimiter


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but creation times, bucket counts and latency sums (which are timings)."""
    found = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket", "_sum")):
                continue
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (name, tuple(sorted(labels.items())))


#: Expected values, the same for every adapter: (instrument, label values) -> value, where a
#: histogram's value is its number of observations. Each adapter's test names them its own way.
Counts = dict[tuple[Instrument, tuple[str, ...]], float]


def prometheus(counts: Counts) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``counts`` as Prometheus samples, as ``samples()`` returns them."""
    suffix = {"counter": "_total", "histogram": "_count", "state": ""}
    found = {}
    for (i, v), n in counts.items():
        labels = dict(zip(i.prometheus_labels, v, strict=True))
        found[key(f"ratekeeper_{i.prometheus}{suffix[i.kind]}", **labels)] = n
    return found


#: What scenario() counts.
SCENARIO_COUNTS: Counts = {
    (DECISIONS, ("api", "allowed")): 4,
    (DECISIONS, ("api", "denied")): 5,
    (DECISIONS, ("other", "allowed")): 1,
    (DECISIONS, ("other", "denied")): 2,
    (DEGRADED, ("api", "unavailable/open")): 1,
    (DEGRADED, ("api", "breaker_open/open")): 1,
    (DEGRADED, ("other", "unavailable/closed")): 1,
    (DEGRADED, ("other", "breaker_open/closed")): 1,
    (DENY_CACHE_HITS, ("api",)): 4,
    (STORE_LATENCY, ("ok",)): 4,
    (STORE_LATENCY, ("error",)): 2,
    (LOOP_LAG, ()): 4,  # one for each call that succeeded
    (BREAKER_STATE, ("",)): 2,
    (BREAKER_TRANSITIONS, ("closed", "open", "")): 1,
}
#: After scenario() and recover(): half-open, two good probes, closed.
RECOVERED_COUNTS: Counts = {
    **SCENARIO_COUNTS,
    (DECISIONS, ("api", "allowed")): 6,
    (STORE_LATENCY, ("ok",)): 6,
    (LOOP_LAG, ()): 6,
    (BREAKER_STATE, ("",)): 0,
    (BREAKER_TRANSITIONS, ("open", "half_open", "")): 1,
    (BREAKER_TRANSITIONS, ("half_open", "closed", "")): 1,
}
#: What test_*_on_every_backend counts: 3 allowed, a store denial, a cached one.
BACKEND_COUNTS: Counts = {
    (DECISIONS, ("everywhere", "allowed")): 3,
    (DECISIONS, ("everywhere", "denied")): 2,
    (DENY_CACHE_HITS, ("everywhere",)): 1,
    (STORE_LATENCY, ("ok",)): 4,
    (LOOP_LAG, ()): 4,
    (BREAKER_STATE, ("",)): 0,
}

API = Policy("api", "2/minute")  # the limiter's failure mode: open
OTHER = Policy("other", "5/minute", failure_mode="closed")


def scenario(limiter: Limiter, storage: FlakyStorage) -> list[Decision]:
    """Allowed, denied by the store, denied by the cache, then degraded, breaker open."""
    made = [limiter.hit(API, "a") for _ in range(3)]  # allowed, allowed, denied (store)
    made += [limiter.hit(API, "a") for _ in range(3)]  # deny cache
    made.append(limiter.hit(OTHER, "b"))  # allowed
    storage.down = True
    made.append(limiter.hit(API, "c"))  # unavailable/open
    made.append(limiter.hit(OTHER, "d"))  # unavailable/closed; the breaker opens (2 in a row)
    made.append(limiter.hit(API, "e"))  # breaker_open/open
    made.append(limiter.hit(OTHER, "f"))  # breaker_open/closed
    made.append(limiter.hit(API, "a"))  # still a cached denial: the cache comes first
    return made


def build(metrics: Metrics) -> tuple[Limiter, FlakyStorage, CircuitBreaker, ManualClock]:
    clock = ManualClock()
    breaker_clock = ManualClock(50.0)
    breaker = CircuitBreaker(consecutive_failures=2, open_for=1.0, probes=2, clock=breaker_clock)
    storage = FlakyStorage(clock=clock)
    # top_offenders=0: the counts are the decisions' own calls (the summary's merge at close
    # is a store call too: tests/engine/test_top.py)
    limiter = Limiter(storage, clock=clock, breaker=breaker, metrics=metrics, top_offenders=0)
    return limiter, storage, breaker, breaker_clock


def recover(limiter: Limiter, breaker: CircuitBreaker) -> None:
    """Two good probes on a half-open breaker close it."""
    assert limiter.hit(API, "g").reason is None
    assert limiter.hit(API, "g").reason is None
    assert breaker.state is BreakerState.CLOSED


def test_prometheus_samples_are_exact():
    registry = CollectorRegistry()
    limiter, storage, breaker, breaker_clock = build(PrometheusMetrics(registry=registry))
    with limiter:
        made = scenario(limiter, storage)
        assert [d.reason for d in made] == [
            None, None, None, "deny_cache", "deny_cache", "deny_cache", None,
            "unavailable/open", "unavailable/closed", "breaker_open/open", "breaker_open/closed",
            "deny_cache",
        ]  # fmt: skip
        assert breaker.state is BreakerState.OPEN
        assert storage.calls == 6

        assert samples(registry) == prometheus(SCENARIO_COUNTS)

        # Recovery: half-open (state 1), two good probes, closed (state 0).
        storage.down = False
        breaker_clock.advance(1.0)
        assert breaker.state is BreakerState.HALF_OPEN
        assert registry.get_sample_value("ratekeeper_breaker_state", {"node": ""}) == 1.0
        recover(limiter, breaker)

    assert samples(registry) == prometheus(RECOVERED_COUNTS)
    # The histogram's buckets add up: every call is in the +Inf bucket.
    for outcome, count in (("ok", 6.0), ("error", 2.0)):
        inf = registry.get_sample_value(
            "ratekeeper_store_latency_seconds_bucket", {"outcome": outcome, "le": "+Inf"}
        )
        assert inf == count


def test_prometheus_local_mode_and_a_namespace():
    registry = CollectorRegistry()
    clock = ManualClock()
    storage = FlakyStorage(clock=clock)
    storage.down = True
    breaker = CircuitBreaker(consecutive_failures=1_000, clock=ManualClock(50.0))
    metrics = PrometheusMetrics(registry=registry, namespace="shop")
    policy = Policy("cart", "4/minute", failure_mode="local")
    with Limiter(storage, clock=clock, breaker=breaker, metrics=metrics, local_share=0.5) as lim:
        assert [lim.hit(policy, "a").allowed for _ in range(3)] == [True, True, False]
    assert samples(registry) == {
        key("shop_decisions_total", policy="cart", outcome="allowed"): 2.0,
        key("shop_decisions_total", policy="cart", outcome="denied"): 1.0,
        key("shop_degraded_decisions_total", policy="cart", reason="unavailable/local"): 3.0,
        key("shop_store_latency_seconds_count", outcome="error"): 3.0,
        key("shop_loop_lag_seconds_count"): 0.0,  # no reply came: none waited
        key("shop_breaker_state", node=""): 0.0,  # never moved
    }


def test_two_adapters_need_two_registries():
    registry = CollectorRegistry()
    PrometheusMetrics(registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        PrometheusMetrics(registry=registry)
    PrometheusMetrics(registry=registry, namespace="second")  # another namespace is fine


def summary(recorder: RecordingMetrics) -> list[tuple[str, bool, bool, str | None]]:
    """(policy, allowed, degraded, reason) of each decision ``recorder`` was told of."""
    return [(d.policy, d.allowed, d.degraded, d.reason) for d in recorder.decisions]


def outcomes(recorder: RecordingMetrics) -> list[bool]:
    """Whether each store call ``recorder`` was told of succeeded (each took some time)."""
    assert all(seconds >= 0 for seconds, _ in recorder.store_calls)
    return [ok for _, ok in recorder.store_calls]


EXPECTED_CALLS = [
    ("api", True, False, None),
    ("api", True, False, None),
    ("api", False, False, None),
    ("api", False, False, "deny_cache"),
    ("api", False, False, "deny_cache"),
    ("api", False, False, "deny_cache"),
    ("other", True, False, None),
    ("api", True, True, "unavailable/open"),
    ("other", False, True, "unavailable/closed"),
    ("api", True, True, "breaker_open/open"),
    ("other", False, True, "breaker_open/closed"),
    ("api", False, False, "deny_cache"),
]


def test_a_custom_metrics_subclass_receives_every_call():
    recorder = RecordingMetrics()
    limiter, storage, _, breaker_clock = build(recorder)
    with limiter:
        scenario(limiter, storage)
        assert summary(recorder) == EXPECTED_CALLS
        assert outcomes(recorder) == [True] * 4 + [False] * 2
        assert recorder.transitions == [("", BreakerState.CLOSED, BreakerState.OPEN)]
        storage.down = False
        breaker_clock.advance(1.0)
        limiter.hit(API, "g")
        limiter.hit(API, "g")
    assert recorder.transitions == [  # the store's one breaker: node ""
        ("", BreakerState.CLOSED, BreakerState.OPEN),
        ("", BreakerState.OPEN, BreakerState.HALF_OPEN),
        ("", BreakerState.HALF_OPEN, BreakerState.CLOSED),
    ]
    assert outcomes(recorder) == [True] * 4 + [False] * 2 + [True] * 2


def test_a_custom_metrics_subclass_on_asyncio():
    recorder = RecordingMetrics()
    clock = ManualClock()
    breaker = CircuitBreaker(consecutive_failures=2, open_for=1.0, clock=ManualClock(50.0))
    storage = AsyncFlakyStorage(clock=clock)

    async def main() -> None:
        async with AsyncLimiter(storage, clock=clock, breaker=breaker, metrics=recorder) as lim:
            for _ in range(3):
                await lim.hit(API, "a")
            await lim.hit(API, "a")
            storage.sync.down = True
            await lim.hit(OTHER, "d")
            await lim.hit(OTHER, "d")
            await lim.hit(OTHER, "d")

    asyncio.run(main())
    assert summary(recorder) == [
        ("api", True, False, None),
        ("api", True, False, None),
        ("api", False, False, None),
        ("api", False, False, "deny_cache"),
        ("other", False, True, "unavailable/closed"),
        ("other", False, True, "unavailable/closed"),
        ("other", False, True, "breaker_open/closed"),
    ]
    assert outcomes(recorder) == [True, True, True, False, False]
    assert recorder.transitions == [("", BreakerState.CLOSED, BreakerState.OPEN)]


def test_a_partial_subclass_keeps_the_other_hooks_as_no_ops():
    class DecisionsOnly(Metrics):
        def __init__(self) -> None:
            self.seen = 0

        def decision(self, decision: Decision) -> None:
            self.seen += 1

    metrics = DecisionsOnly()
    limiter, storage, breaker, _ = build(metrics)
    with limiter:
        scenario(limiter, storage)
    assert metrics.seen == len(EXPECTED_CALLS)
    assert breaker.state is BreakerState.OPEN


def on_backend(make_limiter: MakeLimiter, backend: str, metrics: Metrics) -> None:
    """The sequence BACKEND_COUNTS counts: 3 allowed, a store denial, a cached one."""
    options: dict[str, Any] = {"metrics": metrics}
    if not backend.startswith("memory"):
        options.update(timeout=5, connect_timeout=5)  # this test is not about timeouts
    limiter = make_limiter(**options)
    policy = Policy("everywhere", "3/minute")
    reasons = [limiter.hit(policy, "a").reason for _ in range(5)]
    assert reasons == [None, None, None, None, "deny_cache"]


def test_prometheus_on_every_backend(make_limiter: MakeLimiter, backend: str):
    """memory://, Redis and Valkey, sync and async."""
    registry = CollectorRegistry()
    on_backend(make_limiter, backend, PrometheusMetrics(registry=registry))
    assert samples(registry) == prometheus(BACKEND_COUNTS)


def test_prometheus_without_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if absent
    with pytest.raises(
        ConfigError, match=r"prometheus-client: pip install 'ratekeeper\[prometheus\]'"
    ):
        PrometheusMetrics(registry=CollectorRegistry())


# -- one breaker per node ----------------------------------------------------------------------


class TwoNodeStorage(FlakyStorage):
    """The memory backend as two nodes, ``a:1`` and ``b:2``, by a hash of the key;
    ``down_nodes`` are unreachable."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock=clock)
        self.down_nodes: set[str] = set()

    def node_of(self, key: str) -> str | None:
        return "a:1" if zlib.crc32(key.encode()) % 2 == 0 else "b:2"

    def run(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> list[int]:
        if self.node_of(keys[0]) in self.down_nodes:
            self.calls += 1
            raise StorageUnavailable("this node is switched off")
        return super().run(script, keys, args)


def on(limiter: Limiter, policy: Policy, node: str, count: int) -> list[str]:
    """``count`` identities whose key under ``policy`` is on ``node``."""
    storage = limiter.storage
    assert isinstance(storage, TwoNodeStorage)
    found = (f"id{n}" for n in itertools.count())
    return list(
        itertools.islice(
            (i for i in found if storage.node_of(limiter.keys(policy, i)[0]) == node), count
        )
    )


class OldStyleRecorder:
    """A hook written before nodes had breakers: only the three original methods."""

    def __init__(self) -> None:
        self.transitions: list[tuple[str, str]] = []

    def decision(self, decision: Decision) -> None:
        pass

    def store_call(self, seconds: float, ok: bool) -> None:
        pass

    def breaker_transition(self, old: BreakerState, new: BreakerState) -> None:
        self.transitions.append((str(old), str(new)))


def _two_nodes(metrics: Any) -> tuple[Limiter, TwoNodeStorage, ManualClock]:
    clock = ManualClock()
    breaker_clock = ManualClock(50.0)
    breaker = CircuitBreaker(consecutive_failures=2, open_for=1.0, probes=1, clock=breaker_clock)
    storage = TwoNodeStorage(clock)
    return Limiter(storage, clock=clock, breaker=breaker, metrics=metrics), storage, breaker_clock


def test_a_dead_node_opens_only_its_own_breaker(caplog: pytest.LogCaptureFixture):
    """Node b dies: its breaker opens after 2 failures and its keys go to the failure mode;
    node a's keys are still decided by the store, its breaker closed. Each node's breaker is
    made like the configured one, named in the metrics hook and the log."""
    caplog.set_level(logging.WARNING, logger="ratekeeper")
    recorder = RecordingMetrics()
    limiter, storage, breaker_clock = _two_nodes(recorder)
    policy = Policy("nodes", "100/minute")
    with limiter:
        assert limiter.breakers == {}
        a, b = on(limiter, policy, "a:1", 3), on(limiter, policy, "b:2", 4)
        assert not limiter.hit(policy, a[0]).degraded
        storage.down_nodes.add("b:2")
        reasons = [limiter.hit(policy, i).reason for i in (*b[:3], *a[1:])]
        assert reasons == ["unavailable/open", "unavailable/open", "breaker_open/open", None, None]
        breakers = limiter.breakers
        assert sorted(breakers) == ["a:1", "b:2"]
        assert (breakers["a:1"].state, breakers["b:2"].state) == ("closed", "open")
        assert limiter.breaker.state == "closed"  # the store's own: no call was unplaced
        assert breakers["b:2"].consecutive_failures == 2  # made like the configured one
        assert breakers["b:2"] is not limiter.breaker
        storage.down_nodes.clear()
        breaker_clock.advance(1.0)
        assert limiter.hit(policy, b[3]).reason is None  # the probe closes it
    assert recorder.nodes == ["a:1", "b:2"]
    assert recorder.transitions == [
        ("b:2", "closed", "open"),
        ("b:2", "open", "half_open"),
        ("b:2", "half_open", "closed"),
    ]
    assert "circuit breaker of b:2 closed -> open" in caplog.text


def test_node_breakers_in_prometheus_and_an_old_style_hook():
    registry = CollectorRegistry()
    limiter, storage, _ = _two_nodes(PrometheusMetrics(registry=registry))
    policy = Policy("nodes", "100/minute")
    with limiter:
        storage.down_nodes.add("b:2")
        for identity in on(limiter, policy, "a:1", 3) + on(limiter, policy, "b:2", 3):
            limiter.hit(policy, identity)
    state = {
        node: registry.get_sample_value("ratekeeper_breaker_state", {"node": node})
        for node in ("", "a:1", "b:2")
    }
    assert state == {"": 0.0, "a:1": 0.0, "b:2": 2.0}
    moved = {"from_state": "closed", "to_state": "open", "node": "b:2"}
    assert registry.get_sample_value("ratekeeper_breaker_transitions_total", moved) == 1.0

    old = OldStyleRecorder()
    limiter, storage, _ = _two_nodes(old)
    with limiter:
        storage.down_nodes.add("a:1")
        for identity in on(limiter, policy, "a:1", 4):
            limiter.hit(policy, identity)
    assert old.transitions == [("closed", "open")]
