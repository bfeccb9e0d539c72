"""The admin commands (``ratekeeper peek | hit | reset | keys``): one policy, named identities.

Everything goes through the public API: :meth:`Limiter.from_url` with
``failure_mode="raise"`` and no deny cache, so every answer comes from the store and a failing
store is an error (:class:`StoreFailed`, naming the identity it failed on), never a decision
the failure mode invented. Identities are checked (by building their keys, which needs no
I/O) before the first call, so bad input changes nothing.

Exit codes, for scripts: :data:`EXIT_ALLOWED` (0) every identity allowed or the command done,
:data:`EXIT_DENIED` (1) at least one denied, 2 a usage or configuration error (click's own),
:data:`EXIT_STORE_FAILED` (3) the store failed or refused a call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .._algorithms import ALGORITHMS
from .._algorithms.policy import Policy
from .._limiters.limiter import Limiter
from .._model.decision import Decision
from .._model.errors import ConfigError, RatekeeperError

__all__ = [
    "ADMIN_ALGORITHMS",
    "DEFAULT_TIMEOUT",
    "EXIT_ALLOWED",
    "EXIT_DENIED",
    "EXIT_STORE_FAILED",
    "Action",
    "StoreFailed",
    "check_identities",
    "decide",
    "decision_record",
    "exit_code",
    "key_listing",
    "open_limiter",
    "render_decisions",
    "render_keys",
    "render_reset",
    "reset",
]

EXIT_ALLOWED = 0
EXIT_DENIED = 1
EXIT_STORE_FAILED = 3

#: Every algorithm a policy can name: ``reset`` and ``keys`` take ``concurrency`` too.
ADMIN_ALGORITHMS = tuple(ALGORITHMS)
#: Seconds per store call and per connect: an operator's one call may cross a network, unlike
#: a request path's (the limiter's default is 0.02).
DEFAULT_TIMEOUT = 2.0

Action = Literal["peek", "hit"]


class StoreFailed(Exception):
    """The store failed (or refused) the call for ``identity``; ``done`` identities before it
    were already decided or reset."""

    def __init__(self, identity: str, done: int, cause: RatekeeperError) -> None:
        super().__init__(str(cause))
        self.identity = identity
        self.done = done
        self.cause = cause


def open_limiter(storage: str, *, key_prefix: str, timeout: float | None) -> Limiter:
    """A limiter that only reports what the store says: failures raise, no deny cache.

    ``timeout=None`` opens no connection options (for ``memory://`` or key listing).
    Raises ConfigError for a bad URL or prefix.
    """
    options: dict[str, Any] = {"key_prefix": key_prefix, "failure_mode": "raise", "deny_cache": 0}
    if timeout is not None:
        options["timeout"] = timeout
        options["connect_timeout"] = timeout
    return Limiter.from_url(storage, **options)


def check_identities(limiter: Limiter, policy: Policy, identities: Sequence[str]) -> None:
    """Refuse empty identities (an unset shell variable) and any the library refuses."""
    for identity in identities:
        if identity == "":
            raise ConfigError("an identity must not be empty (an unset shell variable?)")
        limiter.keys(policy, identity)


def decide(
    limiter: Limiter, action: Action, policy: Policy, identities: Sequence[str], cost: int
) -> list[Decision]:
    """``peek`` or ``hit`` each identity in turn, stopping at the first store failure."""
    check_identities(limiter, policy, identities)
    call = limiter.peek if action == "peek" else limiter.hit
    decisions: list[Decision] = []
    for done, identity in enumerate(identities):
        try:
            decisions.append(call(policy, identity, cost))
        except ConfigError:
            raise
        except RatekeeperError as exc:
            raise StoreFailed(identity, done, exc) from exc
    return decisions


def reset(
    limiter: Limiter, policy: Policy, identities: Sequence[str]
) -> list[tuple[str, tuple[str, ...], int]]:
    """Reset each identity in turn: (identity, its keys, how many of them existed) for each."""
    check_identities(limiter, policy, identities)
    done: list[tuple[str, tuple[str, ...], int]] = []
    for identity in identities:
        try:
            existed = limiter.reset(policy, identity)
        except RatekeeperError as exc:
            raise StoreFailed(identity, len(done), exc) from exc
        done.append((identity, limiter.keys(policy, identity), existed))
    return done


def key_listing(
    limiter: Limiter, policy: Policy, identities: Sequence[str]
) -> list[tuple[str, tuple[str, ...]]]:
    """(identity, its store keys) for each identity; nothing is sent to the store."""
    check_identities(limiter, policy, identities)
    return [(identity, limiter.keys(policy, identity)) for identity in identities]


def exit_code(decisions: Sequence[Decision]) -> int:
    """0 when every decision allowed, 1 when any denied."""
    return EXIT_ALLOWED if all(d.allowed for d in decisions) else EXIT_DENIED


def decision_record(identity: str, decision: Decision, cost: int) -> dict[str, Any]:
    """One decision as JSON-ready data.

    ``retry_after`` is seconds, or ``null`` when allowed and when the cost exceeds a limit and
    can never pass (``exceeds_limit`` is then true; the library's value is ``math.inf``, which
    JSON cannot hold).
    """
    retry = decision.retry_after
    never = retry is not None and math.isinf(retry)
    return {
        "identity": identity,
        "allowed": decision.allowed,
        "limit": decision.limit,
        "remaining": decision.remaining,
        "reset_after": decision.reset_after,
        "retry_after": None if never else retry,
        "exceeds_limit": never,
        "cost": cost,
        "policy": decision.policy,
        "rate": str(decision.rate),
        "degraded": decision.degraded,
        "reason": decision.reason,
    }


def _title(action: str, policy: Policy, storage: str) -> str:
    rates = ", ".join(str(rate) for rate in policy.rates)
    return f"{action} policy {policy.name!r} ({rates}, {policy.algorithm}) on {storage}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return "never" if math.isinf(value) else f"{value:.3f} s"


def render_decisions(
    console: Console,
    action: Action,
    policy: Policy,
    storage: str,
    identities: Sequence[str],
    decisions: Sequence[Decision],
    cost: int,
) -> None:
    """The decisions as a table, one row per identity."""
    console.print(
        escape(f"{_title(action, policy, storage)}, cost {cost}"), highlight=False, soft_wrap=True
    )
    table = Table(box=box.SIMPLE)
    for column in ("identity", "decision", "limit", "remaining", "reset after", "retry after"):
        table.add_column(column, justify="left" if column in ("identity", "decision") else "right")
    for identity, d in zip(identities, decisions, strict=True):
        table.add_row(
            escape(identity),
            "[green]allowed[/green]" if d.allowed else "[red]denied[/red]",
            f"{d.limit:,}",
            f"{d.remaining:,}",
            _seconds(d.reset_after),
            _seconds(d.retry_after),
        )
    console.print(table)


def render_reset(
    console: Console,
    policy: Policy,
    storage: str,
    done: Sequence[tuple[str, tuple[str, ...], int]],
) -> None:
    """One line per identity reset: the keys deleted, or that nothing was stored."""
    console.print(escape(_title("reset", policy, storage)), highlight=False, soft_wrap=True)
    for identity, keys, existed in done:
        if existed == 0:
            said = f"nothing was stored (no key of {', '.join(keys)})"
        elif existed == len(keys):
            said = f"deleted {', '.join(keys)}"
        else:
            said = f"deleted {existed} of {', '.join(keys)}"
        console.print(
            escape(f"reset {identity!r}: {said}"),
            highlight=False,
            soft_wrap=True,
        )


def render_keys(console: Console, rows: Sequence[tuple[str, tuple[str, ...]]]) -> None:
    """The keys of each identity, one per line, indented under it."""
    for identity, keys in rows:
        console.print(escape(f"{identity!r}:"), highlight=False)
        for key in keys:
            console.print(f"  {escape(key)}", highlight=False, soft_wrap=True)
