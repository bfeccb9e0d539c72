"""``RedisStorage``: the blocking storage on Redis or Valkey (one server, Sentinel or Cluster).

It chooses the transport (``_blocking`` for one server, also the primary Sentinel names;
redis-py's command path, ``_command``, for a cluster), follows Sentinel failovers
(``_sentinel``) and checks the eviction policy once. Every script call is an ``Exchange``.

redis-py internals: ``client.connection_pool``; the rest through the modules above.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import redis.cluster

from ..._algorithms.scripts import Script
from ..._model.errors import RequestRejected, StorageError
from ..base import ROUND_TRIP
from ._blocking import BlockingTransport, can_keep
from ._command import run_command_path
from ._compat import check_versions
from ._config import adopt_client, plan, sync_client
from ._errors import CLIENT_ERRORS, translate
from ._eviction import log_eviction_warning, parse_info
from ._exchange import Exchange
from ._sentinel import master_watch

__all__ = ["RedisStorage"]


class RedisStorage:
    """Runs scripts on a ``redis.Redis`` (or cluster, or Sentinel-managed) client.

    ``connect`` builds the client on first use instead (see ``_config.sync_client``).
    """

    def __init__(
        self,
        client: Any = None,
        *,
        connect: Callable[[], Any] | None = None,
        also_close: tuple[Any, ...] = (),
        owns_client: bool = True,
    ) -> None:
        if client is None and connect is None:
            raise ValueError("RedisStorage needs a client or a way to connect")
        self._client = client
        self._connect = connect
        self._also_close = also_close  # the connections to the sentinels, if any
        # Threads making their first calls together build one client, not one each: clients
        # built at once share the startup nodes, and redis-py < 7.2 closes their connections
        # under the others' feet when it refreshes its slot table.
        self._connecting = threading.Lock()
        self._checked_eviction = False
        self._owns_client = owns_client  # False: the user's client, theirs to close
        self._watch = master_watch(client)
        # One server (also the primary Sentinel names) takes the blocking transport; a cluster
        # (built on first use, or the user's) redis-py's command path.
        self._transport = (
            None
            if client is None or isinstance(client, redis.cluster.RedisCluster)
            else BlockingTransport(client.connection_pool, keep=can_keep(client))
        )
        #: Which server serves a key, where there are several to tell apart (a cluster's
        #: primaries, the primary Sentinel names): one breaker each. None on one server.
        self.node_of = self._node_of if self._transport is None or self._watch is not None else None

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStorage:
        check_versions()
        built = plan(url, options)
        client, connect, also_close = sync_client(built)
        storage = cls(client, connect=connect, also_close=also_close)
        if storage._watch is not None:
            storage._watch.listen(built.hosts, built.sentinel_kwargs)
        return storage

    @classmethod
    def from_client(cls, client: Any) -> RedisStorage:
        """A storage on the user's own ``redis.Redis`` (also Sentinel-managed) or
        ``redis.cluster.RedisCluster``, used as it is configured (see ``adopt_client``)."""
        check_versions()
        adopt_client(client, asyncio=False)
        return cls(client, owns_client=False)

    @property
    def client(self) -> Any:
        """The redis-py client, built on first use if need be."""
        if self._client is None:
            with self._connecting:
                if self._client is None:
                    assert self._connect is not None
                    try:
                        self._client = self._connect()
                    except CLIENT_ERRORS as exc:
                        raise translate(exc) from exc
        return self._client

    def _node_of(self, key: str) -> str | None:
        """``host:port`` of the server that serves ``key``: in a cluster, the primary of its
        slot as last known; with Sentinel, the primary last named. None on one server, or
        before it is known (nothing is asked here)."""
        if self._watch is not None:
            return self._watch.address
        client = self._client
        if self._transport is not None or client is None:
            return None
        try:
            node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
        except CLIENT_ERRORS:  # the slot is not covered (yet)
            return None
        return node.name if node is not None else None

    def run(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> list[int]:
        if self._transport is not None:
            if self._watch is not None and self._watch.due():
                self._watch.check()
            reply = self._transport.run(script, keys, args)
        else:
            exchange = Exchange(script, keys, args)
            run_command_path(self.client, exchange)
            ROUND_TRIP.set(exchange)  # for the limiter: the last round trip, not the set-up
            reply = exchange.outcome()
        if not self._checked_eviction:
            self._check_eviction()
        return reply  # type: ignore[no-any-return]

    def _check_eviction(self) -> None:
        self._checked_eviction = True
        try:
            if self._transport is not None:  # on its own connection, not a second one
                info: Any = parse_info(self._transport.execute("INFO", "memory"))
            else:
                info = self.client.info("memory")  # a dict; redis-py types vary by version
        except (*CLIENT_ERRORS, StorageError, RequestRejected):  # INFO may be forbidden
            return
        log_eviction_warning(info)

    def delete(self, keys: tuple[str, ...]) -> int:
        try:
            return int(self.client.delete(*keys))
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        if self._transport is not None:
            self._transport.close()
        if self._client is not None and self._owns_client:
            self._client.close()
        for other in self._also_close:
            other.close()
