"""The ``ratekeeper`` command line."""

from __future__ import annotations

import click
from rich.console import Console

from . import __version__
from ._errors import RatekeeperError

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
def demo(storage: str, rates: str, algorithm: str, duration: float) -> None:
    """Simulate several clients sharing one policy and show what each got."""
    from ._demo import run_demo

    try:
        run_demo(storage, rates, algorithm, duration, Console())
    except RatekeeperError as exc:
        raise click.ClickException(str(exc)) from exc
