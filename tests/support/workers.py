"""Worker functions for the multi-process tests, and :class:`Processes`, which runs them.

They live at module level in an importable module so that ``multiprocessing``'s "spawn" and
"forkserver" start methods can import them in the child. Each worker builds its own limiter,
reports ``{"pid", "admitted", "denied", "errors"}`` through a queue and closes everything it
opened (the round and lease workers report other counts alongside ``pid`` and ``errors``).
A generous timeout is used: a StorageTimeout would leave the outcome of a hit unknown and
make an exact count impossible, which is not what these workers measure.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import redis

from ratekeeper import AsyncLimiter, Limiter, Policy
from ratekeeper._engine.breaker import CircuitBreaker

#: Seconds a worker waits for the others at the start line before giving up.
BARRIER_TIMEOUT = 60.0
#: Reply and connect timeout for worker limiters: long enough never to fire on a loaded machine.
STORE_TIMEOUT = 10.0
#: Seconds the parent waits for each worker's report.
REPORT_TIMEOUT = 120.0


class Processes:
    """``count`` processes of the ``multiprocessing`` context ``ctx``, each running
    ``target(**kwargs, queue=...)``: started on entering, reaped on leaving (killed if one has
    not exited 30 s after the block)."""

    def __init__(self, ctx: Any, target: Any, count: int, **kwargs: Any) -> None:
        self.queue = ctx.Queue()
        self.procs = [
            ctx.Process(target=target, kwargs={**kwargs, "queue": self.queue}) for _ in range(count)
        ]

    def __enter__(self) -> Processes:
        for proc in self.procs:
            proc.start()
        return self

    def reports(self, timeout: float = REPORT_TIMEOUT) -> list[dict[str, Any]]:
        """One report from each process (``timeout`` seconds for each)."""
        return [self.queue.get(timeout=timeout) for _ in self.procs]

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        self.queue.close()
        self.queue.join_thread()


def run_processes(
    ctx: Any, target: Any, count: int, *, timeout: float = REPORT_TIMEOUT, **kwargs: Any
) -> list[dict[str, Any]]:
    """The reports of ``count`` :class:`Processes` running ``target``. Every process must exit
    0 and report, from a process of its own, no error."""
    with Processes(ctx, target, count, **kwargs) as running:
        results = running.reports(timeout)
    assert [proc.exitcode for proc in running.procs] == [0] * count
    assert len({result["pid"] for result in results}) == count
    for result in results:
        assert result["errors"] == []
    return results


def exact_options(key_prefix: str, *, server: bool = True) -> dict[str, Any]:
    """Limiter options for counting exactly.

    A store that cannot decide raises (``failure_mode="raise"``): a decision guessed by a
    failure mode would make the count meaningless. The breaker never opens on slow calls: with
    64 client threads on a small machine most calls take longer than the default 20 ms, while
    the store answers every one of them. ``server``: add the Redis timeouts.
    """
    options: dict[str, Any] = {
        "key_prefix": key_prefix,
        "failure_mode": "raise",
        "breaker": CircuitBreaker(slow_call=STORE_TIMEOUT),
    }
    if server:
        options.update(timeout=STORE_TIMEOUT, connect_timeout=STORE_TIMEOUT)
    return options


def _result(admitted: int, denied: int, errors: list[str]) -> dict[str, Any]:
    return {"pid": os.getpid(), "admitted": admitted, "denied": denied, "errors": errors}


def threaded_hits(
    *,
    url: str,
    key_prefix: str,
    policy_name: str,
    rates: str,
    identity: str,
    threads: int,
    hits_per_thread: int,
    cost: int,
    barrier: Any,
    queue: Any,
) -> None:
    """``threads`` threads share one Limiter and each hit ``hits_per_thread`` times.

    ``barrier`` is a ``multiprocessing.Barrier`` with one party per thread of every process, so
    all threads of all processes start hitting together. Admitted units of cost are reported.
    """
    policy = Policy(policy_name, rates)
    admitted = denied = 0
    errors: list[str] = []
    lock = threading.Lock()
    limiter = Limiter.from_url(url, **exact_options(key_prefix))

    def run() -> None:
        nonlocal admitted, denied
        mine_admitted = mine_denied = 0
        try:
            # A peek opens this thread's connection (and loads the script) without consuming.
            limiter.peek(policy, identity, cost)
            barrier.wait(BARRIER_TIMEOUT)
            for _ in range(hits_per_thread):
                if limiter.hit(policy, identity, cost).allowed:
                    mine_admitted += cost
                else:
                    mine_denied += 1
        except Exception as exc:
            with lock:
                errors.append(repr(exc))
        with lock:
            admitted += mine_admitted
            denied += mine_denied

    try:
        workers = [threading.Thread(target=run) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        limiter.close()
    queue.put(_result(admitted, denied, errors))


def async_hits(
    *,
    url: str,
    key_prefix: str,
    policy_name: str,
    rates: str,
    identity: str,
    tasks: int,
    hits_per_task: int,
    barrier: Any,
    queue: Any,
    batching: bool = True,
) -> None:
    """``tasks`` concurrent asyncio tasks share one AsyncLimiter and each hit ``hits_per_task``.

    ``barrier`` has one party per process: every process opens its connections first, then all
    processes release their tasks together. ``batching``: the AsyncLimiter option.
    """
    policy = Policy(policy_name, rates)
    errors: list[str] = []

    async def main() -> tuple[int, int]:
        limiter = AsyncLimiter.from_url(url, batching=batching, **exact_options(key_prefix))
        try:
            # Concurrent peeks open one connection per task without consuming anything.
            await asyncio.gather(*(limiter.peek(policy, identity) for _ in range(tasks)))
            barrier.wait(BARRIER_TIMEOUT)  # blocks the loop, which has nothing else to do yet

            async def run() -> tuple[int, int]:
                admitted = denied = 0
                for _ in range(hits_per_task):
                    if (await limiter.hit(policy, identity)).allowed:
                        admitted += 1
                    else:
                        denied += 1
                return admitted, denied

            results = await asyncio.gather(*(run() for _ in range(tasks)), return_exceptions=True)
        finally:
            await limiter.close()
        admitted = denied = 0
        for result in results:
            if isinstance(result, BaseException):
                errors.append(repr(result))
            else:
                admitted += result[0]
                denied += result[1]
        return admitted, denied

    try:
        admitted, denied = asyncio.run(main())
    except Exception as exc:
        errors.append(repr(exc))
        admitted = denied = 0
    queue.put(_result(admitted, denied, errors))


def sequential_hits(
    *,
    url: str,
    key_prefix: str,
    policy_name: str,
    rates: str,
    identity: str,
    hits: int,
    queue: Any,
) -> None:
    """One caller, ``hits`` hits in a row (for the fork test: no threads in the child)."""
    policy = Policy(policy_name, rates)
    admitted = denied = 0
    errors: list[str] = []
    try:
        with Limiter.from_url(url, **exact_options(key_prefix)) as limiter:
            for _ in range(hits):
                if limiter.hit(policy, identity).allowed:
                    admitted += 1
                else:
                    denied += 1
    except Exception as exc:
        errors.append(repr(exc))
    queue.put(_result(admitted, denied, errors))


# --- Every algorithm, in rounds -------------------------------------------------------------------

#: The frozen client time of the algorithm rounds: 12:30:30.5 UTC, the middle of a day, an hour
#: and a minute, so no epoch-aligned window of a day or less starts or ends during a run, and
#: every process of a run sees the same time whenever it hits.
FROZEN_AT = 1_699_920_000.0 + 12 * 3600 + 30 * 60 + 30.5


def frozen_clock() -> float:
    """The clock of the frozen rounds (module level, so spawned processes can import it)."""
    return FROZEN_AT


def round_policy(spec: dict[str, Any]) -> Policy:
    """The policy of one round: ``spec`` has ``name``, ``rates``, ``algorithm`` and ``burst``."""
    return Policy(spec["name"], spec["rates"], algorithm=spec["algorithm"], burst=spec["burst"])


def _round_limiters(url: str, key_prefix: str) -> dict[bool, Limiter]:
    """Two limiters: the store's clock (``False``) and the frozen client clock (``True``)."""
    store = Limiter.from_url(url, **exact_options(key_prefix))
    try:
        frozen = Limiter.from_url(url, clock=frozen_clock, **exact_options(key_prefix))
    except BaseException:
        store.close()
        raise
    return {False: store, True: frozen}


def _rounds_result(counts: dict[str, list[int]], errors: list[str]) -> dict[str, Any]:
    return {"pid": os.getpid(), "counts": counts, "errors": errors}


def threaded_rounds(
    *,
    url: str,
    key_prefix: str,
    rounds: list[dict[str, Any]],
    identity: str,
    threads: int,
    hits_per_thread: int,
    barrier: Any,
    queue: Any,
) -> None:
    """Run every round in turn: ``threads`` threads hit ``identity`` under the round's policy.

    ``barrier`` has one party per thread of every process and is passed once per round, so each
    round starts with all threads of all processes together, after every thread of the round
    before has finished. A thread that fails breaks the barrier, so the others fail fast too.
    Reports ``counts[round name] = [admitted, denied]``.
    """
    counts = {spec["name"]: [0, 0] for spec in rounds}
    errors: list[str] = []
    lock = threading.Lock()
    limiters = _round_limiters(url, key_prefix)

    def run() -> None:
        try:
            for spec in rounds:
                policy = round_policy(spec)
                limiter = limiters[spec["frozen"]]
                # Open this thread's connection and load the round's script, consuming nothing.
                limiter.peek(policy, identity)
                barrier.wait(BARRIER_TIMEOUT)
                admitted = denied = 0
                for _ in range(hits_per_thread):
                    if limiter.hit(policy, identity).allowed:
                        admitted += 1
                    else:
                        denied += 1
                with lock:
                    counts[spec["name"]][0] += admitted
                    counts[spec["name"]][1] += denied
        except Exception as exc:
            barrier.abort()
            with lock:
                errors.append(repr(exc))

    try:
        pool = [threading.Thread(target=run) for _ in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        for limiter in limiters.values():
            limiter.close()
    queue.put(_rounds_result(counts, errors))


def async_rounds(
    *,
    url: str,
    key_prefix: str,
    rounds: list[dict[str, Any]],
    identity: str,
    tasks: int,
    hits_per_task: int,
    barrier: Any,
    queue: Any,
    batching: bool = True,
) -> None:
    """Run every round in turn: ``tasks`` asyncio tasks hit ``identity`` under its policy
    (``batching``: the AsyncLimiter option).

    ``barrier`` has one party per process: before each round every process opens its connections
    and loads the round's script, then all of them release their tasks together.
    """
    counts = {spec["name"]: [0, 0] for spec in rounds}
    errors: list[str] = []

    async def one_round(limiter: AsyncLimiter, policy: Policy) -> tuple[int, int]:
        admitted = denied = 0
        for _ in range(hits_per_task):
            if (await limiter.hit(policy, identity)).allowed:
                admitted += 1
            else:
                denied += 1
        return admitted, denied

    async def main() -> None:
        limiters = {
            False: AsyncLimiter.from_url(url, batching=batching, **exact_options(key_prefix)),
            True: AsyncLimiter.from_url(
                url, clock=frozen_clock, batching=batching, **exact_options(key_prefix)
            ),
        }
        try:
            for spec in rounds:
                policy = round_policy(spec)
                limiter = limiters[spec["frozen"]]
                await asyncio.gather(*(limiter.peek(policy, identity) for _ in range(tasks)))
                try:
                    barrier.wait(BARRIER_TIMEOUT)  # blocks the loop, which has nothing to do
                except BaseException:
                    barrier.abort()
                    raise
                results = await asyncio.gather(
                    *(one_round(limiter, policy) for _ in range(tasks)), return_exceptions=True
                )
                for result in results:
                    if isinstance(result, BaseException):
                        errors.append(repr(result))
                    else:
                        counts[spec["name"]][0] += result[0]
                        counts[spec["name"]][1] += result[1]
        finally:
            for limiter in limiters.values():
                await limiter.close()

    try:
        asyncio.run(main())
    except Exception as exc:
        barrier.abort()
        errors.append(repr(exc))
    queue.put(_rounds_result(counts, errors))


# --- Concurrency leases ---------------------------------------------------------------------------


class _LeaseCounts:
    """What one lease worker thread saw; see :func:`threaded_leases`."""

    def __init__(self) -> None:
        self.acquired = self.denied = self.released = self.first_wave = 0
        self.overfull = self.max_seen = 0


class _LeaseThread:
    """The body of one thread of :func:`threaded_leases`."""

    def __init__(
        self,
        *,
        limiter: Limiter,
        client: redis.Redis,
        policy: Policy,
        identity: str,
        barrier: Any,
        in_flight: Any,
    ) -> None:
        self.limiter = limiter
        self.client = client
        self.policy = policy
        self.identity = identity
        self.barrier = barrier
        self.in_flight = in_flight
        self.limit = policy.rates[0].limit
        (self.key,) = limiter.keys(policy, identity)
        self.counts = _LeaseCounts()

    def _holding(self) -> None:
        with self.in_flight.get_lock():
            self.in_flight[0] += 1
            self.in_flight[1] = max(self.in_flight[1], self.in_flight[0])

    def _letting_go(self) -> None:
        with self.in_flight.get_lock():
            self.in_flight[0] -= 1

    def first_wave(self) -> None:
        """Everyone acquires at once; the granted hold their lease until everyone has tried."""
        counts = self.counts
        self.limiter.peek(self.policy, self.identity)  # connect, load the script
        self.barrier.wait(BARRIER_TIMEOUT)
        lease = self.limiter.acquire(self.policy, self.identity)
        if lease.allowed:
            self._holding()
            counts.acquired += 1
            counts.first_wave += 1
        else:
            counts.denied += 1
        self.barrier.wait(BARRIER_TIMEOUT)  # every granted lease is held at this point
        if lease.allowed:
            self._letting_go()
            counts.released += lease.release()
        self.barrier.wait(BARRIER_TIMEOUT)

    def churn(self, iterations: int) -> None:
        """Acquire, check the live leases while holding, release; ``iterations`` times."""
        counts = self.counts
        for _ in range(iterations):
            lease = self.limiter.acquire(self.policy, self.identity)
            if not lease.allowed:
                counts.denied += 1
                continue
            self._holding()
            counts.acquired += 1
            live = int(self.client.zcard(self.key))
            counts.max_seen = max(counts.max_seen, live)
            # This thread holds one lease: a peek must see at most limit - 1 free.
            peeked = self.limiter.peek(self.policy, self.identity)
            if live > self.limit or peeked.remaining > self.limit - 1:
                counts.overfull += 1
            self._letting_go()
            counts.released += lease.release()


def threaded_leases(
    *,
    url: str,
    key_prefix: str,
    policy_name: str,
    rates: str,
    identity: str,
    threads: int,
    iterations: int,
    barrier: Any,
    in_flight: Any,
    queue: Any,
) -> None:
    """``threads`` threads take and give back leases of one identity under a concurrency policy.

    ``in_flight`` is a shared ``multiprocessing.Array('i', 2)``: ``[0]`` counts leases held right
    now (incremented after a granted acquire, decremented before its release, so it never exceeds
    the leases really held) and ``[1]`` is the largest value ``[0]`` ever had.

    Phase 1: after ``barrier`` (one party per thread of every process), every thread acquires
    once and the granted ones hold their lease across a second ``barrier``: exactly ``limit``
    acquisitions can succeed. Phase 2: each thread loops ``iterations`` times: acquire; if
    granted, check the live leases on the server (ZCARD, with a client of its own) and with a
    peek, then release. Reports ``acquired``, ``denied``, ``released`` (releases that found the
    lease still held), ``first_wave`` (leases granted in phase 1), ``overfull`` (times a holder
    saw more than ``limit`` leases on the server, or too many free) and ``max_seen`` (the largest
    ZCARD a holder saw).
    """
    policy = Policy(policy_name, rates, algorithm="concurrency")
    errors: list[str] = []
    lock = threading.Lock()
    limiter = Limiter.from_url(url, **exact_options(key_prefix))
    client = redis.Redis.from_url(url, socket_timeout=STORE_TIMEOUT)
    bodies = [
        _LeaseThread(
            limiter=limiter,
            client=client,
            policy=policy,
            identity=identity,
            barrier=barrier,
            in_flight=in_flight,
        )
        for _ in range(threads)
    ]

    def run(body: _LeaseThread) -> None:
        try:
            body.first_wave()
            body.churn(iterations)
        except Exception as exc:
            barrier.abort()
            with lock:
                errors.append(repr(exc))

    try:
        pool = [threading.Thread(target=run, args=(body,)) for body in bodies]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        limiter.close()
        client.close()
    totals: dict[str, Any] = {"pid": os.getpid(), "errors": errors}
    for name in ("acquired", "denied", "released", "first_wave", "overfull"):
        totals[name] = sum(getattr(body.counts, name) for body in bodies)
    totals["max_seen"] = max(body.counts.max_seen for body in bodies)
    queue.put(totals)


# --- Waiting --------------------------------------------------------------------------------------


class _StampedLimiter(Limiter):
    """A Limiter that notes when it sent its last hit (``limiter.wait`` calls ``self.hit``)."""

    sent = 0.0

    def hit(self, policy: Policy, identity: Any, cost: int = 1) -> Any:
        import time

        self.sent = time.time()
        return super().hit(policy, identity, cost)


def waiting_calls(
    *,
    url: str,
    key_prefix: str,
    policy_name: str,
    rates: str,
    identity: str,
    tickets: Any,
    barrier: Any,
    queue: Any,
) -> None:
    """One caller takes tickets (a shared ``multiprocessing.Value('i')`` counting the calls
    left to make, as from a job queue) until none is left, and makes one call per ticket, each
    after ``limiter.wait(policy, identity)``.

    ``barrier`` has one party per process. Reports ``admissions``: for each call, the wall
    time (``time.time``, the clock a local store's ``TIME`` reads) just before the admitting
    hit was sent and just after it returned, so the store's admission time lies between them;
    ``started``: when this process passed the barrier.
    """
    import time

    policy = Policy(policy_name, rates)
    admissions: list[tuple[float, float]] = []
    errors: list[str] = []
    started = 0.0
    try:
        with _StampedLimiter.from_url(url, **exact_options(key_prefix)) as limiter:
            limiter.peek(policy, identity)  # connect and load the script, consuming nothing
            barrier.wait(BARRIER_TIMEOUT)
            started = time.time()
            while True:
                with tickets.get_lock():
                    if tickets.value == 0:
                        break
                    tickets.value -= 1
                decision = limiter.wait(policy, identity, timeout=60)
                admissions.append((limiter.sent, time.time()))
                if not decision.allowed or decision.degraded:
                    errors.append(f"wait returned {decision!r}")
    except Exception as exc:
        errors.append(repr(exc))
    queue.put({"pid": os.getpid(), "admissions": admissions, "started": started, "errors": errors})


def threaded_reservations(
    *,
    url: str,
    key_prefix: str,
    spec: dict[str, Any],
    threads: int,
    rounds: int,
    barrier: Any,
    queue: Any,
) -> None:
    """``threads`` threads each make ``rounds`` reservations of a random estimate (1-20) on
    ``"shared"`` under the frozen clock, settling a random actual (0-30) or, one in eight,
    cancelling. Reports ``reserved``: (monotonic time begun, admitted) per reservation, and
    ``settled``: (monotonic time ended, actual) per settle (CLOCK_MONOTONIC is one clock for
    every process of the machine)."""
    import random
    import time

    policy = round_policy(spec)
    reserved: list[tuple[float, bool]] = []
    settled: list[tuple[float, int]] = []
    errors: list[str] = []
    lock = threading.Lock()
    limiter = Limiter.from_url(url, clock=frozen_clock, **exact_options(key_prefix))

    def run(seed: int) -> None:
        rng = random.Random(seed)
        try:
            limiter.peek(policy, "shared")  # connect and load the script, consuming nothing
            barrier.wait(BARRIER_TIMEOUT)
            for _ in range(rounds):
                began = time.monotonic()
                reservation = limiter.reserve(policy, "shared", rng.randint(1, 20))
                with lock:
                    reserved.append((began, reservation.allowed))
                if not reservation.allowed:
                    continue
                if rng.random() < 0.125:
                    reservation.cancel()
                    continue
                actual = rng.randint(0, 30)
                reservation.settle(actual)
                ended = time.monotonic()
                with lock:
                    settled.append((ended, actual))
        except Exception as exc:
            barrier.abort()
            with lock:
                errors.append(repr(exc))

    try:
        base = os.getpid() * 1000
        pool = [threading.Thread(target=run, args=(base + i,)) for i in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        limiter.close()
    queue.put({"pid": os.getpid(), "reserved": reserved, "settled": settled, "errors": errors})
