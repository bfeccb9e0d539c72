"""Sentinel (``redis+sentinel://h:p,h:p,h:p/mymaster``): 1 primary, 2 replicas, 3 sentinels.

The limiter finds the primary through the sentinels, sync and async, and keeps deciding
through ``SENTINEL FAILOVER`` under load: no READONLY (or any other) error reaches a caller,
and exact enforcement resumes within a bounded time after the switch. The failover test runs
last and leaves the group healthy (roles swapped). Figures are printed (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ratekeeper import CircuitBreaker, Limiter, ManualClock, Policy
from ratekeeper._engine.keys import Identity

from ..support.figures import record
from ..support.servers import free_port
from ..support.topologies import (
    TIMED,
    BreakerLog,
    Driver,
    HitLoad,
    SentinelGroup,
    TopologyError,
    connected,
    exact_again,
    wait_for,
    wait_resumed,
)

T0 = 1_700_000_000.0
ALGORITHMS = ["sliding_log", "sliding_window", "fixed_window", "gcra", "token_bucket"]


def strict() -> dict[str, Any]:
    return {
        "failure_mode": "raise",
        "timeout": 10.0,
        "connect_timeout": 10.0,
        "breaker": CircuitBreaker(slow_call=10.0),
    }


@pytest.fixture
def group(sentinel_group: SentinelGroup) -> SentinelGroup:
    sentinel_group.wait_healthy()
    return sentinel_group


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_limits_exactly_through_the_sentinels(
    group: SentinelGroup, api: str, algorithm: str
) -> None:
    """Exactly the limit, then denials; peek and reset; the key lives on the primary the
    sentinels name and reaches the replicas; SCRIPT FLUSH on every server is recovered."""
    prefix = f"sentinel-{uuid.uuid4().hex[:8]}"
    burst = {"burst": 5} if algorithm in ("gcra", "token_bucket") else {}
    policy = Policy(f"s-{algorithm}", "5/minute", algorithm, **burst)
    clock = ManualClock(T0)
    primary = group.primary()
    replicas = [s for s in group.servers if s is not primary]
    with Driver(api, group.url, key_prefix=prefix, clock=clock, **strict()) as driver:
        decisions = [driver.hit(policy, "alice") for _ in range(7)]
        assert [d.allowed for d in decisions] == [True] * 5 + [False] * 2
        assert [d.remaining for d in decisions] == [4, 3, 2, 1, 0, 0, 0]
        assert not any(d.degraded for d in decisions)
        (key,) = driver.keys(policy, "alice")
        with connected(primary.port) as client:
            assert client.exists(key) == 1
        for replica in replicas:
            with connected(replica.port) as client:
                wait_for("the key on the replica", lambda: client.exists(key) == 1, 10)
        for server in group.servers:
            with connected(server.port) as client:
                client.script_flush()
        assert not driver.peek(policy, "alice").allowed  # NOSCRIPT, reloaded, exact
        driver.reset(policy, "alice")
        assert driver.peek(policy, "alice").remaining == 5
        assert driver.hit(policy, "alice").remaining == 4
        assert driver.hit(policy, "bob").remaining == 4


def test_leases_through_the_sentinels(group: SentinelGroup, api: str) -> None:
    prefix = f"sentinel-lease-{uuid.uuid4().hex[:8]}"
    policy = Policy("jobs", "2 per 30 seconds", "concurrency")
    with Driver(api, group.url, key_prefix=prefix, **strict()) as driver:
        leases = [driver.acquire(policy, "tenant") for _ in range(3)]
        assert [lease.allowed for lease in leases] == [True, True, False]
        assert leases[0].release() is True
        again = driver.acquire(policy, "tenant")
        assert again.allowed
        assert again.release() is True
        assert leases[1].release() is True
        assert driver.peek(policy, "tenant").remaining == 2


def test_readonly_replica_applies_the_failure_mode(group: SentinelGroup, api: str) -> None:
    """A limiter whose plain ``redis://`` URL names what is now a replica (a stale address
    after a failover) gets READONLY: an error about the store, so the failure mode decides
    (open: allowed; closed: denied), as the README promises. No exception.

    Known bug: redis-py strips the code from the errors it maps to classes (``READONLY`` ->
    ``ReadOnlyError("You can't write against a read only replica...")``, likewise NOSCRIPT,
    CLUSTERDOWN, MASTERDOWN, TRYAGAIN, MOVED, ASK), and ``_translate`` in
    ``_storage/redis.py`` tests ``str(exc).startswith(_STORE_STATE_ERRORS)``: READONLY
    becomes ``RequestRejected`` and is raised to the caller whatever the failure mode."""
    replica = next(s for s in group.servers if s is not group.primary())
    url = f"redis://127.0.0.1:{replica.port}/0"
    policy = Policy("readonly", "5/minute")
    outcomes: dict[str, Any] = {}
    for mode in ("open", "closed"):
        with Driver(api, url, failure_mode=mode, timeout=5.0, connect_timeout=5.0) as driver:
            try:
                outcomes[mode] = driver.hit(policy, "alice")
            except Exception as exc:
                outcomes[mode] = f"{type(exc).__name__}: {exc}"
    assert {mode: type(o).__name__ for mode, o in outcomes.items()} == {
        "open": "Decision",
        "closed": "Decision",
    }, outcomes
    assert outcomes["open"].allowed
    assert outcomes["open"].degraded
    assert not outcomes["closed"].allowed
    assert outcomes["closed"].degraded


def _client_connections(port: int) -> list[str]:
    """Addresses of the ordinary client connections a sentinel or server has (its peers'
    named links and the connection asking are left out)."""
    with connected(port) as client:
        me = client.client_id()
        return sorted(
            c["addr"]
            for c in client.client_list()
            if int(c["id"]) != me and not c.get("name") and "S" not in c.get("flags", "")
        )


def test_close_releases_the_sentinel_connections(group: SentinelGroup, api: str) -> None:
    """After ``close()`` a limiter holds no connection at all: to the primary nor to the
    sentinel it asked for the primary's address (a regression test: the Sentinel's own
    connection used to stay open until garbage collection, and an async one then warned
    "unclosed Connection" in whatever code was running)."""
    ports = [s.port for s in group.sentinels] + [group.primary().port]
    before = {port: _client_connections(port) for port in ports}
    driver = Driver(api, group.url, key_prefix=f"close-{uuid.uuid4().hex[:8]}")
    try:
        assert driver.hit(Policy("close", "5/minute"), "alice").remaining == 4
        opened = {port: _client_connections(port) for port in ports}
        assert opened != before  # it did connect: to the primary and to a sentinel
        if api == "sync":
            driver.limiter.close()
        else:
            driver._run(driver.limiter.close())

        def leftovers() -> dict[int, list[str]]:
            now = {port: _client_connections(port) for port in ports}
            return {port: sorted(set(now[port]) - set(before[port])) for port in ports}

        with contextlib.suppress(TopologyError):  # the servers see the close asynchronously
            wait_for("every connection to close", lambda: not any(leftovers().values()), 2.0)
        assert leftovers() == {port: [] for port in ports}
    finally:
        driver.close()


# --- failover under load -------------------------------------------------------------------------

LOAD_LIMIT = 20
LOAD_THREADS = 4
#: Bound on the time from the moment the first sentinel names the new primary until an attempt
#: begins in which a fresh identity gets exactly its limit, written on the new primary, through
#: the limiter that was running all along and through limiters made after (when it begins: the
#: probes take turns, and on a loaded machine a new limiter's first call took up to 0.7 s, which
#: when it ends would charge to the probes after it). Sentinel reconfigures the old primary as a
#: replica only ~8-11 s after a SENTINEL FAILOVER (sentinel.c waits 4 x its 2 s publish period);
#: until then it accepts writes: a limiter must learn the switch from the sentinels, not from
#: the old primary.
NAMED_RESUME_WITHIN = 1.5
#: Bound on the script calls that reach the old primary after the first sentinel named the new
#: one: the limiter hears it at once, and only the calls the other threads make while it asks
#: the sentinels which primary is the newest (a round trip to each) may still go there.
CALLS_AFTER_NAMED = 50
#: Bound on those after every sentinel named it (50-120 ms after the first: the others learn it
#: from the leader's next hello), when the limiter has long switched: the calls in flight, one
#: per load thread and the probe's.
CALLS_AFTER_EVERY_NAMED = LOAD_THREADS + 1
#: ``repl-diskless-sync-delay`` of the replicas during the failover, as in issue #30: the leader
#: of the failover names the promoted replica at once, but keeps the old primary's address in
#: its ``SENTINEL MASTER`` state, with the new epoch, until the other replica has synced with the
#: new primary (its full sync waits this long), while the other sentinels name the new primary.
SYNC_DELAY = 5


def _fresh(tag: str) -> Callable[[], list[Identity]]:
    counter = itertools.count()
    return lambda: [f"{tag}-{next(counter)}"]


class _NewLimiterProbe:
    """A probe that opens a new limiter (``api``) for each attempt: does a limiter created now
    find the new primary and decide exactly there?"""

    def __init__(self, api: str, group: SentinelGroup, prefix: str, new: Any) -> None:
        self.api, self.group, self.prefix, self.new = api, group, prefix, new
        self.counter = itertools.count()
        self.inexact: list[str] = []

    def __call__(self) -> bool:
        identity = f"new-{self.api}-{next(self.counter)}"
        with Driver(self.api, self.group.url, key_prefix=self.prefix) as driver:
            probe = exact_again(driver, PROBE, lambda: [identity], self.inexact, _llen_on(self.new))
            return probe()


PROBE = Policy("probe", "3/hour")


class _Begun:
    """A probe for ``wait_resumed`` that keeps when its successful attempt began (``at``)."""

    def __init__(self, probe: Callable[[], bool]) -> None:
        self.probe = probe
        self.at: float | None = None

    def __call__(self) -> bool:
        begun = time.monotonic()
        if not self.probe():
            return False
        self.at = begun
        return True


class _Named:
    """Listens on every sentinel for the event with which it starts naming a new primary (its
    ``SENTINEL GET-MASTER-ADDR-BY-NAME`` answers the new address from then on): the leader of
    the failover's ``+failover-state-reconf-slaves``, the others' ``+switch-master``. ``first``
    and ``every`` are (when, EVALSHA calls the old primary had served by then) as the first
    sentinel, and the last, named the new primary; ``leader_then`` is the leader's (``leader``
    port) ``SENTINEL MASTER`` state when the last did."""

    EVENTS = ("+switch-master", "+failover-state-reconf-slaves")

    def __init__(self, group: SentinelGroup, old: Any, leader: int) -> None:
        self.group, self.old, self.leader = group, old, leader
        self.named: set[int] = set()
        self.first: tuple[float, int] | None = None
        self.every: tuple[float, int] | None = None
        self.leader_then: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._subscribed = threading.Barrier(len(group.sentinels) + 1)
        self._threads = [
            threading.Thread(target=self._listen, args=(s.port,), daemon=True)
            for s in group.sentinels
        ]

    def _listen(self, port: int) -> None:
        with connected(port) as client:
            pubsub = client.pubsub()
            pubsub.subscribe(*self.EVENTS)
            for _ in self.EVENTS:  # the subscriptions' confirmations
                assert pubsub.get_message(timeout=5) is not None
            self._subscribed.wait(10)
            while not self._stop.is_set():
                message = pubsub.get_message(timeout=0.05)
                if message is not None and message["type"] == "message":
                    self._heard(port)
            pubsub.close()

    def _heard(self, port: int) -> None:
        with self._lock:
            if port in self.named:
                return
            self.named.add(port)
            seen = (time.monotonic(), self.old.command_calls("evalsha"))
            self.first = self.first or seen
            if len(self.named) == len(self.group.sentinels):
                self.every = seen
                with connected(self.leader) as client:
                    self.leader_then = client.sentinel_master(self.group.service)

    def __enter__(self) -> _Named:
        for thread in self._threads:
            thread.start()
        self._subscribed.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)


@contextlib.contextmanager
def _sync_delay(group: SentinelGroup, servers: list[Any], seconds: int) -> Iterator[None]:
    """``repl-diskless-sync-delay`` on ``servers`` for the block; 0 on every server after."""
    for server in servers:
        with connected(server.port) as client:
            client.config_set("repl-diskless-sync-delay", seconds)
    try:
        yield
    finally:
        for server in group.servers:
            with connected(server.port) as client:
                client.config_set("repl-diskless-sync-delay", 0)


@TIMED
def test_sentinel_failover_under_load(group: SentinelGroup, timed: bool) -> None:
    """SENTINEL FAILOVER mymaster, two replicas, while 4 threads hit with the default failure
    mode, timeout and breaker: no exception (READONLY above all) reaches a caller; degraded
    decisions are counted; a fresh identity gets exactly its limit again, stored on the new
    primary, through the limiter that was running all along and through new sync and async
    limiters (``timed``: within 1.5 s of the first sentinel naming the new primary); after that
    naming, no more script calls reach the old primary than were already on their way
    (``timed``: those are counts of what 4 threads sent in a few milliseconds). With a second
    replica the leader of the failover keeps the old primary in its state, with the new epoch,
    until that replica has synced with the new primary: meanwhile the others name the new one,
    and it must win (issue #30: 6,571 calls reached the old primary in the 2.4 s after every
    sentinel named the new one). Decisions made by the old primary before the naming (and so
    lost when it is demoted) are counted."""
    prefix = f"sentinel-fo-{uuid.uuid4().hex[:8]}"
    policy = Policy("sfo", f"{LOAD_LIMIT}/hour")
    old = group.primary()
    replicas = [s for s in group.servers if s is not old]
    leader = group.sentinels[0].port  # a SENTINEL FAILOVER is led by the sentinel asked
    inexact: list[str] = []
    breakers = BreakerLog()
    with (
        Limiter.from_url(group.url, key_prefix=prefix, metrics=breakers) as limiter,
        _Named(group, old, leader) as named,
        HitLoad(limiter, policy, _names("sfo"), LOAD_THREADS) as load,
    ):
        with _sync_delay(group, replicas, SYNC_DELAY):
            load.wait_calls(3000)
            started = time.monotonic()
            with connected(leader) as client:
                assert client.execute_command("SENTINEL", "FAILOVER", group.service)
            new = wait_for(
                "a replica to be promoted",
                lambda: next((s for s in replicas if _is_primary(s)), None),
            )
            switched = time.monotonic()
            new_sync = _NewLimiterProbe("sync", group, prefix, new)
            new_async = _NewLimiterProbe("async", group, prefix, new)
            running = exact_again(limiter, PROBE, _fresh("run"), inexact, _llen_on(new))
            probes = {
                "running": _Begun(running),
                "new sync": _Begun(new_sync),
                "new async": _Begun(new_async),
            }
            wait_resumed(dict(probes), 60)
            wait_for("every sentinel to name the new primary", lambda: named.every is not None)
            load.wait_calls(3000)
            calls = old.command_calls("evalsha")
        healthy = group.wait_healthy()
        stats = load.stop()
    assert named.first is not None
    assert named.every is not None
    first, every = named.first[0], named.every[0]
    calls_after_first, calls_after_every = calls - named.first[1], calls - named.every[1]
    resumed = {name: probe.at for name, probe in probes.items() if probe.at is not None}
    assert sorted(resumed) == sorted(probes)
    lost = _lost_writes(group, prefix, policy, stats.admitted)
    over = {i: n for i, n in stats.admitted.items() if n > LOAD_LIMIT}
    readonly = [e for e in stats.exceptions if "READONLY" in e.upper()]
    after = ", ".join(f"{name} {t - first:+.2f} s" for name, t in resumed.items())
    print(
        f"\n[sentinel failover] replica promoted {switched - started:.2f} s after SENTINEL "
        f"FAILOVER, named by a sentinel {first - switched:.2f} s after that, by every sentinel "
        f"{every - first:.2f} s later (the leader's state then: port {named.leader_then['port']} "
        f"(old {old.port}, new {new.port}), {named.leader_then['flags']}); script calls reaching "
        f"the old primary after the first naming: {calls_after_first}, after every sentinel's: "
        f"{calls_after_every}; exact on the new primary again in attempts begun after the first "
        f"naming: {after} (attempts decided by the old primary: running {len(inexact)}, new sync "
        f"{len(new_sync.inexact)}, new async {len(new_async.inexact)}); old primary demoted, "
        f"group healthy {healthy - switched:.2f} s after; {stats.summary()}; identities with "
        f"lost writes {len(lost)} of {len(stats.admitted)}, e.g. {list(lost.items())[:2]}; "
        f"admitted over the limit by one caller alone {len(over)}; breakers: "
        f"{breakers.since(started)}"
    )
    assert readonly == []
    assert stats.exceptions == []
    assert group.primary() is new
    record(
        "sentinel_failover",
        named_after_promotion_s=round(first - switched, 2),
        named_by_every_sentinel_after_s=round(every - first, 2),
        script_calls_on_old_primary_after_named=calls_after_first,
        script_calls_on_old_primary_after_every_named=calls_after_every,
        **{f"exact_after_named_s[{n}]": round(t - first, 2) for n, t in resumed.items()},
        identities_with_lost_writes=len(lost),
        identities=len(stats.admitted),
    )
    # The condition of issue #30: when every sentinel named the new primary, the leader's own
    # state still named the old one (with the newest epoch), as it waited for the other replica.
    assert "failover_in_progress" in named.leader_then["flags"], named.leader_then
    assert int(named.leader_then["port"]) == old.port, named.leader_then
    if timed:
        # The limiter hears the first naming and switches: only the calls made while it asks
        # the sentinels which primary is the newest (a few milliseconds, the other threads going
        # on meanwhile) may still reach the old one (measured: 0-4; 923 when it asked every
        # second, thousands when the leader's state won).
        assert calls_after_first <= CALLS_AFTER_NAMED
        assert calls_after_every <= CALLS_AFTER_EVERY_NAMED
        for name, t in resumed.items():
            assert t - first <= NAMED_RESUME_WITHIN, name


def _names(tag: str) -> Callable[[int], Iterator[Identity]]:
    return lambda index: (f"{tag}-{index}-{n}" for n in itertools.count())


def _is_primary(server: Any) -> bool:
    with connected(server.port) as client:
        return client.info("replication")["role"] == "master"


def _lost_writes(
    group: SentinelGroup, prefix: str, policy: Policy, admitted: dict[Identity, int]
) -> dict[Identity, tuple[int, int]]:
    """{identity: (admitted exactly, stored now)} where the store holds fewer hits than it
    admitted: writes acknowledged by a primary and lost in the switch."""
    limit = policy.rates[0].limit
    lost = {}
    with Limiter.from_url(group.url, key_prefix=prefix, deny_cache=0, **strict()) as limiter:
        for identity, count in admitted.items():
            stored = limit - limiter.peek(policy, identity).remaining
            if stored < count:
                lost[identity] = (count, stored)
    return lost


def _llen_on(server: Any) -> Callable[[str], int]:
    def llen(key: str) -> int:
        with connected(server.port) as client:
            return int(client.llen(key))

    return llen


def test_the_newest_configuration_epoch_names_the_primary() -> None:
    """Of the sentinels' answers, the valid one with the highest configuration epoch wins: a
    sentinel that has not heard of a failover yet is outvoted by the one that led it, whatever
    the order they are asked in; a primary marked down is never named."""
    from redis.sentinel import MasterNotFoundError

    from ratekeeper._storage.redis._sentinel import NewestSentinel, _newest

    manager = NewestSentinel([("127.0.0.1", free_port())])  # nothing is asked of it here

    def state(port: int, epoch: int, **flags: bool) -> dict[str, Any]:
        return {
            "ip": "127.0.0.1",
            "port": port,
            "config-epoch": epoch,
            "is_master": True,
            "is_sdown": flags.get("sdown", False),
            "is_odown": flags.get("odown", False),
            "num-other-sentinels": 2,
        }

    stale, led = state(7001, 3), state(7002, 4)
    assert _newest(manager, "mymaster", [stale, led], []) == ("127.0.0.1", 7002)
    assert _newest(manager, "mymaster", [led, stale], []) == ("127.0.0.1", 7002)
    down = state(7003, 9, sdown=True)
    assert _newest(manager, "mymaster", [stale, down], []) == ("127.0.0.1", 7001)
    with pytest.raises(MasterNotFoundError, match=r"mymaster.*refused"):
        _newest(manager, "mymaster", [down], ["refused"])


def test_each_sentinel_names_the_address_it_gives_clients() -> None:
    """The leader of a failover takes the new epoch as soon as the promoted replica answers as
    a primary, but its ``SENTINEL MASTER`` state keeps the old primary's address until every
    other replica follows; the address it gives clients (``GET-MASTER-ADDR-BY-NAME``) is the
    new one, and that one is named, whatever the order of the answers (issue #30)."""
    from ratekeeper._storage.redis._sentinel import NewestSentinel, _advertised, _newest

    manager = NewestSentinel([("127.0.0.1", free_port())])  # nothing is asked of it here
    state = {"ip": "127.0.0.1", "port": 7001, "config-epoch": 4, "is_master": True}
    state |= {"is_sdown": False, "is_odown": False, "num-other-sentinels": 2}
    leader = _advertised({**state, "flags": "master,failover_in_progress"}, (b"127.0.0.1", 7002))
    follower = _advertised({**state, "port": 7002, "flags": "master"}, ("127.0.0.1", "7002"))
    assert leader == {**state, "port": 7002, "flags": "master,failover_in_progress"}
    assert _newest(manager, "mymaster", [leader, follower], []) == ("127.0.0.1", 7002)
    assert _newest(manager, "mymaster", [follower, leader], []) == ("127.0.0.1", 7002)
    assert _advertised(state, None) is None  # the sentinel gave no address: not an answer
    assert _newest(manager, "mymaster", [None, follower], []) == ("127.0.0.1", 7002)


def test_the_listener_hears_both_events_that_name_a_primary() -> None:
    """``+switch-master`` (every sentinel) and ``+failover-state-reconf-slaves`` (the leader,
    seconds before its own ``+switch-master`` when there are other replicas), for the service
    listened to only."""
    from ratekeeper._storage.redis._sentinel import MasterWatch, SwitchListener

    listener = SwitchListener(MasterWatch(None), [], "mymaster", {})

    def heard(channel: str, data: str) -> bool:
        return listener._names_service({"channel": channel.encode(), "data": data.encode()})

    assert heard("+switch-master", "mymaster 127.0.0.1 7001 127.0.0.1 7002")
    assert heard("+failover-state-reconf-slaves", "master mymaster 127.0.0.1 7001")
    assert not heard("+switch-master", "other 127.0.0.1 7001 127.0.0.1 7002")
    assert not heard("+failover-state-reconf-slaves", "master other 127.0.0.1 7001")
    assert not heard("+switch-master", "master mymaster 127.0.0.1 7001")
