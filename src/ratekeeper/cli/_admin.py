"""``ratekeeper peek``, ``hit``, ``reset`` and ``keys``: one identity's state from a shell."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import click
from rich.console import Console

from .._algorithms.policy import Policy
from .._engine.keys import DEFAULT_KEY_PREFIX
from .._limiters.limiter import Limiter
from .._model.errors import ConfigError
from .._model.options import Algorithm
from .._model.rates import MAX_INT
from ._admin_ops import (
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
from ._admin_ops import reset as reset_identities
from ._bench_ops import BENCH_ALGORITHMS, redact
from ._main import main
from ._options import (
    STORAGE_ENV,
    STORAGE_HELP,
    StoreFailure,
    is_memory,
    json_option,
    option,
    rates_option,
    shown,
    store_error,
)

_F = TypeVar("_F", bound=Callable[..., Any])


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
            metavar="URL",
            help=STORAGE_HELP
            + (
                " (not memory://, which lives in one process)."
                if calls_store
                else " (optional: the keys do not depend on it)"
            ),
            # keys are built without the store, so any URL gives the same ones
            **({"required": True} if calls_store else {"default": "memory://"}),
        ),
        option(
            "--policy",
            env="RATEKEEPER_POLICY",
            required=True,
            metavar="NAME",
            help="The policy's name, as the application names it.",
        ),
        rates_option(None, "The policy's rates, as the application gives them: '10/second'."),
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
    memory = is_memory(target.storage)
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
        raise click.UsageError(shown(target.storage, exc)) from None


_T = TypeVar("_T")


def _admin_call(target: _Target, run: Callable[[Limiter], _T], timeout: float | None) -> _T:
    """``run(limiter)``, with bad input as a usage error and a store failure as exit status 3."""
    try:
        with _open(target, timeout) as limiter:
            return run(limiter)
    except ConfigError as exc:
        raise click.UsageError(shown(target.storage, exc)) from None
    except StoreFailed as exc:
        before = f"; {exc.done} before it done" if exc.done else ""
        raise store_error(
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
    decorated = json_option(
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
@json_option
def reset(timeout: float, as_json: bool, identities: tuple[str, ...], **target: Any) -> None:
    """Forget what each IDENTITY has consumed under the policy (unblock it).

    Prints the keys deleted for each identity (or that nothing was stored); with --json a list
    of objects: identity, reset (true), keys and existed (how many of them existed).
    """
    chosen = _target(**target)
    done = _admin_call(
        chosen, lambda limiter: reset_identities(limiter, chosen.policy, identities), timeout
    )
    if as_json:
        _echo_json(
            [
                {"identity": i, "reset": True, "keys": list(keys), "existed": existed}
                for i, keys, existed in done
            ]
        )
    else:
        render_reset(Console(), chosen.policy, redact(chosen.storage), done)


@main.command()
@_admin_options(algorithms=ADMIN_ALGORITHMS, calls_store=False)
@json_option
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
