"""``ratekeeper serve``: the decision service (Envoy RLS v3 and HTTP JSON)."""

from __future__ import annotations

import sys
from typing import cast

import click

from .._errors import ConfigError
from .._keys import DEFAULT_KEY_PREFIX
from ..typing import FailureMode
from ._main import main
from ._options import STORAGE_ENV, STORAGE_HELP, is_memory, option

# -- the decision service ------------------------------------------------------------------------

_FAILURE_MODES = ("raise", "open", "closed", "local")


def _check_key(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and len(value) < 16:
        raise click.BadParameter("give at least 16 characters (e.g. openssl rand -hex 32)")
    return value


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
@option(
    "--reservation-key",
    env="RATEKEEPER_SERVE_RESERVATION_KEY",
    metavar="SECRET",
    default=None,
    callback=_check_key,
    help="Signs the reservation tokens of POST /reserve (HMAC-SHA256), at least 16 characters; "
    "replicas that settle each other's tokens need the same one. Prefer the variable (a flag "
    "shows in ps)  [default: random, shared by --workers]",
)
@option(
    "--reservation-ttl",
    env="RATEKEEPER_SERVE_RESERVATION_TTL",
    type=click.FloatRange(1, 86400),
    default=600,
    show_default=True,
    help="Seconds within which a reservation token may be settled.",
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
    reservation_key: str | None,
    reservation_ttl: float,
) -> None:
    """Serve rate limit decisions: Envoy's rate limit service (gRPC
    envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit, and the gRPC health service)
    and HTTP (POST /json, /reserve, /settle, GET /healthcheck, /metrics, /rlconfig), configured by
    envoyproxy/ratelimit's YAML. Needs pip install 'ratekeeper[server]'.

    The configuration reloads when its files change (a Kubernetes ConfigMap's symlink swap
    too) and on SIGHUP; a file that fails to load keeps the configuration in force, and the
    error is logged with its file, line and column.
    """
    try:
        from ..service._loader import check_config
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
    if workers > 1 and storage is not None and is_memory(storage):
        raise click.BadParameter(
            "memory:// keeps its state in one process: each worker would admit the whole "
            "limit; name a shared store (redis://, valkey://, ...)",
            param_hint="'--storage'",
        )
    try:
        from ..service._server import ServeOptions
        from ..service._server import serve as run_server
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
        reservation_key=reservation_key,
        reservation_ttl=reservation_ttl,
    )
    try:
        status = run_server(options)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    sys.exit(status)
