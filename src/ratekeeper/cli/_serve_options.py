"""What ``ratekeeper serve``'s options need beyond click: envoyproxy/ratelimit's environment
variables as defaults, header names and the reservation key checked, and the gRPC listener's
TLS from its four options."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import click

from .._model.errors import ConfigError
from ._options import option

__all__ = ["ServeCommand", "check_key", "grpc_tls_of", "header_option"]

_F = TypeVar("_F", bound=Callable[..., Any])


class ServeCommand(click.Command):
    """``serve`` with envoyproxy/ratelimit's environment variables (REDIS_URL, RUNTIME_ROOT,
    GRPC_PORT, ...: ``service/_settings.py``) as its defaults, below the flags and the
    RATEKEEPER_* variables. What they ask that cannot be done is raised when serving starts
    (``--help`` and ``--check`` still work)."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        from ..service._settings import DEFAULT_CONFIG, upstream_settings

        defaults: dict[str, Any] = {}
        try:
            settings: Any = upstream_settings(os.environ)
            defaults.update(settings.options)
            path = defaults.get("config")
            if path is not None and not os.path.exists(path):
                raise ConfigError(
                    f"{settings.origins['config']}: {path}: no such configuration directory"
                )
            if path is None and os.path.isdir(DEFAULT_CONFIG):
                defaults["config"] = DEFAULT_CONFIG  # upstream's, with no RUNTIME_* variable
        except ConfigError as exc:
            settings, defaults = exc, {}
        extra["default_map"] = {**defaults, **(extra.get("default_map") or {})}
        ctx = super().make_context(info_name, args, parent, **extra)
        ctx.meta["ratekeeper.upstream_settings"] = settings
        return ctx


#: RFC 9110 token characters: what a header name may hold.
_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _check_header(ctx: click.Context, param: click.Parameter, value: str) -> str:
    bad = "".join(sorted(set(value) - _TCHARS))
    if not value or bad:
        raise click.BadParameter(
            f"{value!r} is not a header name: letters, digits and !#$%&'*+-.^_`|~ only"
            + (f" (not {bad!r})" if bad else "")
        )
    return value


def header_option(name: str, env: str, default: str, what: str) -> Callable[[_F], _F]:
    return option(
        name,
        env=f"RATEKEEPER_SERVE_{env}",
        default=default,
        show_default=True,
        callback=_check_header,
        help=f"With --limit-response-headers: the name of the {what} header "
        f"(envoyproxy/ratelimit's {env}).",
    )


def check_key(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and len(value) < 16:
        raise click.BadParameter("give at least 16 characters (e.g. openssl rand -hex 32)")
    return value


def grpc_tls_of(cert: str | None, key: str | None, client_ca: str | None, san: str | None) -> Any:
    """The gRPC listener's TLS from the four options (None: plaintext), its files checked."""
    if cert is None and key is None:
        for value, name in ((client_ca, "--grpc-tls-client-ca"), (san, "--grpc-tls-client-san")):
            if value is not None:
                raise click.BadParameter(
                    "needs --grpc-tls-cert and --grpc-tls-key (TLS)", param_hint=f"'{name}'"
                )
        return None
    if cert is None or key is None:
        missing = "--grpc-tls-cert" if cert is None else "--grpc-tls-key"
        raise click.BadParameter("TLS needs a certificate and its key", param_hint=f"'{missing}'")
    if san is not None and client_ca is None:
        raise click.BadParameter(
            "checks client certificates: give --grpc-tls-client-ca too",
            param_hint="'--grpc-tls-client-san'",
        )
    from ..service._listen import GrpcTls

    tls = GrpcTls(cert, key, client_ca, san)
    try:
        tls.check()
    except ConfigError as exc:
        raise click.UsageError(f"gRPC TLS: {exc}") from None
    return tls
