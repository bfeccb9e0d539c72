"""Server time per decision, measured one way for every script that reports it
(``script_cost.py`` and the cost section of ``algorithms.py``).

:func:`measure` runs one :class:`Case` on an empty store: ``FLUSHALL SYNC``, fresh clients, a
warm-up decision on an identity of its own (which loads the script: NOSCRIPT, SCRIPT LOAD),
``CONFIG RESETSTAT``, then the decisions, round-robin over the identities; then
``INFO commandstats`` and ``INFO cpu``. The :class:`Cost` it returns holds what the server
said; the server time is that of the script calls (``_harness.server_time``), over the
decisions made. :func:`limiter_case` and :func:`limits_case` are the cases that go through
the libraries' public APIs, one call at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import limits
import limits.storage
import redis
from _harness import TOP_LEVEL, commandstats, server_cpu, server_time, store_only
from _peers import Strategy

from ratekeeper import Limiter, Policy

__all__ = ["Case", "Cost", "limiter_case", "limits_case", "measure"]


@dataclass
class Case:
    name: str
    #: (decisions, identities) -> decisions admitted; the store is empty and the stats reset.
    run: Callable[[int, list[str]], int]
    close: Callable[[], None] = lambda: None
    #: Called after each FLUSHALL: fresh clients, so no process-local state (ratekeeper's deny
    #: cache) outlives the server state it was derived from.
    fresh: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Cost:
    """One case run once."""

    decisions: int
    admitted: int
    client_seconds: float  # wall time of the decisions in this process
    server_cpu_seconds: float  # the server's user + system CPU meanwhile
    #: ``INFO commandstats`` (calls, usec, failures) without the harness's own commands.
    commands: dict[str, dict[str, float]]

    @property
    def script_calls(self) -> float:
        """The commands a client sent to decide (``EVALSHA``...)."""
        return server_time(self.commands)[1]

    @property
    def per_decision(self) -> float:
        """Server microseconds per decision: the script calls' time over the decisions."""
        return server_time(self.commands)[0] / self.decisions

    @property
    def per_call(self) -> float | None:
        """Server microseconds per script call (None: no script was called)."""
        usec, calls = server_time(self.commands)
        return usec / calls if calls else None

    @property
    def cpu_per_decision(self) -> float:
        """Server CPU microseconds per decision, reading and answering requests included."""
        return self.server_cpu_seconds * 1e6 / self.decisions

    @property
    def client_per_decision(self) -> float:
        return self.client_seconds * 1e6 / self.decisions

    @property
    def inside(self) -> dict[str, float]:
        """Calls per decision of each command the scripts ran (their time is inside theirs)."""
        return {
            name: fields["calls"] / self.decisions
            for name, fields in sorted(self.commands.items())
            if name not in TOP_LEVEL
        }

    @property
    def failed_calls(self) -> float:
        return sum(
            fields.get("failed_calls", 0.0) + fields.get("rejected_calls", 0.0)
            for fields in self.commands.values()
        )


def measure(admin: redis.Redis, case: Case, decisions: int, identities: list[str]) -> Cost:
    """``decisions`` decisions of ``case`` over ``identities`` in turn, on an empty store with
    fresh statistics (see the module's docstring)."""
    admin.execute_command("FLUSHALL", "SYNC")  # freed before the reply, on Valkey too
    case.fresh()
    case.run(1, ["warm-up"])  # loads the script (NOSCRIPT, SCRIPT LOAD) before the stats
    admin.config_resetstat()
    cpu = server_cpu(admin)
    started = time.perf_counter()
    admitted = case.run(decisions, identities)
    elapsed = time.perf_counter() - started
    cpu = server_cpu(admin) - cpu
    return Cost(decisions, admitted, elapsed, cpu, commandstats(admin))


class _Renewed:
    """A limiter that ``renew()`` replaces with a new one."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url, self.options = url, options
        self.limiter = Limiter.from_url(url, **options)

    def renew(self) -> None:
        self.limiter.close()
        self.limiter = Limiter.from_url(self.url, **self.options)

    def close(self) -> None:
        self.limiter.close()


def limiter_case(url: str, policy: Policy, name: str, *, deny_cache: bool = False) -> Case:
    """``Limiter.hit`` of ``policy`` (``acquire`` then ``release`` for concurrency: one
    decision, two script calls), every decision from the store (``store_only``) unless
    ``deny_cache``; a new limiter after each flush."""
    held = _Renewed(url, store_only(deny_cache=deny_cache))

    def hits(n: int, identities: list[str]) -> int:
        hit, k, admitted = held.limiter.hit, len(identities), 0
        for i in range(n):
            admitted += hit(policy, identities[i % k]).allowed
        return admitted

    def leases(n: int, identities: list[str]) -> int:
        acquire, k, admitted = held.limiter.acquire, len(identities), 0
        for i in range(n):
            lease = acquire(policy, identities[i % k])
            admitted += lease.allowed
            lease.release()
        return admitted

    run = leases if policy.algorithm == "concurrency" else hits
    return Case(name, run, held.close, held.renew)


def limits_case(url: str, strategy: Strategy, spec: str, name: str) -> Case:
    """``limits``' ``hit`` with ``strategy`` over its ``RedisStorage``."""
    storage = limits.storage.RedisStorage(url)
    limiter = strategy.sync(storage)
    item = limits.parse(spec)

    def run(n: int, identities: list[str]) -> int:
        hit, k, admitted = limiter.hit, len(identities), 0
        for i in range(n):
            admitted += bool(hit(item, identities[i % k]))
        return admitted

    return Case(name, run, storage.get_connection().close)
