"""What the service's health checks answer, as envoyproxy/ratelimit's do: the gRPC health
service (``grpc.health.v1``, for ``""`` and the names given: the RLS service's and upstream's
``"ratelimit"``) and ``GET /healthcheck`` (200 ``OK``, else 500).

The service is healthy when every component is: the store has answered once since start-up
(upstream pings Redis before it serves), and the server is not stopping (SIGTERM: upstream
fails its health check at once, so a load balancer stops sending before the listener closes).
Until the store answers, :meth:`Health.wait_for_store` asks it again, backing off to once a
second; the RPCs that arrive meanwhile are decided as the failure mode says.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from .._algorithms.policy import Policy
from .._limiters.limiter import AsyncLimiter
from .._model.errors import StorageError
from .._model.rates import Rate
from ._config import rule_policy_name

__all__ = ["STOPPING", "STORE", "Health"]

log = logging.getLogger("ratekeeper.service")

#: The components, and why each fails the health checks.
STORE = "store"
STOPPING = "stopping"
_WHY = {STORE: "the store has not answered yet", STOPPING: "shutting down"}

#: What a probe asks: a peek, which writes nothing, under a name no rule has.
_PROBE = Policy(rule_policy_name("h", "health"), Rate(1, 1), "fixed_window")


class Health:
    """The health of one worker. ``servicer`` is grpcio-health-checking's aio
    ``HealthServicer`` (None: HTTP only); ``names`` the service names it answers for besides
    ``""``. Starts failing (the store has not answered); :meth:`ok` and :meth:`fail` change a
    component."""

    def __init__(self, servicer: Any | None, names: Sequence[str]) -> None:
        self._servicer = servicer
        self._names = ("", *names)
        self._failing = {STORE}
        self._warned = False

    @property
    def healthy(self) -> bool:
        return not self._failing

    @property
    def reason(self) -> str | None:
        """Why the health checks fail (None: they pass)."""
        if STOPPING in self._failing:
            return _WHY[STOPPING]
        return _WHY[STORE] if self._failing else None

    async def publish(self) -> None:
        """Tell the gRPC health service (SERVING or NOT_SERVING, for every name)."""
        if self._servicer is None:
            return
        from grpc_health.v1 import health_pb2

        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.healthy
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self._names:
            await self._servicer.set(name, status)

    async def ok(self, component: str) -> None:
        self._failing.discard(component)
        await self.publish()

    async def fail(self, component: str) -> None:
        self._failing.add(component)
        await self.publish()

    async def probe(self, limiter: AsyncLimiter) -> bool:
        """Ask the store once; when it answers, the store component is healthy."""
        try:
            decision = await limiter.peek(_PROBE, "probe")
        except StorageError as exc:
            self._not_yet(str(exc))
            return False
        if decision.degraded:
            self._not_yet(decision.reason or "no answer")
            return False
        if STORE in self._failing:
            log.info("the store answered: health checks pass")
        await self.ok(STORE)
        return True

    async def wait_for_store(
        self, limiter: AsyncLimiter, *, first: float = 0.05, most: float = 1.0
    ) -> None:
        """Probe until the store answers: after ``first`` seconds, then twice as long each
        time, up to ``most``."""
        delay = first
        while not await self.probe(limiter):
            await asyncio.sleep(delay)
            delay = min(delay * 2, most)

    def _not_yet(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("the store does not answer (%s): health checks fail until it does", why)
