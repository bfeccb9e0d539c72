"""``ratekeeper demo``: a finite walkthrough of several clients sharing one policy.

Time is simulated with a :class:`ManualClock` (client time), so the run takes a second or two
whatever the virtual duration, and gives the same result on every backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from rich.console import Console
from rich.table import Table

from .._algorithms.policy import Policy
from .._limiters.limiter import Limiter
from .._model.clock import ManualClock
from .._model.decision import Decision
from .._model.options import Algorithm

__all__ = ["CLIENTS", "ClientStats", "run_demo"]

TICK = 0.1  # virtual seconds per simulation step


@dataclass(frozen=True)
class Client:
    name: str
    pattern: str
    #: requests sent in the tick starting at virtual second t
    requests_at: Callable[[int], int]


def _every(period_ticks: int, count: int = 1) -> Callable[[int], int]:
    return lambda tick: count if tick % period_ticks == 0 else 0


CLIENTS = (
    Client("alice", "1/s steady", _every(10)),
    Client("bob", "30 at t=5s", lambda tick: 30 if tick == 50 else 0),
    Client("carol", "5/s steady", _every(2)),
    Client("mallory", "100/s flood", _every(1, 10)),
)


@dataclass
class ClientStats:
    admitted: int = 0
    denied: int = 0
    last: Decision | None = None
    waits: list[float] = field(default_factory=list)


def run_demo(
    storage: str, rates: str, algorithm: str, duration: float, console: Console
) -> dict[str, ClientStats]:
    """Simulate ``duration`` virtual seconds and print what each client got."""
    policy = Policy("demo", rates, cast("Algorithm", algorithm))  # checked there
    clock = ManualClock(time.time())
    stats = {client.name: ClientStats() for client in CLIENTS}
    started = time.perf_counter()
    with Limiter.from_url(storage, key_prefix="ratekeeper-demo", clock=clock) as limiter:
        for client in CLIENTS:
            limiter.reset(policy, client.name)
        ticks = round(duration / TICK)
        for tick in range(ticks):
            for client in CLIENTS:
                record = stats[client.name]
                for _ in range(client.requests_at(tick)):
                    decision = limiter.hit(policy, client.name)
                    record.last = decision
                    if decision.allowed:
                        record.admitted += 1
                    else:
                        record.denied += 1
                        if decision.retry_after is not None:
                            record.waits.append(decision.retry_after)
            clock.advance(TICK)
        for client in CLIENTS:
            limiter.reset(policy, client.name)
    elapsed = time.perf_counter() - started

    rate_text = "; ".join(str(rate) for rate in policy.rates)
    console.print(
        f"[bold]ratekeeper demo[/bold]: policy [cyan]{rate_text}[/cyan] "
        f"({algorithm}) on [cyan]{storage}[/cyan], {duration:g} simulated seconds"
    )
    table = Table(show_lines=False)
    for column in ("client", "traffic", "sent", "admitted", "denied", "remaining", "retry_after"):
        table.add_column(column, justify="left" if column in ("client", "traffic") else "right")
    for client in CLIENTS:
        record = stats[client.name]
        last = record.last
        table.add_row(
            client.name,
            client.pattern,
            str(record.admitted + record.denied),
            f"[green]{record.admitted}[/green]",
            f"[red]{record.denied}[/red]" if record.denied else "0",
            str(last.remaining) if last is not None else "-",
            f"{record.waits[-1]:.3f} s" if record.waits else "-",
        )
    console.print(table)
    console.print(
        "Every client has its own window: mallory's flood never costs alice a request.\n"
        "remaining is after the client's last request; retry_after is the exact wait its last "
        f"denial was given.\n{sum(s.admitted + s.denied for s in stats.values())} decisions "
        f"in {elapsed:.2f} s."
    )
    return stats
