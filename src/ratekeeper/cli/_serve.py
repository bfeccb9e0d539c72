"""``ratekeeper serve``: the decision service (Envoy RLS v3 and HTTP JSON)."""

from __future__ import annotations

import sys
from typing import cast

import click

from .._engine.keys import DEFAULT_KEY_PREFIX
from .._model.errors import ConfigError
from .._model.options import FailureMode
from ._main import main
from ._options import STORAGE_ENV, STORAGE_HELP, is_memory, option
from ._serve_options import ServeCommand, check_key, grpc_tls_of, header_option

# -- the decision service ------------------------------------------------------------------------

_FAILURE_MODES = ("raise", "open", "closed", "local")


@main.command(cls=ServeCommand, epilog="Exit status: 0 stopped (or the files are valid), "
              "1 invalid files (--check), 2 bad usage or configuration.")  # fmt: skip
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
    "--grpc-host",
    env="RATEKEEPER_SERVE_GRPC_HOST",
    default=None,
    help="Bind gRPC here instead of --host (upstream's GRPC_HOST).",
)
@option(
    "--grpc-uds",
    env="RATEKEEPER_SERVE_GRPC_UDS",
    metavar="PATH",
    default=None,
    help="Serve gRPC on this unix socket instead of TCP (upstream's GRPC_UDS); one worker.",
)
@option(
    "--grpc-tls-cert",
    env="RATEKEEPER_SERVE_GRPC_TLS_CERT",
    metavar="PEM",
    type=click.Path(exists=True, dir_okay=False),
    help="Serve gRPC over TLS with this certificate chain (with --grpc-tls-key); reloaded when "
    "it changes.",
)
@option(
    "--grpc-tls-key",
    env="RATEKEEPER_SERVE_GRPC_TLS_KEY",
    metavar="PEM",
    type=click.Path(exists=True, dir_okay=False),
    help="The private key of --grpc-tls-cert.",
)
@option(
    "--grpc-tls-client-ca",
    env="RATEKEEPER_SERVE_GRPC_TLS_CLIENT_CA",
    metavar="PEM",
    type=click.Path(exists=True, dir_okay=False),
    help="Require client certificates issued by this CA (mTLS).",
)
@option(
    "--grpc-tls-client-san",
    env="RATEKEEPER_SERVE_GRPC_TLS_CLIENT_SAN",
    metavar="NAME",
    default=None,
    help="With --grpc-tls-client-ca: refuse (UNAUTHENTICATED) calls whose client certificate "
    "does not name NAME among its subject alternative names.",
)
@option(
    "--grpc-max-connection-age",
    env="RATEKEEPER_SERVE_GRPC_MAX_CONNECTION_AGE",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Seconds after which a gRPC connection is closed with GOAWAY, so clients reconnect "
    "and spread over new replicas  [default: never]",
)
@option(
    "--grpc-max-connection-age-grace",
    env="RATEKEEPER_SERVE_GRPC_MAX_CONNECTION_AGE_GRACE",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Seconds a connection's calls may take to finish after its GOAWAY.",
)
@option(
    "--log-level",
    env="RATEKEEPER_SERVE_LOG_LEVEL",
    type=click.Choice(("debug", "info", "warning", "error", "critical")),
    default=None,
    help="Log at this level  [default: warnings, and the service's reloads]",
)
@option(
    "--log-format",
    env="RATEKEEPER_SERVE_LOG_FORMAT",
    type=click.Choice(("text", "json")),
    default="text",
    show_default=True,
    help="json: one object a line with upstream's field names (@timestamp, level, @message).",
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
    callback=check_key,
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
    help="Seconds within which a reservation token issued here may be settled; written in the "
    "token, so every replica honours the issuer's.",
)
@option(
    "--exact-durations",
    env="RATEKEEPER_SERVE_EXACT_DURATIONS",
    is_flag=True,
    help="Send duration_until_reset to the nanosecond instead of in whole seconds rounded up "
    "(envoyproxy/ratelimit's).",
)
@option(
    "--shadow-mode",
    env="RATEKEEPER_SERVE_SHADOW_MODE",
    is_flag=True,
    help="Answer every request OK overall, the descriptors' statuses still saying which is "
    "over (envoyproxy/ratelimit's SHADOW_MODE).",
)
@option(
    "--response-dynamic-metadata",
    env="RATEKEEPER_SERVE_RESPONSE_DYNAMIC_METADATA",
    is_flag=True,
    help="Fill the response's dynamic_metadata: domain, descriptors, hits and the matched "
    "rules' metadata (envoyproxy/ratelimit's RESPONSE_DYNAMIC_METADATA).",
)
@option(
    "--charge-over-limit",
    env="RATEKEEPER_SERVE_CHARGE_OVER_LIMIT",
    is_flag=True,
    help="Count the hits of denied calls too, as envoyproxy/ratelimit does (by default, as its "
    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT, a denial counts nothing); per rule: "
    "charge_over_limit: true.",
)
@option(
    "--merge-domain-config",
    env="RATEKEEPER_SERVE_MERGE_DOMAIN_CONFIG",
    is_flag=True,
    help="Let several files define one domain: their top-level descriptors are merged, one in "
    "two files is refused (envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG). Also for --check.",
)
@option(
    "--quota-mode",
    env="RATEKEEPER_SERVE_QUOTA_MODE",
    is_flag=True,
    help="Every descriptor in quota mode: a request is refused only when all its limited "
    "descriptors are over (envoyproxy/ratelimit's QUOTA_MODE); per descriptor: quota_mode: "
    "true.",
)
@option(
    "--upstream",
    "upstream_report",
    env="RATEKEEPER_SERVE_UPSTREAM",
    is_flag=True,
    help="With --check: report, all at once, every place that envoyproxy/ratelimit loads "
    "leniently and ratekeeper refuses (what upstream does there, and the fix).",
)
@option(
    "--limit-response-headers",
    env="RATEKEEPER_SERVE_LIMIT_RESPONSE_HEADERS",
    is_flag=True,
    help="Add envoyproxy/ratelimit's RateLimit-Limit, RateLimit-Remaining and RateLimit-Reset "
    "headers (of the descriptor closest to its limit) to response_headers_to_add.",
)
@header_option("--limit-limit-header", "LIMIT_LIMIT_HEADER", "RateLimit-Limit", "limit")
@header_option(
    "--limit-remaining-header", "LIMIT_REMAINING_HEADER", "RateLimit-Remaining", "units left"
)
@header_option(
    "--limit-reset-header", "LIMIT_RESET_HEADER", "RateLimit-Reset", "seconds to the reset"
)
@option(
    "--near-limit-ratio",
    env="RATEKEEPER_SERVE_NEAR_LIMIT_RATIO",
    type=click.FloatRange(0, 1),
    default=0.8,
    show_default=True,
    help="Hits past this share of a limit also count as near_limit in the metrics "
    "(envoyproxy/ratelimit's NEAR_LIMIT_RATIO).",
)
def serve(
    config: str | None,
    check: str | None,
    portable: bool,
    storage: str | None,
    host: str,
    grpc_port: int,
    http_port: int,
    grpc_host: str | None,
    grpc_uds: str | None,
    grpc_tls_cert: str | None,
    grpc_tls_key: str | None,
    grpc_tls_client_ca: str | None,
    grpc_tls_client_san: str | None,
    grpc_max_connection_age: float | None,
    grpc_max_connection_age_grace: float | None,
    log_level: str | None,
    log_format: str,
    workers: int,
    failure_mode: str,
    timeout: float | None,
    key_prefix: str,
    response_headers: bool,
    reload_interval: float,
    reservation_key: str | None,
    reservation_ttl: float,
    exact_durations: bool,
    shadow_mode: bool,
    response_dynamic_metadata: bool,
    charge_over_limit: bool,
    limit_response_headers: bool,
    limit_limit_header: str,
    limit_remaining_header: str,
    limit_reset_header: str,
    near_limit_ratio: float,
    merge_domain_config: bool,
    quota_mode: bool,
    upstream_report: bool,
) -> None:
    """Serve rate limit decisions: Envoy's rate limit service (gRPC
    envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit, and the gRPC health service)
    and HTTP (POST /json, /reserve, /settle, GET /healthcheck, /metrics, /rlconfig), configured by
    envoyproxy/ratelimit's YAML. Needs pip install 'ratekeeper[server]'.

    envoyproxy/ratelimit's environment variables (RUNTIME_ROOT, REDIS_URL, GRPC_PORT,
    GRPC_SERVER_USE_TLS, ...) are read as defaults below these options (docs/service.md).

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
            summary = check_config(
                check,
                portable=portable,
                merge_domains=merge_domain_config,
                upstream=upstream_report,
            )
        except ConfigError as exc:
            click.echo(str(exc), err=True)
            sys.exit(1)
        click.echo(summary)
        return
    if upstream_report:
        raise click.UsageError("--upstream reports on files: give it with --check PATH")
    upstream = click.get_current_context().meta["ratekeeper.upstream_settings"]
    if isinstance(upstream, ConfigError):
        raise click.UsageError(f"envoyproxy/ratelimit's settings: {upstream}")
    for warning in upstream.warnings:
        click.echo(f"ratekeeper serve: warning: {warning}", err=True)
    if config is None:
        raise click.UsageError(
            "give --config PATH (or --check PATH), or upstream's RUNTIME_ROOT (with "
            "RUNTIME_SUBDIRECTORY, RUNTIME_APPDIRECTORY)"
        )
    grpc_tls = grpc_tls_of(grpc_tls_cert, grpc_tls_key, grpc_tls_client_ca, grpc_tls_client_san)
    if workers > 1 and grpc_uds:
        raise click.BadParameter("a unix socket serves one worker", param_hint="'--workers'")
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
        grpc_host=grpc_host,
        grpc_uds=grpc_uds,
        grpc_tls=grpc_tls,
        grpc_max_connection_age=grpc_max_connection_age,
        grpc_max_connection_age_grace=grpc_max_connection_age_grace,
        log_level=log_level,
        log_format=log_format,
        workers=workers,
        failure_mode=cast("FailureMode", failure_mode),
        timeout=timeout,
        key_prefix=key_prefix,
        response_headers=response_headers,
        reload_interval=reload_interval,
        portable=portable,
        reservation_key=reservation_key,
        reservation_ttl=reservation_ttl,
        exact_durations=exact_durations,
        shadow_mode=shadow_mode,
        response_dynamic_metadata=response_dynamic_metadata,
        charge_over_limit=charge_over_limit,
        limit_response_headers=limit_response_headers,
        limit_header_names=(limit_limit_header, limit_remaining_header, limit_reset_header),
        near_limit_ratio=near_limit_ratio,
        merge_domain_config=merge_domain_config,
        quota_mode=quota_mode,
    )
    try:
        status = run_server(options)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    sys.exit(status)
