"""What several commands share: options read from the environment too, and the store's
failures as click errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from .._model.errors import ConfigError, RatekeeperError, StorageError, StorageTimeout
from .._model.rates import parse_rates
from ._admin_ops import (
    EXIT_STORE_FAILED,
)
from ._bench_ops import redact

_F = TypeVar("_F", bound=Callable[..., Any])


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


def rates_option(default: str | None, help: str) -> Callable[[_F], _F]:
    return option(
        "--rates",
        env="RATEKEEPER_RATES",
        default=default,
        required=default is None,
        show_default=default is not None,
        callback=_check_rates,
        help=help,
    )


json_option = option(
    "--json", "as_json", env="RATEKEEPER_JSON", is_flag=True, help="Print JSON on stdout."
)


def is_memory(storage: str) -> bool:
    return storage.strip().lower().startswith("memory:")


def shown(storage: str, exc: Exception) -> str:
    """The error's message with the URL's password masked (library messages quote it)."""
    return str(exc).replace(storage, redact(storage))


class StoreFailure(click.ClickException):
    """The store failed or refused a call: exit status 3."""

    exit_code = EXIT_STORE_FAILED


def store_error(
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
        f"{shown(storage, exc)}{hint}"
    )


# -- admin commands ------------------------------------------------------------------------------
