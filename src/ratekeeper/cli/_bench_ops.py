"""``ratekeeper bench``: decisions per second and per-decision latency against a real store.

``concurrency`` threads sharing one :class:`Limiter` (``mode="sync"``) or asyncio tasks sharing
one :class:`AsyncLimiter` (``mode="async"``) call ``hit`` on identities drawn at random from
``keys`` for ``warmup + duration`` seconds. Only calls that *start* inside the measured window
count, so calls in flight at either edge balance out and decisions/s is their number over the
window. Each call is timed with ``perf_counter_ns`` into a :class:`LatencyHistogram`.

The limiter uses ``failure_mode="raise"``: a store failure is counted as an error of its type,
never turned into an invented decision. Its circuit breaker never opens, so every call that
the deny cache does not answer reaches the store. Keys live under a fresh
``ratekeeper-bench:<random>`` prefix, so the bench never touches real keys, and every key
ratekeeper writes has a TTL, so there is nothing to clean up.

The two drivers (threads and tasks) only loop and time; counting lives in ``_Tally``, the
figures in :class:`BenchResult`, and the drawing in :func:`render`.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .._algorithms.policy import Policy
from .._engine.breaker import CircuitBreaker
from .._limiters.limiter import AsyncLimiter, Limiter
from .._model.decision import Decision
from .._model.errors import RatekeeperError
from .._storage.base import redact
from ._histogram import LatencyHistogram

__all__ = [
    "BENCH_ALGORITHMS",
    "MODES",
    "PERCENTILES",
    "BenchConfig",
    "BenchResult",
    "LatencyHistogram",
    "redact",
    "render",
    "run_bench",
]

#: The algorithms ``hit`` takes (``concurrency`` policies take leases instead).
BENCH_ALGORITHMS = ("sliding_log", "sliding_window", "fixed_window", "gcra", "token_bucket")
MODES = ("sync", "async")
#: Reported latency percentiles: (label, fraction), nearest-rank.
PERCENTILES = (
    ("p50", Fraction(1, 2)),
    ("p90", Fraction(9, 10)),
    ("p99", Fraction(99, 100)),
    ("p99.9", Fraction(999, 1000)),
)

_REFRESH = 0.25  # seconds between progress updates
_NEVER = 2**62  # a call count no run reaches
_YIELD_EVERY = 32  # async: yield to the loop this often, for stores that never suspend (memory)

# -- configuration and result --------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. ``timeout`` (Redis only) is the per-call and connect deadline; None
    keeps the limiter's default."""

    storage: str
    policy: Policy
    mode: str = "sync"
    concurrency: int = 8
    keys: int = 10_000
    duration: float = 5.0
    warmup: float = 1.0
    cost: int = 1
    timeout: float | None = None
    deny_cache: bool = True


class _Tally:
    """What one worker saw in the measured window."""

    __slots__ = ("admitted", "degraded", "denied", "deny_cache", "errors", "latency")

    def __init__(self) -> None:
        self.admitted = 0
        self.denied = 0
        self.degraded = 0
        self.deny_cache = 0
        self.errors: dict[str, int] = {}
        self.latency = LatencyHistogram()

    def decided(self, decision: Decision, ns: int) -> None:
        if decision.allowed:
            self.admitted += 1
        else:
            self.denied += 1
        if decision.degraded:
            self.degraded += 1
        elif decision.reason == "deny_cache":
            self.deny_cache += 1
        self.latency.record(ns)

    def failed(self, exc: RatekeeperError) -> None:
        name = type(exc).__name__
        self.errors[name] = self.errors.get(name, 0) + 1


@dataclass(frozen=True)
class BenchResult:
    """The figures of one run. ``decisions`` = ``admitted + denied``; errors are calls that
    raised instead (store failures under ``failure_mode="raise"``) and are not decisions."""

    config: BenchConfig
    storage: str  # the URL with any password masked
    key_prefix: str
    decisions: int
    admitted: int
    denied: int
    errors: dict[str, int]
    degraded: int
    deny_cache_hits: int
    latency: LatencyHistogram

    @classmethod
    def from_tallies(
        cls, config: BenchConfig, key_prefix: str, tallies: Iterable[_Tally]
    ) -> BenchResult:
        latency = LatencyHistogram()
        admitted = denied = degraded = deny_cache = 0
        errors: dict[str, int] = {}
        for tally in tallies:
            admitted += tally.admitted
            denied += tally.denied
            degraded += tally.degraded
            deny_cache += tally.deny_cache
            for name, n in tally.errors.items():
                errors[name] = errors.get(name, 0) + n
            latency.merge(tally.latency)
        return cls(
            config=config,
            storage=redact(config.storage),
            key_prefix=key_prefix,
            decisions=admitted + denied,
            admitted=admitted,
            denied=denied,
            errors=dict(sorted(errors.items())),
            degraded=degraded,
            deny_cache_hits=deny_cache,
            latency=latency,
        )

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def decisions_per_second(self) -> float:
        return self.decisions / self.config.duration

    @property
    def admitted_pct(self) -> float | None:
        return 100 * self.admitted / self.decisions if self.decisions else None

    @property
    def denied_pct(self) -> float | None:
        return 100 * self.denied / self.decisions if self.decisions else None

    def latency_us(self) -> dict[str, float] | None:
        """min, the percentiles, max and mean in microseconds; None without decisions."""
        histogram = self.latency
        if histogram.count == 0:
            return None
        figures = {"min": histogram.min / 1000}
        for label, fraction in PERCENTILES:
            figures[label] = histogram.percentile(fraction) / 1000
        figures["max"] = histogram.max / 1000
        figures["mean"] = histogram.mean / 1000
        return figures

    def to_dict(self) -> dict[str, Any]:
        """Everything, for ``--json``: counts as ints, rates per second, latencies in us."""
        config = self.config
        latency = self.latency_us()
        return {
            "storage": self.storage,
            "key_prefix": self.key_prefix,
            "mode": config.mode,
            "concurrency": config.concurrency,
            "algorithm": config.policy.algorithm,
            "rates": [str(rate) for rate in config.policy.rates],
            "keys": config.keys,
            "cost": config.cost,
            "deny_cache": config.deny_cache,
            "warmup_s": config.warmup,
            "duration_s": config.duration,
            "decisions": self.decisions,
            "decisions_per_s": round(self.decisions_per_second, 1),
            "admitted": self.admitted,
            "denied": self.denied,
            "admitted_pct": _round(self.admitted_pct, 3),
            "denied_pct": _round(self.denied_pct, 3),
            "errors": self.error_count,
            "errors_by_type": self.errors,
            "degraded": self.degraded,
            "deny_cache_hits": self.deny_cache_hits,
            "latency_us": None
            if latency is None
            else {label: round(value, 3) for label, value in latency.items()},
        }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


# -- the drivers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Window:
    """The run's schedule in ``perf_counter_ns``: warm up until ``measure_from``, stop at
    ``until``."""

    measure_from: int
    until: int

    @classmethod
    def starting_now(cls, config: BenchConfig) -> _Window:
        now = time.perf_counter_ns()
        measure_from = now + round(config.warmup * 1e9)
        return cls(measure_from, measure_from + round(config.duration * 1e9))


def _never_open() -> CircuitBreaker:
    """A breaker that never opens: every call reaches the store. The default one would open on
    an overloaded client (its slow-call share counts the client's own queueing) and answer the
    rest of the run locally, measuring nothing."""
    return CircuitBreaker(min_calls=_NEVER, consecutive_failures=_NEVER)


def _options(config: BenchConfig, key_prefix: str) -> dict[str, Any]:
    options: dict[str, Any] = {
        "key_prefix": key_prefix,
        "failure_mode": "raise",
        "breaker": _never_open(),
        "deny_cache": 10_000 if config.deny_cache else 0,
    }
    if config.timeout is not None:
        options["timeout"] = config.timeout
        options["connect_timeout"] = config.timeout
    return options


#: Called every _REFRESH seconds with the workers' tallies, to show progress.
_OnProgress = Callable[[list[_Tally]], None]


def _sync_worker(
    limiter: Limiter, config: BenchConfig, window: _Window, tally: _Tally, rng: random.Random
) -> None:
    hit, policy, cost, keys = limiter.hit, config.policy, config.cost, config.keys
    clock, measure_from, until = time.perf_counter_ns, window.measure_from, window.until
    while True:
        identity = rng.randrange(keys)
        started = clock()
        if started >= until:
            return
        try:
            decision = hit(policy, identity, cost)
        except RatekeeperError as exc:
            if started >= measure_from:
                tally.failed(exc)
            continue
        ended = clock()
        if started >= measure_from:
            tally.decided(decision, ended - started)


def _run_sync(config: BenchConfig, key_prefix: str, progress: _OnProgress) -> list[_Tally]:
    with Limiter.from_url(config.storage, **_options(config, key_prefix)) as limiter:
        # Connects, loads the script, and fails here, cleanly, if the store cannot be reached.
        limiter.peek(config.policy, "preflight", config.cost)
        tallies = [_Tally() for _ in range(config.concurrency)]
        ready = threading.Barrier(config.concurrency + 1)
        schedule: list[_Window] = []  # set before the barrier lets the workers go
        failures: list[BaseException] = []

        def work(tally: _Tally, seed: int) -> None:
            try:
                ready.wait()
                _sync_worker(limiter, config, schedule[0], tally, random.Random(seed))
            except BaseException as exc:  # re-raised in the main thread
                failures.append(exc)

        threads = [
            threading.Thread(
                target=work, args=(tally, seed), name=f"ratekeeper-bench-{seed}", daemon=True
            )
            for seed, tally in enumerate(tallies)
        ]
        try:
            for thread in threads:
                thread.start()
            schedule.append(_Window.starting_now(config))
            ready.wait()
        except BaseException:
            ready.abort()
            raise
        for thread in threads:
            while thread.is_alive():
                progress(tallies)
                thread.join(_REFRESH)
        if failures:
            raise failures[0]
        return tallies


async def _async_worker(
    limiter: AsyncLimiter,
    config: BenchConfig,
    window: _Window,
    tally: _Tally,
    rng: random.Random,
) -> None:
    hit, policy, cost, keys = limiter.hit, config.policy, config.cost, config.keys
    clock, measure_from, until = time.perf_counter_ns, window.measure_from, window.until
    calls = 0
    while True:
        calls += 1
        if calls % _YIELD_EVERY == 0:
            await asyncio.sleep(0)  # outside the timed call
        identity = rng.randrange(keys)
        started = clock()
        if started >= until:
            return
        try:
            decision = await hit(policy, identity, cost)
        except RatekeeperError as exc:
            if started >= measure_from:
                tally.failed(exc)
            continue
        ended = clock()
        if started >= measure_from:
            tally.decided(decision, ended - started)


async def _run_async(config: BenchConfig, key_prefix: str, progress: _OnProgress) -> list[_Tally]:
    async with AsyncLimiter.from_url(config.storage, **_options(config, key_prefix)) as limiter:
        await limiter.peek(config.policy, "preflight", config.cost)
        tallies = [_Tally() for _ in range(config.concurrency)]
        window = _Window.starting_now(config)
        tasks = [
            asyncio.create_task(_async_worker(limiter, config, window, tally, random.Random(seed)))
            for seed, tally in enumerate(tallies)
        ]
        try:
            pending: set[asyncio.Task[None]] = set(tasks)
            while pending:
                progress(tallies)
                _, pending = await asyncio.wait(pending, timeout=_REFRESH)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            task.result()  # a worker's unexpected exception
        return tallies


def run_bench(config: BenchConfig, console: Console | None = None) -> BenchResult:
    """Run the benchmark, showing a progress bar on ``console`` if it is a terminal.

    Raises ConfigError for a bad URL or option, and StorageError (or RequestRejected) when the
    store fails the first call, made before any measurement; failures during the run are
    counted instead.
    """
    key_prefix = f"ratekeeper-bench:{secrets.token_hex(4)}"
    total = config.warmup + config.duration
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
    )
    # Only on a terminal: piped or captured, a progress bar is noise.
    disable = console is None or not console.is_terminal
    with Progress(
        *columns, console=console, transient=True, auto_refresh=False, disable=disable
    ) as bar:
        task = bar.add_task("connecting", total=total, status="")
        started = time.perf_counter()

        def progress(tallies: list[_Tally]) -> None:
            elapsed = time.perf_counter() - started
            if elapsed < config.warmup:
                bar.update(task, completed=elapsed, description="warming up", status="")
            else:
                decisions = sum(t.admitted + t.denied for t in tallies)
                errors = sum(sum(t.errors.values()) for t in tallies)
                status = f"{decisions:,} decisions" + (f", {errors:,} errors" if errors else "")
                bar.update(task, completed=min(elapsed, total), description="measuring")
                bar.update(task, status=status)
            bar.refresh()

        if config.mode == "async":
            tallies = asyncio.run(_run_async(config, key_prefix, progress))
        else:
            tallies = _run_sync(config, key_prefix, progress)
    return BenchResult.from_tallies(config, key_prefix, tallies)


# -- output --------------------------------------------------------------------------------------


def _us(value: float) -> str:
    return f"{value:,.1f} µs"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def render(result: BenchResult, console: Console) -> None:
    """Print the result as a table."""
    config = result.config
    rates = "; ".join(str(rate) for rate in config.policy.rates)
    workers = "threads" if config.mode == "sync" else "asyncio tasks"
    console.print(
        f"[bold]ratekeeper bench[/bold]: {escape(config.policy.algorithm)} "
        f"[cyan]{escape(rates)}[/cyan] on [cyan]{escape(result.storage)}[/cyan], "
        f"{config.mode} with {config.concurrency} {workers}, {config.keys:,} keys, "
        f"cost {config.cost}; measured {config.duration:g} s after a {config.warmup:g} s warm-up",
        soft_wrap=True,
    )
    table = Table(box=box.SIMPLE, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("decisions", f"{result.decisions:,}")
    table.add_row("decisions/s", f"{result.decisions_per_second:,.0f}")
    table.add_row("admitted", f"{result.admitted:,} ({_pct(result.admitted_pct)})")
    table.add_row("denied", f"{result.denied:,} ({_pct(result.denied_pct)})")
    errors = f"{result.error_count:,}"
    if result.errors:
        kinds = ", ".join(f"{name} {n:,}" for name, n in result.errors.items())
        errors = f"[red]{errors}[/red] ({kinds})"
    table.add_row("errors", errors)
    table.add_row("degraded", f"{result.degraded:,}")
    table.add_row("deny cache", f"{result.deny_cache_hits:,}" if config.deny_cache else "off")
    latency = result.latency_us()
    for label in ("min", *(label for label, _ in PERCENTILES), "max"):
        table.add_row(f"latency {label}", "-" if latency is None else _us(latency[label]))
    console.print(table)
    notes = []
    if result.deny_cache_hits:
        notes.append(
            f"{result.deny_cache_hits:,} denials were answered by the in-process deny cache "
            "without a store call (--no-deny-cache times every call on the store)."
        )
    if result.errors:
        notes.append(
            "[red]Errors are calls that raised instead of deciding; they are not decisions.[/red]"
        )
    if "StorageTimeout" in result.errors:
        deadline = "the limiter's 0.02" if config.timeout is None else f"{config.timeout:g}"
        notes.append(
            f"StorageTimeout: no reply within {deadline} s (--timeout). The wait includes the "
            "client's own queueing, so too much concurrency for one process causes it too."
        )
    if notes:
        console.print("\n".join(notes))
