"""Auto-batching for asyncio: calls made while the connection is busy share the next round trip.

``Batcher.submit`` puts a call in the queue of its lane, chosen by its first key, and returns a
future. If that lane has no batch in flight, a flush task is started; it runs on the event
loop's next turn, so every call submitted to the lane in the meantime (by other tasks) goes out
with it. No timer is involved: a lone call waits for nothing but the loop's next turn, and under
load a batch holds whatever arrived while the lane's previous one was on the wire. Each call
keeps its own result or error.

A stall is not waited out twice: when a batch to one server times out, the calls queued behind
it in its lane (which waited for it) fail at once with a StorageTimeout, never sent, so they
consumed nothing. Without it, a call queued behind a batch in flight during a stall waited for
that batch's timeout, then for its own. A queue that is long only because many calls came at
once (a burst of thousands from one ``asyncio.gather``) is worked through: the store answers
it, however long that takes, and no caller is failed for the event loop's own work.

Lanes keep the client and the server busy at once: while the server runs one lane's batch, the
event loop works through the replies of another. A key always takes the same lane, and a lane
sends one batch at a time, so the calls on one key run in the order they were made. (Lanes
chosen by arrival instead could let a later call on a key overtake an earlier one on another
connection.)

redis-py internals: none (the pipeline it feeds is ``_pipeline``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..._algorithms.scripts import Script
from ..._model.errors import StorageError, StorageTimeout
from ._exchange import Exchange

__all__ = ["MAX_BATCH", "Batcher", "Pending"]

#: The most calls one round trip carries: a batch of scripts keeps the server busy while it
#: runs, so a huge one would delay other clients (about 10 µs per script).
MAX_BATCH = 256


class Pending:
    """One queued script call: its exchange, and the future its caller awaits."""

    __slots__ = ("exchange", "future")

    def __init__(self, exchange: Exchange, future: asyncio.Future[Any] | None) -> None:
        self.exchange = exchange
        #: None: the caller reads the exchange itself once its transport returns.
        self.future = future

    def deliver(self) -> None:
        """Hand the exchange's outcome to the caller (unless it was cancelled meanwhile)."""
        if self.future is None or self.future.done():
            return
        exchange = self.exchange
        if exchange.error is not None:
            self.future.set_exception(exchange.error)
        elif exchange.done:
            self.future.set_result(exchange.result)
        else:
            self.future.set_exception(
                RuntimeError("ratekeeper bug: a batch ended before this call's exchange did")
            )

    @property
    def cancelled(self) -> bool:
        """Whether the caller gave up (or was answered) before the call went out."""
        return self.future is not None and self.future.done()

    def cancel(self) -> None:
        if self.future is not None:
            self.future.cancel()

    def fail(self, exc: BaseException) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(exc)


Send = Callable[[list[Pending]], Awaitable[None]]


class Batcher:
    """Coalesces calls into batches for ``send``: ``lanes`` queues, one batch in flight each.

    ``send`` drives every exchange of its batch to its end; then each caller gets its own
    exchange's outcome. If ``send`` raises, that is not the store failing (store failures end
    the exchanges): every caller of the batch gets the exception as it is, never a decision.
    """

    def __init__(
        self, send: Send, *, lanes: int = 1, max_batch: int = MAX_BATCH, one_server: bool = True
    ) -> None:
        self._send = send
        self._lanes = lanes
        self._max_batch = max_batch
        #: Whether a lane's calls all go to one server (not a cluster's several): then a batch
        #: that timed out means the calls queued behind it would go into the same stall.
        self._one_server = one_server
        self._queues: list[list[Pending]] = [[] for _ in range(lanes)]
        self._flushing = [False] * lanes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(
        self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> asyncio.Future[Any]:
        """Queue a call; its future gets the reply or the error."""
        pending = self.enqueue(script, keys, args)
        assert pending.future is not None
        return pending.future

    def enqueue(
        self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> Pending:
        """Queue a call; its exchange tells when it was sent, and its future the outcome."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # Futures belong to one loop; a limiter reused on a new loop starts afresh.
            self._loop = loop
            self._queues = [[] for _ in range(self._lanes)]
            self._flushing = [False] * self._lanes
        pending = Pending(Exchange(script, keys, args), loop.create_future())
        lane = hash(keys[0]) % self._lanes if self._lanes > 1 else 0
        self._queues[lane].append(pending)
        if not self._flushing[lane]:
            self._flushing[lane] = True
            task = loop.create_task(self._flush(loop, lane))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return pending

    async def _flush(self, loop: asyncio.AbstractEventLoop, lane: int) -> None:
        queue = self._queues[lane]
        try:
            while queue and self._loop is loop:
                batch = queue[: self._max_batch]
                del queue[: self._max_batch]
                # A caller cancelled before its call went out consumes nothing.
                batch = [call for call in batch if not call.cancelled]
                if not batch:
                    continue
                try:
                    await self._send(batch)
                except asyncio.CancelledError:
                    for call in batch:
                        call.cancel()
                    raise
                except Exception as exc:  # a bug, not the store: it reaches the callers
                    for call in batch:
                        call.fail(exc)
                    continue
                for call in batch:
                    call.deliver()
                stalled = _timed_out(batch) if self._one_server else None
                if stalled is not None and queue:
                    # Those queued behind it waited for it: they are not sent into the stall.
                    waited = StorageTimeout(
                        f"not sent: the store did not answer the batch ahead in time ({stalled})"
                    )
                    for call in queue:
                        call.fail(waited)
                    queue.clear()
        finally:
            if self._loop is loop:
                self._flushing[lane] = False


def _timed_out(batch: list[Pending]) -> StorageError | None:
    """The timeout ``batch`` ended with, if it did: replies come in order, so the last call
    times out whenever any does."""
    error = batch[-1].exchange.error
    return error if isinstance(error, StorageTimeout) else None
