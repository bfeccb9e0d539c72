"""The ``ratekeeper`` command line."""

from __future__ import annotations

import json

import click
from rich.console import Console

from . import __version__
from ._bench import BENCH_ALGORITHMS, MODES, BenchConfig, redact, render, run_bench
from ._errors import ConfigError, RatekeeperError, StorageError, StorageTimeout
from ._policy import Policy
from ._rates import MAX_INT, parse_rates

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ratekeeper")
def main() -> None:
    """ratekeeper: exact, atomic, distributed rate limiting on Redis, Valkey or in memory."""


@main.command()
@click.option(
    "--storage",
    default="memory://",
    show_default=True,
    help="Storage URL: memory://, redis://host:port/db, rediss://..., unix://...",
)
@click.option("--rates", default="10 per 5 seconds", show_default=True, help="The demo policy.")
@click.option("--algorithm", default="sliding_log", show_default=True)
@click.option(
    "--duration",
    type=click.FloatRange(1, 600),
    default=10.0,
    show_default=True,
    help="Simulated seconds (the run itself takes about a second).",
)
@click.option("--serve", is_flag=True, help="Serve a sample API behind the ASGI middleware.")
@click.option("--host", default="127.0.0.1", show_default=True, help="With --serve.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
def demo(
    storage: str, rates: str, algorithm: str, duration: float, serve: bool, host: str, port: int
) -> None:
    """Simulate several clients sharing one policy and show what each got.

    With --serve, run a small sample API behind the ASGI middleware instead (needs uvicorn:
    pip install 'ratekeeper[web]').
    """
    if serve:
        _serve(storage, host, port)
        return
    from ._demo import run_demo

    try:
        run_demo(storage, rates, algorithm, duration, Console())
    except RatekeeperError as exc:
        raise click.ClickException(str(exc)) from exc


def _check_rates(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        parse_rates(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


@main.command()
@click.option(
    "--storage",
    default="memory://",
    show_default=True,
    metavar="URL",
    help="Any URL Limiter.from_url takes: memory://, redis://host:port/db, rediss://..., "
    "unix://..., valkey://..., redis+cluster://..., redis+sentinel://...",
)
@click.option(
    "--algorithm", type=click.Choice(BENCH_ALGORITHMS), default="sliding_window", show_default=True
)
@click.option(
    "--rates",
    default="1000 per minute",
    show_default=True,
    callback=_check_rates,
    help="The policy's rates, as in Policy(): '10/second;1000/hour'.",
)
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="sync",
    show_default=True,
    help="sync: threads sharing one Limiter; async: asyncio tasks sharing one AsyncLimiter.",
)
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(1, 1024),
    default=8,
    show_default=True,
    help="Threads (sync) or tasks (async).",
)
@click.option(
    "--keys",
    type=click.IntRange(1, 1_000_000_000),
    default=10_000,
    show_default=True,
    help="Distinct identities, each call picks one at random.",
)
@click.option(
    "--duration",
    type=click.FloatRange(0.1, 3600),
    default=5.0,
    show_default=True,
    help="Seconds measured.",
)
@click.option(
    "--warmup",
    type=click.FloatRange(0, 600),
    default=1.0,
    show_default=True,
    help="Seconds run before measuring (to open connections and load scripts).",
)
@click.option(
    "--cost",
    type=click.IntRange(1, MAX_INT),
    default=1,
    show_default=True,
    help="Cost of each hit.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(0, 60, min_open=True),
    default=None,
    help="Redis and Valkey only: seconds per call and per connect  [default: the limiter's, 0.02]",
)
@click.option(
    "--deny-cache/--no-deny-cache",
    default=True,
    show_default=True,
    help="Answer repeated denials in-process as in production; off times every call on the store.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
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
    if timeout is not None and storage.strip().lower().startswith("memory:"):
        raise click.BadParameter(
            "applies to Redis and Valkey URLs, not memory://", param_hint="'--timeout'"
        )
    try:
        policy = Policy("bench", rates, algorithm)
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
    shown = redact(storage)

    def message(exc: Exception) -> str:  # library messages quote the URL as given
        return str(exc).replace(storage, shown)

    try:
        result = run_bench(config, Console(stderr=True))
    except ConfigError as exc:
        raise click.UsageError(message(exc)) from None
    except StorageError as exc:
        hint = " (a distant or TLS store may need a longer --timeout)"
        raise click.ClickException(
            f"the store at {shown} failed the first call ({type(exc).__name__}): {message(exc)}"
            + (hint if isinstance(exc, StorageTimeout) else "")
        ) from None
    except RatekeeperError as exc:
        raise click.ClickException(
            f"the store at {shown} refused the first call ({type(exc).__name__}): {message(exc)}"
        ) from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        render(result, Console())


def _serve(storage: str, host: str, port: int) -> None:
    try:
        import uvicorn
    except ImportError:
        raise click.ClickException(
            "demo --serve needs uvicorn: pip install 'ratekeeper[web]'"
        ) from None
    from ._demo_app import API, SEARCH, build_app

    try:
        app = build_app(storage)
    except RatekeeperError as exc:
        raise click.ClickException(str(exc)) from exc
    url = f"http://{host}:{port}"
    console = Console()
    console.print(f"[bold]ratekeeper demo API[/bold] on [cyan]{url}[/cyan] (storage {storage})")
    console.print(f"  /api/items   {API.rates[0]} per client IP")
    console.print(f"  /api/search  {SEARCH.rates[0]} per client IP ({SEARCH.algorithm})")
    console.print("  /health      not limited")
    console.print("See a 429 (the sixth request within 10 s is refused):")
    console.print(
        f"  for i in 1 2 3 4 5 6; do curl -s -o /dev/null -w '%{{http_code}}\\n' "
        f"{url}/api/items; done; curl -i {url}/api/items",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")
