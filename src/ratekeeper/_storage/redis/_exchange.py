"""Running one script call on a server, written once and without I/O.

An ``Exchange`` is one call's conversation with the store. It says what to send
(``exchange.command``), and each transport tells it what happened; it answers with what to do
next (``SEND``, ``RECONNECT`` or ``DONE``). Every transport drives it the same way: the blocking
path (``_blocking``), the asyncio pipeline (``_pipeline``, a batch of exchanges per round trip,
also per cluster node), ratekeeper's own asyncio links (``_protocol``) and redis-py's command
path (``_command``). A transport only moves bytes; the rule lives here:

- ``EVALSHA`` first. On NOSCRIPT (a restart, ``SCRIPT FLUSH``, a failover to a replica with a
  cold cache): ``SCRIPT LOAD``, then ``EVALSHA`` again; on a second NOSCRIPT (flushed once more
  in between) ``EVAL`` with the source, which cannot meet NOSCRIPT. At most four commands.
- A connection that broke before the request could reach the server (the server had closed
  it before the write; the write failed): reconnect and send once more, once per call. A
  connection that could not be made is not tried again: the store is down, and the failure
  mode decides at once.
- No reply in time, or a connection that broke after the write: the script may have run, so
  the call is never sent again. ``StorageTimeout`` / ``StorageUnavailable``.
- Every reply and client error is classified once, by ``_errors.translate``: a result,
  a ``StorageError`` (the failure mode applies) or ``RequestRejected`` (raised).

A transport's own writes and reads fail with one set of exceptions (``_errors.IO_ERRORS``),
which ``failed`` classifies for all of them: a timeout whenever it happened, a broken
connection by whether the write had gone out. Anything else raised while they run (a
``TypeError``, a bug) is not the store failing: it propagates to the caller untouched.

redis-py internals: none. Error replies arrive as the exception objects redis-py's parser
builds (``NoScriptError``, ``ResponseError``, ...), returned rather than raised.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from ..._algorithms.scripts import Script
from ..._model.errors import RequestRejected, StorageError
from ._errors import TIMEOUTS, as_broken, as_timeout, translate

__all__ = ["DONE", "RECONNECT", "SEND", "Exchange"]

#: What the transport does next: send ``exchange.command`` on the same connection; disconnect,
#: connect again and send it; or nothing (``result`` or ``error`` is final).
SEND = 0
RECONNECT = 1
DONE = 2

# Stages: the command in flight.
_EVALSHA = 0
_LOAD = 1
_RETRY = 2  # EVALSHA after a load
_EVAL = 3


@cache
def _load_command(script: Script) -> tuple[str, str, bytes]:
    """``SCRIPT LOAD`` of ``script``: one tuple per script, so a batch can send it once for
    every call that needs it."""
    return ("SCRIPT", "LOAD", script.source)


class Exchange:
    """One script call: what to send next, and what each answer means."""

    __slots__ = (
        "_call",
        "_reconnected",
        "_stage",
        "answered",
        "command",
        "done",
        "error",
        "key",
        "loading",
        "result",
        "script",
        "sent",
    )

    def __init__(self, script: Script, keys: tuple[str, ...], args: tuple[int | str, ...]) -> None:
        self.script = script
        self.key = keys[0]  # every key of a call shares one hash tag: this one places it
        self._call: tuple[Any, ...] = ("EVALSHA", script.sha, len(keys), *keys, *args)
        #: The command to send now.
        self.command: tuple[Any, ...] = self._call
        #: The script's reply, once DONE without an error.
        self.result: Any = None
        #: The error the caller gets, once DONE with one.
        self.error: StorageError | RequestRejected | None = None
        #: Whether ``result`` or ``error`` is final.
        self.done = False
        self._stage = _EVALSHA
        #: Whether ``command`` is the script's ``SCRIPT LOAD``, the same for every call of the
        #: script (a batch sends it once and feeds the reply to each).
        self.loading = False
        self._reconnected = False
        #: When its last round trip began (``time.perf_counter()``), set by the transports
        #: where it differs from when the caller asked: after a queue, a new connection or a
        #: script load; 0.0 if it did not. The breaker judges the store by that round trip.
        self.sent = 0.0
        #: When its reply reached this process (``time.perf_counter()``): the kernel's
        #: receive time on ratekeeper's own TCP links (``_link``), else when it was read where
        #: the transport says; 0.0 where it does not (then: when the caller got it).
        self.answered = 0.0

    def replied(self, reply: Any) -> int:
        """The server answered ``command`` with ``reply`` (an error reply as an exception)."""
        if not isinstance(reply, Exception):
            if self._stage == _LOAD:
                self._stage = _RETRY
                self.loading = False
                self.command = self._call
                return SEND
            self.result = reply
            self.done = True
            return DONE
        if isinstance(reply, NoScriptError) and self._stage in (_EVALSHA, _RETRY):
            if self._stage == _EVALSHA:
                self._stage = _LOAD
                self.loading = True
                self.command = _load_command(self.script)
            else:  # flushed again between the load and the call
                self._stage = _EVAL
                self.command = ("EVAL", self.script.source, *self._call[2:])
            return SEND
        return self._fail(reply)

    def unsent(self, exc: Exception, *, broke: bool) -> int:
        """``command`` did not reach the server: the connection ``broke`` (closed by the server
        before the write, or the write failed), or could not be made at all."""
        if broke and not self._reconnected:
            self._reconnected = True
            return RECONNECT
        return self._fail(exc)

    def failed(self, exc: BaseException, *, sent: bool, seconds: float | None) -> int:
        """The transport's own write of ``command`` (``sent=False``) or read of its reply
        (``sent=True``) raised ``exc``, one of ``IO_ERRORS``. A timeout is ``timed_out``
        wherever it happened (a write that timed out may have gone out; ``seconds``, the
        transport's timeout, for its message); a connection that broke on the write is
        ``unsent`` (sent again once), one that broke after it ``lost``."""
        if isinstance(exc, TIMEOUTS):
            return self.timed_out(as_timeout(exc, seconds))
        if sent:
            return self.lost(as_broken(exc))
        return self.unsent(as_broken(exc), broke=True)

    def lost(self, exc: Exception) -> int:
        """The connection broke after ``command`` was written: it may have run."""
        return self._fail(exc)

    def timed_out(self, exc: Exception) -> int:
        """No reply in time: ``command`` may have run."""
        return self._fail(exc)

    def raised(self, exc: Exception) -> int:
        """A client-library call that sends and reads in one (redis-py's command path) raised
        ``exc``: an error reply goes on as one; anything else may have run and is final."""
        if isinstance(exc, ResponseError):
            return self.replied(exc)
        return self._fail(exc)

    def _fail(self, exc: Exception) -> int:
        self.error = translate(exc)
        self.done = True
        return DONE

    def outcome(self) -> Any:
        """The script's reply; raises the call's error instead, if it has one."""
        if self.error is not None:
            raise self.error
        return self.result
