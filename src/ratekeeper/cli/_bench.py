"""``ratekeeper bench``: decisions per second on a store, against its floor."""

from __future__ import annotations

import json
from typing import cast

import click
from rich.console import Console

from .._algorithms.policy import Policy
from .._model.errors import ConfigError, RatekeeperError
from .._model.options import Algorithm
from .._model.rates import MAX_INT
from ._bench_ops import BENCH_ALGORITHMS, MODES, BenchConfig, render, run_bench
from ._main import main
from ._options import (
    STORAGE_ENV,
    STORAGE_HELP,
    is_memory,
    json_option,
    option,
    rates_option,
    shown,
    store_error,
)


@main.command()
@option(
    "--storage",
    env=STORAGE_ENV,
    default="memory://",
    show_default=True,
    metavar="URL",
    help=STORAGE_HELP,
)
@option(
    "--algorithm",
    env="RATEKEEPER_ALGORITHM",
    type=click.Choice(BENCH_ALGORITHMS),
    default="sliding_window",
    show_default=True,
)
@rates_option("1000 per minute", "The policy's rates, as in Policy(): '10/second;1000/hour'.")
@option(
    "--mode",
    env="RATEKEEPER_BENCH_MODE",
    type=click.Choice(MODES),
    default="sync",
    show_default=True,
    help="sync: threads sharing one Limiter; async: asyncio tasks sharing one AsyncLimiter.",
)
@option(
    "--concurrency",
    "-c",
    env="RATEKEEPER_BENCH_CONCURRENCY",
    type=click.IntRange(1, 1024),
    default=8,
    show_default=True,
    help="Threads (sync) or tasks (async).",
)
@option(
    "--keys",
    env="RATEKEEPER_BENCH_KEYS",
    type=click.IntRange(1, 1_000_000_000),
    default=10_000,
    show_default=True,
    help="Distinct identities, each call picks one at random.",
)
@option(
    "--duration",
    env="RATEKEEPER_BENCH_DURATION",
    type=click.FloatRange(0.1, 3600),
    default=5.0,
    show_default=True,
    help="Seconds measured.",
)
@option(
    "--warmup",
    env="RATEKEEPER_BENCH_WARMUP",
    type=click.FloatRange(0, 600),
    default=1.0,
    show_default=True,
    help="Seconds run before measuring (to open connections and load scripts).",
)
@option(
    "--cost",
    env="RATEKEEPER_COST",
    type=click.IntRange(1, MAX_INT),
    default=1,
    show_default=True,
    help="Cost of each hit.",
)
@option(
    "--timeout",
    env="RATEKEEPER_TIMEOUT",
    type=click.FloatRange(0, 60, min_open=True),
    default=None,
    help="Redis and Valkey only: seconds per call and per connect  [default: the limiter's, 0.02]",
)
@option(
    "--deny-cache/--no-deny-cache",
    env="RATEKEEPER_BENCH_DENY_CACHE",
    default=True,
    show_default=True,
    help="Answer repeated denials in-process as in production; off times every call on the store.",
)
@json_option
def bench(
    storage: str,
    algorithm: str,
    rates: str,
    mode: str,
    concurrency: int,
    keys: int,
    duration: float,
    warmup: float,
    cost: int,
    timeout: float | None,
    deny_cache: bool,
    as_json: bool,
) -> None:
    """Measure decisions per second and latency on your store.

    Threads sharing one Limiter (--mode sync) or asyncio tasks sharing one AsyncLimiter
    (--mode async) hit random identities under one policy for --warmup, then --duration
    seconds. The results cover the measured window: decisions/s, the admitted and denied
    shares, errors, and per-decision latency percentiles (in async mode, latency includes
    waiting for the event loop). One process is measured; run several to load a store fully.

    Store failures are counted as errors, never turned into decisions (failure_mode="raise"),
    and the circuit breaker never opens, so every call the deny cache does not answer reaches
    the store.
    The bench writes only under its own key prefix, ratekeeper-bench:<random>, so it never
    touches your keys, and needs no clean-up: every key ratekeeper writes has a TTL (its
    longest period plus one second).
    """
    if timeout is not None and is_memory(storage):
        raise click.BadParameter(
            "applies to Redis and Valkey URLs, not memory://", param_hint="'--timeout'"
        )
    try:
        policy = Policy("bench", rates, cast("Algorithm", algorithm))  # checked there
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    config = BenchConfig(
        storage=storage,
        policy=policy,
        mode=mode,
        concurrency=concurrency,
        keys=keys,
        duration=duration,
        warmup=warmup,
        cost=cost,
        timeout=timeout,
        deny_cache=deny_cache,
    )
    try:
        result = run_bench(config, Console(stderr=True))
    except ConfigError as exc:
        raise click.UsageError(shown(storage, exc)) from None
    except RatekeeperError as exc:
        raise store_error(storage, exc, "the first call", click.ClickException) from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        render(result, Console())
