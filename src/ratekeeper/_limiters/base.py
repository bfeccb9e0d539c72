"""What ``Limiter`` and ``AsyncLimiter`` hold alike: the storage, the core, the guard, the top
offenders' summary and the path over them, built from the options
(:class:`ratekeeper.typing.LimiterOptions`), and what they answer without I/O.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from typing import Any, Generic, TypeVar

from .._algorithms.policy import Policy
from .._engine.breaker import CircuitBreaker
from .._engine.core import Core
from .._engine.guard import DEFAULT_DENY_CACHE_MAX_AGE, DEFAULT_DENY_CACHE_SIZE, Guard
from .._engine.keys import DEFAULT_KEY_PREFIX, Identity
from .._engine.metrics import Metrics
from .._engine.path import Path
from .._engine.top import TopOffenders
from .._model.clock import Clock
from .._model.decision import Decision
from .._model.errors import ConfigError
from .._model.options import FailureMode, LocalShare
from .._storage import AsyncStorage, SyncStorage

__all__ = ["LimiterBase"]

_S = TypeVar("_S", SyncStorage, AsyncStorage)

#: Every limiter's top offenders: a forked child drops what its parent counted (the parent
#: merges it).
_TOPS: weakref.WeakSet[TopOffenders] = weakref.WeakSet()


def _forget_tops() -> None:
    for top in list(_TOPS):
        top.forget()


os.register_at_fork(after_in_child=_forget_tops)


class LimiterBase(Generic[_S]):
    """What both limiters hold: the storage, the core, the guard and the path over them, and
    the options (:class:`ratekeeper.typing.LimiterOptions`, described in
    :meth:`Limiter.from_url`)."""

    def __init__(
        self,
        storage: _S,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Clock | None = None,
        failure_mode: FailureMode = "open",
        local_share: LocalShare = 1.0,
        breaker: CircuitBreaker | None = None,
        deny_cache: int = DEFAULT_DENY_CACHE_SIZE,
        deny_cache_max_age: float = DEFAULT_DENY_CACHE_MAX_AGE,
        metrics: Metrics | None = None,
        top_offenders: int = 64,
        top_hash_key: bytes | str | None = None,
    ) -> None:
        self._core = Core(key_prefix=key_prefix, clock=clock)
        self._guard = Guard(
            self._core,
            failure_mode=failure_mode,
            local_share=local_share,
            breaker=breaker,
            deny_cache=deny_cache,
            deny_cache_max_age=deny_cache_max_age,
            metrics=metrics,
            clock=clock,
            node_of=getattr(storage, "node_of", None),
        )
        self._top: TopOffenders | None = None
        if isinstance(top_hash_key, str):
            top_hash_key = top_hash_key.encode()
        if top_offenders != 0:
            self._top = TopOffenders(key_prefix, top_offenders, top_hash_key, clock or time.time)
            self._top.wake = self._wake_top
            _TOPS.add(self._top)
        elif top_hash_key is not None:
            raise ConfigError("top_hash_key needs top_offenders")
        self._path = Path(self._core, self._guard, self._top)
        self._closing = threading.Event()
        self._merging: set[asyncio.Task[None]] = set()
        self._merge_timer: asyncio.TimerHandle | None = None
        self.storage: _S = storage

    def _wake_top(self) -> None:
        """Merge the top offenders' summary into the store in ``FLUSH_EVERY`` seconds."""
        raise NotImplementedError

    def _top_read(self, policy: Policy | str, since: float, limit: int) -> tuple[Any, ...]:
        if self._top is None:
            raise ConfigError("this limiter counts no top offenders (top_offenders=0)")
        name = policy.name if isinstance(policy, Policy) else policy
        if not isinstance(name, str):
            raise ConfigError(f"policy must be a Policy or its name, got {policy!r}")
        return name, self._top.read_call(name, since, limit)

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker in front of the store (``breaker.state``): on a cluster or
        Sentinel, the one in front of calls not yet placed on a node (see ``breakers``)."""
        return self._guard.breaker

    @property
    def breakers(self) -> dict[str, CircuitBreaker]:
        """On a cluster or Sentinel, the breaker of each primary seen so far, by
        ``host:port``: each is made like ``breaker``, and a slow or dead node opens only its
        own, so the keys of the other nodes are still decided by the store. Empty on a single
        server and ``memory://``."""
        return self._guard.nodes

    def keys(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        """The store keys that hold ``identity``'s state under ``policy`` (for debugging)."""
        return self._core.reset_keys(policy, identity)

    def cached(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision | None:
        """The denial this process's deny cache holds for a hit of ``cost``, or None; asks no
        store and consumes nothing (a stack of policies asks each before charging any)."""
        guard = self._guard
        if policy.algorithm not in guard.cacheable:
            return None
        cached = guard.cached(self._core.first_key(policy, identity), cost)
        if cached is not None and self._top is not None:
            self._top.record(policy, identity, cost)  # the request it answers is denied
        return cached
