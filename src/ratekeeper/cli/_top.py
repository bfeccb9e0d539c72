"""``ratekeeper top``: the identities each policy denied most, across the fleet."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from .._engine.keys import DEFAULT_KEY_PREFIX
from .._engine.top import RETENTION, Offenders
from .._limiters.limiter import Limiter
from .._model.errors import ConfigError, StorageError
from ._admin_ops import DEFAULT_TIMEOUT, open_limiter
from ._bench_ops import redact
from ._main import main
from ._options import (
    STORAGE_ENV,
    STORAGE_HELP,
    StoreFailure,
    is_memory,
    json_option,
    option,
    store_error,
)
from ._options import shown as shown_error

_UNITS = {"s": 1, "m": 60, "h": 3600}
_SINCE = re.compile(r"(\d+(?:\.\d+)?)\s*([smh]?)")


def _since(value: str) -> float:
    """``600``, ``90s``, ``10m`` or ``1h``: seconds back, up to the retention."""
    match = _SINCE.fullmatch(value.strip())
    seconds = float(match[1]) * _UNITS[match[2] or "s"] if match else 0.0
    if not 0 < seconds <= RETENTION:
        raise click.BadParameter(
            f"give seconds back, up to {RETENTION // 60} minutes: 600, 90s, 10m or 1h; "
            f"got {value!r}",
            param_hint="'--since'",
        )
    return seconds


def _table(found: Offenders) -> Table:
    table = Table(
        title=f"{found.policy}: {found.total} denials in the last {found.since / 60:g} min, "
        f"each count within ±{found.error}",
        title_justify="left",
    )
    table.add_column("#", justify="right")
    table.add_column("identity")
    table.add_column("denied", justify="right")
    for rank, offender in enumerate(found.offenders, 1):
        table.add_row(str(rank), offender.identity, str(offender.denied))
    return table


@main.command(epilog="Exit status: 0, 2 bad usage, 3 the store failed.")
@option("--storage", env=STORAGE_ENV, metavar="URL", required=True, help=STORAGE_HELP + ".")
@option(
    "--policy",
    env="RATEKEEPER_POLICY",
    multiple=True,
    required=True,
    metavar="NAME",
    help="A policy's name, as the application names it (repeat for several).",
)
@option(
    "--since",
    env="RATEKEEPER_TOP_SINCE",
    default="10m",
    show_default=True,
    help="How far back: 600, 90s, 10m, 1h (whole minutes, up to an hour).",
)
@option(
    "--limit",
    env="RATEKEEPER_TOP_LIMIT",
    type=click.IntRange(1, 1000),
    default=10,
    show_default=True,
    help="How many identities per policy.",
)
@option(
    "--watch",
    is_flag=True,
    env="RATEKEEPER_TOP_WATCH",
    help="Refresh a live table every 2 seconds until interrupted (not with --json).",
)
@option(
    "--key-prefix",
    env="RATEKEEPER_KEY_PREFIX",
    default=DEFAULT_KEY_PREFIX,
    show_default=True,
    help="The limiters' key_prefix.",
)
@option(
    "--timeout",
    env="RATEKEEPER_TIMEOUT",
    type=click.FloatRange(0, 60, min_open=True),
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds per store call and per connect.",
)
@json_option
def top(
    storage: str,
    policy: tuple[str, ...],
    since: str,
    limit: int,
    watch: bool,
    key_prefix: str,
    timeout: float,
    as_json: bool,
) -> None:
    """Show the identities each --policy denied most across every limiter on the store.

    Each limiter merges the identities it denied into the store every few seconds; the counts
    are within the stated error of the true counts (``ratekeeper._engine.top``). With --json, a list
    of objects per policy: policy, since, total, error, offenders (identity, denied).
    """
    seconds = _since(since)
    if watch and as_json:
        raise click.UsageError("--watch shows a live table; leave out --json")
    if is_memory(storage):
        raise click.BadParameter(
            "memory:// keeps its state inside one process; name the shared store",
            param_hint="'--storage'",
        )
    try:
        limiter = open_limiter(storage, key_prefix=key_prefix, timeout=timeout)
    except ConfigError as exc:
        raise click.UsageError(shown_error(storage, exc)) from None
    with limiter:
        if not watch:
            found = _read(limiter, storage, policy, seconds, limit)
            if as_json:
                click.echo(json.dumps([asdict(f) for f in found], indent=2))
            else:
                console = Console()
                for one in found:
                    console.print(_table(one))
            return
        with Live(console=Console(), auto_refresh=False) as live:
            try:
                while True:
                    found = _read(limiter, storage, policy, seconds, limit)
                    header = f"{redact(storage)} at {time.strftime('%H:%M:%S')}"
                    live.update(Group(header, *map(_table, found)), refresh=True)
                    time.sleep(2.0)
            except KeyboardInterrupt:
                pass


def _read(
    limiter: Limiter, storage: str, policies: tuple[str, ...], since: float, limit: int
) -> list[Offenders]:
    try:
        return [limiter.top(policy, since=since, limit=limit) for policy in policies]
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    except StorageError as exc:
        raise store_error(storage, exc, "the top offenders' read", StoreFailure) from None
