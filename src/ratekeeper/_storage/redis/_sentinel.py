"""Following a Sentinel failover promptly.

* **Which primary**: the sentinels' newest word. ``NewestSentinel`` asks every sentinel
  (``SENTINEL MASTER <name>`` and ``SENTINEL GET-MASTER-ADDR-BY-NAME <name>``, pipelined: one
  round trip) and takes the answer with the highest configuration epoch: the sentinel that led
  a failover names the new primary first. redis-py's own ``Sentinel`` asks one sentinel
  (``SENTINEL MASTERS``) and sticks to it while it answers, so a sentinel that has not heard of
  the failover yet (they gossip every 2 s) names the old primary for seconds (measured: 5 s),
  and every write sent there meanwhile is lost when it is demoted. The address is the one the
  sentinel gives clients (``GET-MASTER-ADDR-BY-NAME``), not the ``ip``/``port`` of its state:
  the leader of a failover takes the new epoch when the replica it promoted answers as a
  primary, but keeps the old primary's address in its state until every other replica has
  synced with the new one (``failover_in_progress``: seconds with a second replica and a
  ``repl-diskless-sync-delay``); its state then outvoted the others, which already named the
  new primary with the same epoch, and writes went on to the old one (measured: 6,571 calls
  in the 2.4 s after every sentinel named the new primary).
* **How soon**: ``MasterWatch`` asks at most every ``MASTER_CHECK_INTERVAL`` seconds, on the
  calls' own path, and at once when a sentinel announces a switch: ``SwitchListener`` (for
  storages opened from a URL) holds a subscription on every sentinel, on threads of its own,
  with blocking clients, so that it serves both APIs and no event loop, to ``+switch-master``
  and to ``+failover-state-reconf-slaves``, which the leader of a failover announces when it
  starts naming the replica it promoted (its own ``+switch-master`` waits for the other
  replicas: seconds, with two or more, while the other sentinels named it long before). When
  the primary changed, redis-py drops the idle connections to the old one, and those in use
  when they come back; without it, connections opened before a failover keep writing to the
  old primary until Sentinel demotes it (seconds later).

redis-py internals: ``SentinelConnectionPool.get_master_address`` (sync and asyncio), which
disconnects the pool's idle connections when the address changed, and asks the manager's
``discover_master``, in every supported version; ``Sentinel.check_master_state``,
``sentinels``, ``_force_master_ip``; the response callbacks of ``SENTINEL MASTER`` (a dict with
``is_master``, ``config-epoch``, ...) and ``SENTINEL GET-MASTER-ADDR-BY-NAME`` (``(host, port)``,
the host bytes unless decoded), found by command name in a pipeline too.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import redis.asyncio.sentinel
import redis.sentinel

from ._errors import CLIENT_ERRORS

__all__ = [
    "MASTER_CHECK_INTERVAL",
    "AsyncNewestSentinel",
    "MasterWatch",
    "NewestSentinel",
    "SwitchListener",
    "master_watch",
]

#: Seconds between two checks of which server the sentinels call the primary (each is one round
#: trip to every sentinel: with 3 sentinels, 12 a second per process, of two small requests).
MASTER_CHECK_INTERVAL = 0.25


def _newest(manager: Any, service: str, states: list[Any], errors: list[str]) -> tuple[str, int]:
    """The primary named by the valid answer with the highest configuration epoch."""
    best: Any = None
    for state in states:
        if state is None or not manager.check_master_state(state, service):
            continue
        if best is None or state.get("config-epoch", 0) > best.get("config-epoch", 0):
            best = state
    if best is None:
        detail = f" : {', '.join(errors)}" if errors else ""
        raise redis.sentinel.MasterNotFoundError(f"No master found for {service!r}{detail}")
    forced = getattr(manager, "_force_master_ip", None)  # redis-py 5.1 and later
    return (forced if forced is not None else best["ip"]), best["port"]


def _advertised(state: Any, address: Any) -> Any:
    """A sentinel's ``SENTINEL MASTER`` state with the address it gives clients, its
    ``GET-MASTER-ADDR-BY-NAME`` (the promoted replica's once the leader of a failover has
    taken the new epoch); None if it gives none."""
    if not address:
        return None
    host, port = address
    return {**state, "ip": host.decode() if isinstance(host, bytes) else host, "port": int(port)}


def _queue(pipe: Any, service: str) -> None:
    pipe.execute_command("SENTINEL MASTER", service)
    pipe.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", service)


class NewestSentinel(redis.sentinel.Sentinel):
    """``redis.sentinel.Sentinel`` naming the primary the sentinels agreed on last."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        states: list[Any] = []
        errors: list[str] = []
        for sentinel in self.sentinels:
            try:
                with sentinel.pipeline(transaction=False) as pipe:
                    _queue(pipe, service_name)
                    states.append(_advertised(*pipe.execute()))
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                errors.append(f"{sentinel} - {exc!r}")
            except redis.ResponseError:  # this sentinel does not monitor the service
                continue
        return _newest(self, service_name, states, errors)


class AsyncNewestSentinel(redis.asyncio.sentinel.Sentinel):
    """``redis.asyncio.sentinel.Sentinel`` naming the primary the sentinels agreed on last."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        states: list[Any] = []
        errors: list[str] = []
        for sentinel in self.sentinels:
            try:
                async with sentinel.pipeline(transaction=False) as pipe:
                    _queue(pipe, service_name)
                    states.append(_advertised(*await pipe.execute()))
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                errors.append(f"{sentinel} - {exc!r}")
            except redis.ResponseError:
                continue
        return _newest(self, service_name, states, errors)


class MasterWatch:
    """Asks the sentinels for the primary at most once per interval."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.next_check = 0.0
        #: ``host:port`` of the primary Sentinel named at the last check (None before one).
        self.address: str | None = None
        self.listener: SwitchListener | None = None

    def listen(self, sentinels: Iterable[tuple[str, int]], options: dict[str, Any]) -> None:
        """Check at once whenever one of ``sentinels`` announces a switch of this service."""
        self.listener = SwitchListener(self, sentinels, self.pool.service_name, options)

    def heard(self) -> None:
        """A sentinel announced a switch: the next call checks (a float store: thread-safe)."""
        self.next_check = 0.0

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()

    def due(self) -> bool:
        if self.listener is not None:
            self.listener.ensure_running()
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + MASTER_CHECK_INTERVAL
        return True

    def check(self) -> None:
        # If no sentinel answers, the next command finds out on its own.
        with contextlib.suppress(*CLIENT_ERRORS):
            self._named(self.pool.get_master_address())

    async def acheck(self) -> None:
        with contextlib.suppress(*CLIENT_ERRORS):
            self._named(await self.pool.get_master_address())

    def _named(self, address: Any) -> None:
        host, port = address
        self.address = f"{host}:{port}"


class SwitchListener:
    """One daemon thread per sentinel, subscribed to the events that name a new primary: one of
    ``service`` makes ``watch`` check at the next call. A sentinel that cannot be reached is
    tried again every second; the periodic check covers the meantime. Started on first use, and
    again in a forked child (threads do not survive a fork)."""

    #: Seconds a listening thread waits for a message before it looks at the stop flag.
    POLL = 0.1
    #: A sentinel names a new primary from the first of these: ``+switch-master`` (``<service>
    #: <old ip> <old port> <new ip> <new port>``), and, on the leader of the failover, which
    #: names the promoted replica from then on, ``+failover-state-reconf-slaves`` (``master
    #: <service> <old ip> <old port>``).
    SWITCH, RECONF = "+switch-master", "+failover-state-reconf-slaves"

    def __init__(
        self,
        watch: MasterWatch,
        sentinels: Iterable[tuple[str, int]],
        service: str,
        options: dict[str, Any],
    ) -> None:
        self.watch = watch
        self.sentinels = list(sentinels)
        self.service = service
        # The sentinels' own options, for a blocking client ("retry" may be an asyncio one).
        self.options = {k: v for k, v in options.items() if k != "retry"}
        self._pid = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def ensure_running(self) -> None:
        if self._pid == os.getpid() or self._stop.is_set():
            return
        with self._lock:
            if self._pid == os.getpid() or self._stop.is_set():
                return
            self._pid = os.getpid()
            self._threads = [
                threading.Thread(
                    target=self._listen, args=address, name="ratekeeper-sentinel", daemon=True
                )
                for address in self.sentinels
            ]
            for thread in self._threads:
                thread.start()

    def _listen(self, host: str, port: int) -> None:
        while not self._stop.is_set():
            client = redis.Redis(host=host, port=port, **self.options)
            pubsub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            try:
                pubsub.subscribe(self.SWITCH, self.RECONF)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=self.POLL)
                    if message is not None and self._names_service(message):
                        self.watch.heard()
            except (*CLIENT_ERRORS, OSError):
                self._stop.wait(1.0)  # down or gone: try again in a second
            finally:
                with contextlib.suppress(*CLIENT_ERRORS, OSError):
                    pubsub.close()
                    client.close()

    def _names_service(self, message: dict[str, Any]) -> bool:
        channel, data = (
            value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            for value in (message["channel"], message["data"])
        )
        words = data.split(" ", 2)
        named = words[1] if channel == self.RECONF and len(words) > 1 else words[0]
        return named == self.service

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(2 * self.POLL + 1.0)


def master_watch(client: Any) -> MasterWatch | None:
    """A watch for a Sentinel-managed client, else None."""
    pool = getattr(client, "connection_pool", None)
    if isinstance(
        pool, (redis.sentinel.SentinelConnectionPool, redis.asyncio.sentinel.SentinelConnectionPool)
    ):
        return MasterWatch(pool)
    return None
