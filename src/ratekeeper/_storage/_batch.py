"""Auto-batching for asyncio: calls made while the connection is busy share the next round trip.

``Batcher.submit`` queues a call and returns a future. If fewer than ``lanes`` batches are in
flight, a flush task is started; it runs on the event loop's next turn, so every call submitted
in the meantime (by other tasks) goes out with it. No timer is involved: a lone call waits for
nothing but the loop's next turn, and under load a batch holds whatever arrived while the
previous one was on the wire. Each call keeps its own result or error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from .._errors import StorageError
from .._scripts import Script

__all__ = ["MAX_BATCH", "Batcher", "Pending"]

#: The most calls one round trip carries: a batch of scripts keeps the server busy while it
#: runs, so a huge one would delay other clients (about 10 µs per script).
MAX_BATCH = 256


class Pending:
    """One queued script call and the future its caller awaits."""

    __slots__ = ("args", "future", "keys", "script")

    def __init__(
        self,
        script: Script,
        keys: tuple[str, ...],
        args: tuple[int | str, ...],
        future: asyncio.Future[Any],
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.future = future

    def resolve(self, reply: Any) -> None:
        if not self.future.done():  # the caller may have been cancelled meanwhile
            self.future.set_result(reply)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


Send = Callable[[list[Pending]], Awaitable[None]]


class Batcher:
    """Coalesces calls into batches for ``send``, at most ``lanes`` batches in flight.

    ``send`` must settle every call of its batch (``resolve`` or ``fail``); a call it leaves
    unsettled, or every call if it raises, fails with a StorageError.
    """

    def __init__(self, send: Send, *, lanes: int = 1, max_batch: int = MAX_BATCH) -> None:
        self._send = send
        self._lanes = lanes
        self._max_batch = max_batch
        self._queue: list[Pending] = []
        self._flushing = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(
        self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # Futures belong to one loop; a limiter reused on a new loop starts afresh.
            self._loop, self._queue, self._flushing = loop, [], 0
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append(Pending(script, keys, args, future))
        if self._flushing < self._lanes:
            self._flushing += 1
            task = loop.create_task(self._flush(loop))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return future

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while self._queue and self._loop is loop:
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                # A caller cancelled before its call went out consumes nothing.
                batch = [call for call in batch if not call.future.done()]
                if not batch:
                    continue
                try:
                    await self._send(batch)
                except asyncio.CancelledError:
                    for call in batch:
                        call.future.cancel()
                    raise
                except Exception as exc:
                    error = exc if isinstance(exc, StorageError) else StorageError(str(exc))
                    for call in batch:
                        call.fail(error)
                for call in batch:
                    call.fail(StorageError("the batch ended without a reply for this call"))
        finally:
            if self._loop is loop:
                self._flushing -= 1
