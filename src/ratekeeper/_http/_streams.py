"""Response bodies that run a step when their last chunk is ready, before handing it on: the
``reported_cost`` settlement of the WSGI middleware, Flask and Django, so the charge is recorded
before the client sees the end of the response (and can send its next request). The ASGI
middleware does the same on its ``more_body=False`` message.

A body that is not read to its end (the client went away) runs the step with ``False`` when it
is closed: the abandoned response is charged what was reported so far, or the estimate if more
(``Limiting.finish``).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

__all__ = ["LastChunk", "last_chunk_async"]

_END: Any = object()


class LastChunk:
    """Iterates ``chunks``, calling ``finish(True)`` once the last one is ready and before it
    is yielded (at once for an empty body); once only, however often it is iterated. ``close``
    closes ``chunks`` (PEP 3333: the server calls it, read to the end or not), and calls
    ``finish(False)`` first if the last chunk was never reached."""

    __slots__ = ("_chunks", "_finish")

    def __init__(self, chunks: Iterable[bytes], finish: Callable[[bool], None]) -> None:
        self._chunks = chunks
        self._finish: Callable[[bool], None] | None = finish

    def __iter__(self) -> Iterator[bytes]:
        iterator = iter(self._chunks)
        ahead = next(iterator, _END)
        if ahead is _END:
            self._done()
        while ahead is not _END:
            current, ahead = ahead, next(iterator, _END)
            if ahead is _END:
                self._done()
            yield current

    def _done(self, complete: bool = True) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish(complete)

    def close(self) -> None:
        try:
            self._done(complete=False)  # nothing if the last chunk was reached
        finally:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()


async def last_chunk_async(
    chunks: AsyncIterable[bytes], finish: Callable[[bool], Awaitable[None]]
) -> AsyncIterator[bytes]:
    """:class:`LastChunk` for an async body: ``await finish(True)`` before the last chunk, or
    ``await finish(False)`` when the body is closed before it."""
    finished = False
    try:
        iterator = aiter(chunks)
        ahead = await anext(iterator, _END)
        if ahead is _END:
            finished = True
            await finish(True)
        while ahead is not _END:
            current, ahead = ahead, await anext(iterator, _END)
            if ahead is _END:
                finished = True
                await finish(True)
            yield current
    finally:
        if not finished:
            await finish(False)
