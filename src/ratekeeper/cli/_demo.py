"""``ratekeeper demo``: the demo, in the terminal or as a small web API (``--serve``)."""

from __future__ import annotations

import click
from rich.console import Console

from .._model.errors import RatekeeperError
from ._main import main
from ._options import STORAGE_ENV, STORAGE_HELP, option, rates_option


@main.command()
@option("--storage", env=STORAGE_ENV, default="memory://", show_default=True, help=STORAGE_HELP)
@rates_option("10 per 5 seconds", "The demo policy.")
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
    from ._demo_ops import run_demo

    try:
        run_demo(storage, rates, algorithm, duration, Console())
    except RatekeeperError as exc:
        raise click.ClickException(str(exc)) from exc


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
