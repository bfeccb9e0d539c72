"""The ``ratekeeper`` command line."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import click
from rich.console import Console

from ._admin import (
    ADMIN_ALGORITHMS,
    DEFAULT_TIMEOUT,
    EXIT_ALLOWED,
    EXIT_DENIED,
    EXIT_STORE_FAILED,
    Action,
    StoreFailed,
    decide,
    decision_record,
    exit_code,
    key_listing,
    open_limiter,
    render_decisions,
    render_keys,
    render_reset,
)
from ._admin import reset as reset_identities
from ._bench import BENCH_ALGORITHMS, MODES, BenchConfig, redact, render, run_bench
from ._errors import ConfigError, RatekeeperError, StorageError, StorageTimeout
from ._keys import DEFAULT_KEY_PREFIX
from ._limiter import Limiter
from ._policy import Policy
from ._rates import MAX_INT, parse_rates
from ._version import __version__
from .typing import Algorithm, FailureMode

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ratekeeper")
def main() -> None:
    """ratekeeper: exact, atomic, distributed rate limiting on Redis, Valkey or in memory.

    Every option can also be set in the environment: the ones several commands share as
    RATEKEEPER_<OPTION> (RATEKEEPER_STORAGE, or RATEKEEPER_STORAGE_URL as the library reads it;
    RATEKEEPER_POLICY, RATEKEEPER_RATES, RATEKEEPER_ALGORITHM, ...), the others as
    RATEKEEPER_<COMMAND>_<OPTION> (RATEKEEPER_BENCH_MODE). Each command's --help names them. A
    flag beats the variable.
    """


STORAGE_ENV = ("RATEKEEPER_STORAGE", "RATEKEEPER_STORAGE_URL")
STORAGE_HELP = (
    "Any URL Limiter.from_url takes: memory://, redis://host:port/db, rediss://..., "
    "unix://..., valkey://..., redis+cluster://..., redis+sentinel://..."
)


def option(*decls: str, env: str | tuple[str, ...], **attrs: Any) -> Callable[[_F], _F]:
    """``click.option`` read from the environment variable(s) ``env`` when the flag is absent,
    shown in ``--help``."""
    return click.option(*decls, envvar=env, show_envvar=True, **attrs)


def _check_rates(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        try:
            parse_rates(value)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None
    return value


def _rates_option(default: str | None, help: str) -> Callable[[_F], _F]:
    return option(
        "--rates",
        env="RATEKEEPER_RATES",
        default=default,
        required=default is None,
        show_default=default is not None,
        callback=_check_rates,
        help=help,
    )


_json_option = option(
    "--json", "as_json", env="RATEKEEPER_JSON", is_flag=True, help="Print JSON on stdout."
)


@main.command()
@option("--storage", env=STORAGE_ENV, default="memory://", show_default=True, help=STORAGE_HELP)
@_rates_option("10 per 5 seconds", "The demo policy.")
@option("--algorithm", env="RATEKEEPER_ALGORITHM", default="sliding_log", show_default=True)
@option(
    "--duration",
    env="RATEKEEPER_DEMO_DURATION",
    type=click.FloatRange(1, 600),
    default=10.0,
    show_default=True,
    help="Simulated seconds (the run itself takes about a second).",
)
@option(
    "--serve",
    env="RATEKEEPER_DEMO_SERVE",
    is_flag=True,
    help="Serve a sample API behind the ASGI middleware.",
)
@option(
    "--host",
    env="RATEKEEPER_DEMO_HOST",
    default="127.0.0.1",
    show_default=True,
    help="With --serve.",
)
@option(
    "--port",
    env="RATEKEEPER_DEMO_PORT",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="With --serve.",
)
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
@_rates_option("1000 per minute", "The policy's rates, as in Policy(): '10/second;1000/hour'.")
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
@_json_option
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
    if timeout is not None and _is_memory(storage):
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
        raise click.UsageError(_shown(storage, exc)) from None
    except RatekeeperError as exc:
        raise _store_error(storage, exc, "the first call", click.ClickException) from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        render(result, Console())


def _is_memory(storage: str) -> bool:
    return storage.strip().lower().startswith("memory:")


def _shown(storage: str, exc: Exception) -> str:
    """The error's message with the URL's password masked (library messages quote it)."""
    return str(exc).replace(storage, redact(storage))


class StoreFailure(click.ClickException):
    """The store failed or refused a call: exit status 3."""

    exit_code = EXIT_STORE_FAILED


def _store_error(
    storage: str, exc: RatekeeperError, call: str, kind: type[click.ClickException]
) -> click.ClickException:
    """One line naming the store (password masked), the call and what went wrong."""
    verb = "failed" if isinstance(exc, StorageError) else "refused"
    hint = (
        " (a distant or TLS store may need a longer --timeout)"
        if isinstance(exc, StorageTimeout)
        else ""
    )
    return kind(
        f"the store at {redact(storage)} {verb} {call} ({type(exc).__name__}): "
        f"{_shown(storage, exc)}{hint}"
    )


# -- admin commands ------------------------------------------------------------------------------

_EXITS = (
    f"Exit status: {EXIT_ALLOWED} every identity allowed (or done), {EXIT_DENIED} any denied, "
    "2 bad usage or configuration (a bad URL, rates, algorithm, policy name or identity), "
    f"{EXIT_STORE_FAILED} the store failed or refused a call (the message names the identity; "
    "identities before it were already done). The limiter runs with failure_mode='raise' and "
    "no deny cache: every answer is the store's, never one a failure mode made up."
)


def _admin_options(*, algorithms: tuple[str, ...], calls_store: bool) -> Callable[[_F], _F]:
    """The options that name the store and the policy, shared by the admin commands; those
    that call the store also take --timeout (and refuse memory://)."""
    decorators = [
        option(
            "--storage",
            env=STORAGE_ENV,
            required=True,
            metavar="URL",
            help=STORAGE_HELP
            + (" (not memory://, which lives in one process)." if calls_store else ""),
        ),
        option(
            "--policy",
            env="RATEKEEPER_POLICY",
            required=True,
            metavar="NAME",
            help="The policy's name, as the application names it.",
        ),
        _rates_option(None, "The policy's rates, as the application gives them: '10/second'."),
        option(
            "--algorithm",
            env="RATEKEEPER_ALGORITHM",
            type=click.Choice(algorithms),
            default="sliding_log",
            show_default=True,
            help="The policy's algorithm.",
        ),
        option(
            "--burst",
            env="RATEKEEPER_BURST",
            type=click.IntRange(1, MAX_INT),
            default=None,
            help="gcra / token_bucket: the policy's burst  [default: the limit]",
        ),
        option(
            "--key-prefix",
            env="RATEKEEPER_KEY_PREFIX",
            default=DEFAULT_KEY_PREFIX,
            show_default=True,
            help="The limiter's key_prefix.",
        ),
    ]
    if calls_store:
        decorators.append(
            option(
                "--timeout",
                env="RATEKEEPER_TIMEOUT",
                type=click.FloatRange(0, 60, min_open=True),
                default=DEFAULT_TIMEOUT,
                show_default=True,
                help="Seconds per store call and per connect.",
            )
        )
    decorators.append(click.argument("identities", metavar="IDENTITY...", nargs=-1, required=True))

    def apply(f: _F) -> _F:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


_COST = option(
    "--cost",
    env="RATEKEEPER_COST",
    type=click.IntRange(1, MAX_INT),
    default=1,
    show_default=True,
    help="The cost to check (peek) or spend (hit).",
)


@dataclass(frozen=True)
class _Target:
    """The store and the policy an admin command works on."""

    storage: str
    policy: Policy
    key_prefix: str


def _target(
    storage: str, policy: str, rates: str, algorithm: str, burst: int | None, key_prefix: str
) -> _Target:
    try:
        chosen = cast("Algorithm", algorithm)  # checked by Policy
        return _Target(storage, Policy(policy, rates, chosen, burst=burst), key_prefix)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _open(target: _Target, timeout: float | None) -> Limiter:
    """The admin limiter; ``timeout=None`` for a command that never calls the store."""
    memory = _is_memory(target.storage)
    if memory and timeout is not None:
        raise click.BadParameter(
            "memory:// keeps its state inside one process; name the shared store "
            "(redis://, valkey://, ...)",
            param_hint="'--storage'",
        )
    try:
        return open_limiter(
            target.storage, key_prefix=target.key_prefix, timeout=None if memory else timeout
        )
    except ConfigError as exc:
        raise click.UsageError(_shown(target.storage, exc)) from None


_T = TypeVar("_T")


def _admin_call(target: _Target, run: Callable[[Limiter], _T], timeout: float | None) -> _T:
    """``run(limiter)``, with bad input as a usage error and a store failure as exit status 3."""
    try:
        with _open(target, timeout) as limiter:
            return run(limiter)
    except ConfigError as exc:
        raise click.UsageError(_shown(target.storage, exc)) from None
    except StoreFailed as exc:
        before = f"; {exc.done} before it done" if exc.done else ""
        raise _store_error(
            target.storage, exc.cause, f"the call for {exc.identity!r}{before}", StoreFailure
        ) from None


def _echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2))


_DECISION_OUTPUT = """
    Prints each identity's decision (allowed, limit, remaining, reset after, retry after) as a
    table, or with --json a list of objects: identity, allowed, limit, remaining, reset_after,
    retry_after (seconds; null when allowed, and when the cost exceeds a limit and can never
    pass, which sets exceeds_limit), exceeds_limit, cost, policy, rate, degraded, reason.
"""


def _decision_command(action: Action, summary: str) -> None:
    """Register ``peek`` or ``hit``: the same options and output, one verb apart."""

    def command(
        timeout: float, cost: int, as_json: bool, identities: tuple[str, ...], **target: Any
    ) -> None:
        chosen = _target(**target)
        decisions = _admin_call(
            chosen,
            lambda limiter: decide(limiter, action, chosen.policy, identities, cost),
            timeout,
        )
        if as_json:
            _echo_json(
                [decision_record(i, d, cost) for i, d in zip(identities, decisions, strict=True)]
            )
        else:
            shown = redact(chosen.storage)
            render_decisions(Console(), action, chosen.policy, shown, identities, decisions, cost)
        sys.exit(exit_code(decisions))

    command.__doc__ = summary + "\n" + _DECISION_OUTPUT
    decorated = _json_option(
        _COST(_admin_options(algorithms=BENCH_ALGORITHMS, calls_store=True)(command))
    )
    main.command(action, epilog=_EXITS)(decorated)


_decision_command(
    "peek", "Show whether a hit of --cost would pass now for each IDENTITY, consuming nothing."
)
_decision_command(
    "hit",
    "Spend --cost for each IDENTITY, as the application would, and show "
    "the decisions (a denial changes nothing).",
)


@main.command(epilog=_EXITS)
@_admin_options(algorithms=ADMIN_ALGORITHMS, calls_store=True)
@_json_option
def reset(timeout: float, as_json: bool, identities: tuple[str, ...], **target: Any) -> None:
    """Forget what each IDENTITY has consumed under the policy (unblock it).

    Prints the keys deleted for each identity; with --json a list of objects: identity, reset
    (true) and keys.
    """
    chosen = _target(**target)
    done = _admin_call(
        chosen, lambda limiter: reset_identities(limiter, chosen.policy, identities), timeout
    )
    if as_json:
        _echo_json([{"identity": i, "reset": True, "keys": list(keys)} for i, keys in done])
    else:
        render_reset(Console(), chosen.policy, redact(chosen.storage), done)


@main.command()
@_admin_options(algorithms=ADMIN_ALGORITHMS, calls_store=False)
@_json_option
def keys(as_json: bool, identities: tuple[str, ...], **target: Any) -> None:
    """Show the store keys that hold each IDENTITY's state under the policy (Limiter.keys).

    Nothing is sent to the store, so memory:// will do. With --json, a list of objects:
    identity and keys. Exit status 0, or 2 for bad usage or configuration.
    """
    chosen = _target(**target)
    rows = _admin_call(
        chosen, lambda limiter: key_listing(limiter, chosen.policy, identities), None
    )
    if as_json:
        _echo_json([{"identity": i, "keys": list(k)} for i, k in rows])
    else:
        render_keys(Console(), rows)


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


# -- the decision service ------------------------------------------------------------------------

_FAILURE_MODES = ("raise", "open", "closed", "local")


@main.command(epilog="Exit status: 0 stopped (or the files are valid), 1 invalid files "
              "(--check), 2 bad usage or configuration.")  # fmt: skip
@option(
    "--config",
    env="RATEKEEPER_SERVE_CONFIG",
    metavar="PATH",
    type=click.Path(exists=True),
    help="A YAML file, or a directory of them (one domain each), in envoyproxy/ratelimit's form.",
)
@option(
    "--check",
    env="RATEKEEPER_SERVE_CHECK",
    metavar="PATH",
    type=click.Path(exists=True),
    help="Validate PATH (a file or a directory), print what is wrong and where, and exit.",
)
@option(
    "--portable",
    env="RATEKEEPER_SERVE_PORTABLE",
    is_flag=True,
    help="With --check or --config: refuse ratekeeper's extensions, so the files stay loadable "
    "by envoyproxy/ratelimit.",
)
@option("--storage", env=STORAGE_ENV, default=None, metavar="URL", help=STORAGE_HELP)
@option(
    "--host", env="RATEKEEPER_SERVE_HOST", default="0.0.0.0", show_default=True, help="Bind here."
)
@option(
    "--grpc-port",
    env="RATEKEEPER_SERVE_GRPC_PORT",
    type=click.IntRange(0, 65535),
    default=8081,
    show_default=True,
)
@option(
    "--http-port",
    env="RATEKEEPER_SERVE_HTTP_PORT",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
)
@option(
    "--workers",
    env="RATEKEEPER_SERVE_WORKERS",
    type=click.IntRange(1, 256),
    default=1,
    show_default=True,
    help="Processes serving the same ports (SO_REUSEPORT); they share only the store.",
)
@option(
    "--failure-mode",
    env="RATEKEEPER_SERVE_FAILURE_MODE",
    type=click.Choice(_FAILURE_MODES),
    default="raise",
    show_default=True,
    help="When the store fails: raise answers UNAVAILABLE (HTTP 503), so Envoy's own "
    "failure_mode_deny decides, as with envoyproxy/ratelimit; open allows, closed denies, "
    "local decides in-process.",
)
@option(
    "--timeout",
    env="RATEKEEPER_TIMEOUT",
    type=click.FloatRange(0, 60, min_open=True),
    default=None,
    help="Redis and Valkey only: seconds per store call and per connect  [default: 0.02]",
)
@option(
    "--key-prefix",
    env="RATEKEEPER_KEY_PREFIX",
    default=DEFAULT_KEY_PREFIX,
    show_default=True,
    help="The prefix of every store key.",
)
@option(
    "--response-headers",
    env="RATEKEEPER_SERVE_RESPONSE_HEADERS",
    is_flag=True,
    help="Add the IETF RateLimit and RateLimit-Policy fields to response_headers_to_add.",
)
@option(
    "--reload-interval",
    env="RATEKEEPER_SERVE_RELOAD_INTERVAL",
    type=click.FloatRange(0.01, 60),
    default=0.25,
    show_default=True,
    help="Seconds between looks at the configuration files (changes, symlink swaps).",
)
def serve(
    config: str | None,
    check: str | None,
    portable: bool,
    storage: str | None,
    host: str,
    grpc_port: int,
    http_port: int,
    workers: int,
    failure_mode: str,
    timeout: float | None,
    key_prefix: str,
    response_headers: bool,
    reload_interval: float,
) -> None:
    """Serve rate limit decisions: Envoy's rate limit service (gRPC
    envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit, and the gRPC health service)
    and HTTP (POST /json, GET /healthcheck, /metrics, /rlconfig), configured by
    envoyproxy/ratelimit's YAML. Needs pip install 'ratekeeper[server]'.

    The configuration reloads when its files change (a Kubernetes ConfigMap's symlink swap
    too) and on SIGHUP; a file that fails to load keeps the configuration in force, and the
    error is logged with its file, line and column.
    """
    try:
        from .service._loader import check_config
    except ImportError as exc:
        raise click.ClickException(
            f"serve needs the server extra: pip install 'ratekeeper[server]' ({exc})"
        ) from None
    if check is not None:
        try:
            summary = check_config(check, portable=portable)
        except ConfigError as exc:
            click.echo(str(exc), err=True)
            sys.exit(1)
        click.echo(summary)
        return
    if config is None:
        raise click.UsageError("give --config PATH (or --check PATH)")
    if workers > 1 and storage is not None and _is_memory(storage):
        raise click.BadParameter(
            "memory:// keeps its state in one process: each worker would admit the whole "
            "limit; name a shared store (redis://, valkey://, ...)",
            param_hint="'--storage'",
        )
    try:
        from .service._server import ServeOptions
        from .service._server import serve as run_server
    except ImportError as exc:
        raise click.ClickException(
            f"serve needs the server extra: pip install 'ratekeeper[server]' ({exc})"
        ) from None
    options = ServeOptions(
        config=config,
        storage=storage,
        host=host,
        grpc_port=grpc_port,
        http_port=http_port,
        workers=workers,
        failure_mode=cast("FailureMode", failure_mode),
        timeout=timeout,
        key_prefix=key_prefix,
        response_headers=response_headers,
        reload_interval=reload_interval,
        portable=portable,
    )
    try:
        status = run_server(options)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    sys.exit(status)
