"""``AsyncRedisStorage``: the asyncio storage on Redis or Valkey (one server, Sentinel or Cluster).

Calls are auto-batched (``_batch``): those made while a round trip is in flight go out together
in the next one, on one connection (in a cluster, one per node; calls it cannot place or that
are redirected go through redis-py's cluster client, ``_command``). ``batching=False`` sends
each call on its own. Every script call is an ``Exchange``, whichever way it goes.

Which connections carry them: to one server opened from a URL, to each node of a cluster
opened from one, and to the primary the sentinels name, ratekeeper's own (``_protocol``:
non-blocking sockets read by hiredis, replies stamped on arrival), configured as redis-py would
configure its own; where those cannot serve (a connection option only redis-py honours, a
user's own client), redis-py's connections through ``_pipeline``; calls a cluster batch cannot
place, or that are redirected, through ``_command``.

redis-py internals: ``client.connection_pool`` (``release``; check-out through ``_compat``);
cluster clients' ``_initialize``, ``initialize()``, ``get_node_from_key``, a node's
``name``, ``connection_class``, ``connection_kwargs`` and ``max_connections`` (its links),
``nodes_manager.nodes_cache``, ``nodes_manager.slots_cache``, ``nodes_manager.initialize()``,
``ClusterNode.acquire_connection`` (release through ``_compat``);
asyncio connections' ``send_command``/``read_response`` for the one ``INFO``.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio
import redis.asyncio.cluster

from ..._algorithms.scripts import Script
from ..._model.errors import StorageError
from ..base import ROUND_TRIP
from ._batch import Batcher, Pending
from ._command import arun_command_path
from ._compat import aget_connection, check_versions, release_node_connection
from ._config import adopt_client, async_client, plan
from ._errors import CLIENT_ERRORS, translate
from ._eviction import log_eviction_warning, parse_info
from ._exchange import Exchange
from ._pipeline import can_keep_async, run_pipeline
from ._protocol import Links
from ._sentinel import master_watch

__all__ = ["BATCH_LANES", "AsyncRedisStorage"]

#: Lanes of one asyncio storage's batcher: round trips in flight at once, each on its own
#: connection. Two keep the client and the server busy together; more only add round trips.
BATCH_LANES = 2
#: Seconds between two slot-map refreshes asked for by a node that could not be reached (a dead
#: primary's calls are few once its breaker is open: its half-open probes ask, at this pace).
MAP_REFRESH_INTERVAL = 0.2


class AsyncRedisStorage:
    """Runs scripts on a ``redis.asyncio.Redis`` client (or cluster, or Sentinel-managed)."""

    def __init__(
        self,
        client: Any,
        *,
        also_close: tuple[Any, ...] = (),
        batching: bool = True,
        owns_client: bool = True,
        links: Links | None = None,
    ) -> None:
        self.client = client
        #: ratekeeper's own connections to the server, when they can serve (``_protocol``).
        self._links = links
        self._owns_client = owns_client  # False: the user's client, theirs to close
        self._also_close = also_close  # the connections to the sentinels, if any
        self._checked_eviction = False
        self._cluster = isinstance(client, redis.asyncio.cluster.RedisCluster)
        # redis-py's asyncio cluster client breaks when many first calls race to discover the
        # cluster; the first call discovers it alone.
        self._ready = not self._cluster
        self._ready_lock = asyncio.Lock()
        #: A node could not be reached: the slot map is learned again before the next batch.
        self._map_stale = False
        self._map_refreshed = -float("inf")
        self._watch = master_watch(client)
        #: The primary the links were last pointed at (Sentinel).
        self._followed: str | None = None
        #: A cluster's nodes' links, by ``host:port`` (None: redis-py's connections serve it).
        self._node_links: dict[str, Links | None] = {}
        #: Which server serves a key, where there are several to tell apart (a cluster's
        #: primaries, the primary Sentinel names): one breaker each. None on one server.
        self.node_of = self._node_of if self._cluster or self._watch is not None else None
        # Batches to a plain server keep their connections instead of checking them in and out
        # of the pool each time (a lock, a readiness poll, a deprecation wrapper): at most one
        # per lane. Sentinel-managed and TLS pools are left alone (see ``_blocking``).
        self._keep = not self._cluster and can_keep_async(client)
        self._kept: list[Any] = []
        self._kept_loop: asyncio.AbstractEventLoop | None = None
        self._batcher: Batcher | None = None
        if batching:
            if links is not None:
                send = self._send_links
            else:
                send = self._send_cluster if self._cluster else self._send_single
            self._batcher = Batcher(send, lanes=BATCH_LANES, one_server=not self._cluster)

    @classmethod
    def from_url(cls, url: str, *, batching: bool = True, **options: Any) -> AsyncRedisStorage:
        check_versions()
        built = plan(url, options)
        client, also_close = async_client(built)
        links = None
        own_retry = "retry" in built.kwargs
        if built.kind == "single":
            links = Links.serving(client, own_retry=own_retry)
        elif built.kind == "sentinel":
            links = Links.for_sentinel(client.connection_pool, own_retry=own_retry)
        storage = cls(client, also_close=also_close, batching=batching, links=links)
        if storage._watch is not None:
            storage._watch.listen(built.hosts, built.sentinel_kwargs)
        return storage

    @classmethod
    def from_client(cls, client: Any, *, batching: bool = True) -> AsyncRedisStorage:
        """A storage on the user's own ``redis.asyncio.Redis`` (also Sentinel-managed) or
        ``redis.asyncio.cluster.RedisCluster``, used as it is configured (see
        ``adopt_client``)."""
        check_versions()
        adopt_client(client, asyncio=True)
        return cls(client, batching=batching, owns_client=False)

    def _node_of(self, key: str) -> str | None:
        """``host:port`` of the server that serves ``key``: in a cluster, the primary of its
        slot as last known; with Sentinel, the primary last named. None on one server, or
        before it is known (nothing is asked here)."""
        if self._watch is not None:
            return self._watch.address
        if not self._cluster or not self._ready:
            return None
        try:
            node = self.client.get_node_from_key(key)
        except CLIENT_ERRORS:  # the slot is not covered (yet)
            return None
        return node.name if node is not None else None

    async def run(
        self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> list[int]:
        if not self._ready:
            await self._discover()
        watch = self._watch
        if watch is not None:
            due = watch.due()  # (it starts the next interval when it says yes)
            if due or watch.address != self._followed:
                await self._follow_primary(watch, due)
        if self._batcher is not None:
            pending = self._batcher.enqueue(script, keys, args)
            assert pending.future is not None
            try:
                reply: list[int] = await pending.future
            finally:
                ROUND_TRIP.set(pending.exchange)  # for the limiter: the store's time, not ours
        else:
            exchange = Exchange(script, keys, args)
            if self._links is not None:
                await self._links.run([Pending(exchange, None)])
            elif self._cluster:
                await arun_command_path(self.client, exchange)
            else:
                await self._drive([exchange], keep=False)
            if exchange.sent:
                ROUND_TRIP.set(exchange)
            reply = exchange.outcome()
        if not self._checked_eviction:
            await self._check_eviction()
        return reply

    async def _follow_primary(self, watch: Any, due: bool) -> None:
        """Ask the sentinels which server is the primary when it is ``due`` (``_sentinel``),
        and point the links at it when it changed."""
        if due:
            await watch.acheck()
        address = watch.address
        if address is not None and address != self._followed:
            self._followed = address
            if self._links is not None:
                host, _, port = address.rpartition(":")
                self._links.follow(host, int(port))

    # --- one server ------------------------------------------------------------------------

    async def _send_links(self, batch: list[Pending]) -> None:
        assert self._links is not None
        await self._links.run(batch)

    async def _send_single(self, batch: list[Pending]) -> None:
        await self._drive([call.exchange for call in batch], keep=self._keep)

    async def _drive(self, exchanges: list[Exchange], *, keep: bool) -> None:
        connection = None
        if keep:
            loop = asyncio.get_running_loop()
            if self._kept_loop is not loop:  # connections belong to the loop that opened them
                await self._give_back()
                self._kept_loop = loop
            if self._kept:
                connection = self._kept.pop()
        if connection is None:
            try:
                connection = await aget_connection(self.client.connection_pool)
            except CLIENT_ERRORS as exc:
                for exchange in exchanges:
                    exchange.unsent(exc, broke=False)
                return
        try:
            await run_pipeline(connection, exchanges, reroute=False)
        finally:
            if keep:
                self._kept.append(connection)
            else:
                await self.client.connection_pool.release(connection)

    async def _give_back(self) -> None:
        kept, self._kept = self._kept, []
        for connection in kept:
            await self.client.connection_pool.release(connection)

    # --- a cluster -------------------------------------------------------------------------

    async def _discover(self) -> None:
        """(Re)discover the cluster, one caller at a time."""
        try:
            await self._discover_raw()
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc

    async def _discover_raw(self) -> None:
        async with self._ready_lock:
            if self.client._initialize:  # set until discovered, and again after a topology error
                await self.client.initialize()
                _cached_nodes_in_slots(self.client.nodes_manager)
            self._ready = True

    async def _send_cluster(self, batch: list[Pending]) -> None:
        """Group the calls by the node that serves their slot, one pipeline per node. Calls the
        grouping cannot place, or that are redirected, go through redis-py's cluster client one
        by one, which follows the cluster as it changes. A node that cannot be reached has the
        slot map learned again before the next batch (``_refresh_map``)."""
        client = self.client
        if client._initialize or self._map_stale:
            await self._refresh_map()
        groups: dict[str, tuple[Any, list[Pending]]] = {}
        alone: list[Exchange] = []
        for call in batch:
            try:
                node = client.get_node_from_key(call.exchange.key)
            except CLIENT_ERRORS:
                node = None
            if node is None:
                alone.append(call.exchange)
            else:
                groups.setdefault(node.name, (node, []))[1].append(call)
        await asyncio.gather(
            *(self._send_group(node, calls) for node, calls in groups.values()),
            *(arun_command_path(client, exchange) for exchange in alone),
        )

    async def _send_group(self, node: Any, calls: list[Pending]) -> None:
        """One node's calls of a batch; their callers are answered as soon as that node is
        done, not when the slowest node of the batch is. On ratekeeper's own links to the node
        where they can serve (``_node_links``), else on redis-py's connection to it."""
        try:
            links = self._node_links[node.name]
        except KeyError:
            links = Links.for_node(node) if self._owns_client else None
            self._node_links[node.name] = links
        if links is None:
            await self._send_node(node, [call.exchange for call in calls])
        else:
            rerouted: list[Pending] = []
            await links.run(calls, rerouted, self._node_unreachable)
            await asyncio.gather(*(arun_command_path(self.client, c.exchange) for c in rerouted))
        for call in calls:
            call.deliver()

    def _node_unreachable(self) -> None:
        """A node is down or gone: the slot map is learned again before the next batch."""
        self._map_stale = True

    async def _refresh_map(self) -> None:
        """Learn the slot map again after a node could not be reached (its replica may serve
        its slots now) or redis-py saw a topology error, at most once per
        ``MAP_REFRESH_INTERVAL``. Best effort: if no node answers, the calls go on with the map
        they have, so the nodes that are up keep deciding (redis-py's own ``initialize()``
        would close every node's connections on such a failure, in-flight calls included). On
        a client of our own, the nodes still named keep their objects and connections
        (``_config._KeepingNodes``)."""
        now = time.monotonic()
        if now - self._map_refreshed < MAP_REFRESH_INTERVAL:
            return
        self._map_refreshed = now
        self._map_stale = False
        client = self.client
        manager = client.nodes_manager
        async with self._ready_lock:
            try:
                await manager.initialize()
            except CLIENT_ERRORS:
                return
            client._initialize = False
            _cached_nodes_in_slots(manager)

    async def _send_node(self, node: Any, exchanges: list[Exchange]) -> None:
        try:
            connection = node.acquire_connection()
        except CLIENT_ERRORS:  # the node's connections are all busy
            rerouted = exchanges
        else:
            try:
                rerouted = await run_pipeline(
                    connection, exchanges, reroute=True, unreachable=self._node_unreachable
                )
            finally:
                if self.client.nodes_manager.nodes_cache.get(node.name) is node:
                    release_node_connection(node, connection)
                else:  # redis-py replaced the node meanwhile; nothing would close this one
                    await connection.disconnect()
        await asyncio.gather(*(arun_command_path(self.client, ex) for ex in rerouted))

    # --- the rest --------------------------------------------------------------------------

    async def _check_eviction(self) -> None:
        self._checked_eviction = True
        try:
            if self._links is not None:
                info: Any = parse_info(await self._links.command("INFO", "memory"))
            elif self._kept and self._kept_loop is asyncio.get_running_loop():
                info = await self._info_on_kept()  # not a second connection from the pool
            else:
                info = await self.client.info("memory")
        except (*CLIENT_ERRORS, StorageError):  # INFO may be forbidden on a managed server
            return
        log_eviction_warning(info)

    async def _info_on_kept(self) -> dict[str, str]:
        connection = self._kept.pop()
        try:
            await connection.send_command("INFO", "memory")
            return parse_info(await connection.read_response())
        except BaseException:
            await connection.disconnect()  # its reply may still be on the way
            raise
        finally:
            self._kept.append(connection)

    async def connect(self) -> None:
        """What the first call would do before its script runs, ahead of it: learn the cluster,
        open a connection (one server), check the eviction policy. StorageError if the store
        cannot be reached."""
        try:
            if not self._ready:
                await self._discover_raw()
            if self._watch is not None:
                await self._follow_primary(self._watch, self._watch.due())
            if self._links is not None:
                self._links.give(self._links.take() or await self._links.connect())
            elif not self._cluster:
                await self.client.ping()
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc
        if not self._checked_eviction:
            await self._check_eviction()

    async def delete(self, keys: tuple[str, ...]) -> int:
        if not self._ready:
            await self._discover()
        try:
            return int(await self.client.delete(*keys))
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc

    async def close(self) -> None:
        if self._watch is not None:  # joins the listening threads: not on the event loop
            await asyncio.get_running_loop().run_in_executor(None, self._watch.close)
        if self._links is not None:
            await self._links.close()
        for links in self._node_links.values():
            if links is not None:
                await links.close()
        await self._give_back()
        if self._owns_client:
            await self.client.aclose()
        for other in self._also_close:
            await other.aclose()


def _cached_nodes_in_slots(manager: Any) -> None:
    """Point the slot map at the node objects of the node cache. redis-py 7 fills a new slot map
    with new objects for the nodes its cache keeps: connections taken from those would never be
    closed (``close`` closes the cache's)."""
    cache = manager.nodes_cache
    for nodes in {id(nodes): nodes for nodes in manager.slots_cache.values()}.values():
        for index, node in enumerate(nodes):
            cached = cache.get(node.name)
            if cached is not None and cached is not node:
                nodes[index] = cached
