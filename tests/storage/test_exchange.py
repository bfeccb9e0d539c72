"""The script-execution rule (``_storage/redis/_exchange.py``), on its own: no server, no I/O.

Every transport drives this object, so what it decides here is what each of them does.
"""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    DataError,
    InvalidResponse,
    MovedError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from ratekeeper import (
    RequestRejected,
    StorageError,
    StorageFull,
    StorageResponseError,
    StorageTimeout,
    StorageUnavailable,
)
from ratekeeper._algorithms.scripts import load_script
from ratekeeper._storage.redis._errors import translate
from ratekeeper._storage.redis._exchange import DONE, RECONNECT, SEND, Exchange

SCRIPT = load_script("sliding_log")
KEYS = ("rk:p:{tag}:log",)
ARGS = (1, 2, "x")
EVALSHA = ("EVALSHA", SCRIPT.sha, 1, *KEYS, *ARGS)


def _exchange() -> Exchange:
    return Exchange(SCRIPT, KEYS, ARGS)


def test_a_reply_ends_the_exchange_with_its_result() -> None:
    exchange = _exchange()
    assert exchange.command == EVALSHA
    assert exchange.replied([1, 2, 3]) == DONE
    assert exchange.done
    assert exchange.outcome() == [1, 2, 3]


def test_noscript_loads_then_evalsha_then_eval() -> None:
    exchange = _exchange()
    assert exchange.replied(NoScriptError("No matching script")) == SEND
    assert exchange.loading
    assert exchange.command == ("SCRIPT", "LOAD", SCRIPT.source)
    assert exchange.replied(SCRIPT.sha.encode()) == SEND
    assert not exchange.loading
    assert exchange.command == EVALSHA
    # Flushed again between the load and the call: EVAL carries the script.
    assert exchange.replied(NoScriptError("No matching script")) == SEND
    assert exchange.command == ("EVAL", SCRIPT.source, 1, *KEYS, *ARGS)
    assert exchange.replied([0]) == DONE
    assert exchange.outcome() == [0]


def test_noscript_after_eval_is_an_error_not_a_loop() -> None:
    exchange = _exchange()
    steps = [
        exchange.replied(NoScriptError("x")),
        exchange.replied(b"sha"),
        exchange.replied(NoScriptError("x")),
        exchange.replied(NoScriptError("x")),
    ]
    assert steps == [SEND, SEND, SEND, DONE]
    with pytest.raises(StorageResponseError):
        exchange.outcome()


def test_a_failed_load_ends_the_exchange() -> None:
    exchange = _exchange()
    exchange.replied(NoScriptError("x"))
    assert exchange.replied(OutOfMemoryError("command not allowed when used memory")) == DONE
    with pytest.raises(StorageResponseError):
        exchange.outcome()


def test_a_connection_closed_before_the_write_is_sent_again_once() -> None:
    exchange = _exchange()
    broken = redis.ConnectionError("closed while idle")
    assert exchange.unsent(broken, broke=True) == RECONNECT
    assert exchange.command == EVALSHA  # the same command, on a fresh connection
    assert exchange.unsent(broken, broke=True) == DONE
    with pytest.raises(StorageUnavailable) as excinfo:
        exchange.outcome()
    assert excinfo.value.__cause__ is broken


def test_one_reconnect_per_call_also_across_a_reload() -> None:
    exchange = _exchange()
    assert exchange.unsent(redis.ConnectionError("x"), broke=True) == RECONNECT
    assert exchange.replied(NoScriptError("x")) == SEND
    assert exchange.unsent(redis.ConnectionError("x"), broke=True) == DONE


def test_a_connection_that_could_not_be_made_is_not_tried_again() -> None:
    exchange = _exchange()
    assert exchange.unsent(redis.ConnectionError("refused"), broke=False) == DONE
    with pytest.raises(StorageUnavailable):
        exchange.outcome()


def test_a_connection_lost_after_the_write_is_never_sent_again() -> None:
    exchange = _exchange()
    assert exchange.lost(redis.ConnectionError("reset")) == DONE
    with pytest.raises(StorageUnavailable):
        exchange.outcome()


def test_a_timeout_is_never_sent_again() -> None:
    exchange = _exchange()
    assert exchange.timed_out(redis.TimeoutError("no reply")) == DONE
    with pytest.raises(StorageTimeout):
        exchange.outcome()


@pytest.mark.parametrize(
    "exc",
    [
        redis.TimeoutError("no reply"),
        TimeoutError("ETIMEDOUT"),  # the kernel's: a timeout on every transport, as redis-py has it
        BlockingIOError("EAGAIN"),  # a socket timeout set in the kernel
        asyncio.TimeoutError(),  # not a TimeoutError before Python 3.11
    ],
    ids=["redis", "builtin", "eagain", "asyncio"],
)
@pytest.mark.parametrize("sent", [False, True], ids=["on-write", "on-read"])
def test_every_transport_failure_that_is_a_timeout_is_one_never_sent_again(
    exc: Exception, sent: bool
) -> None:
    """``Exchange.failed`` is the one classification the three transports share."""
    exchange = _exchange()
    assert exchange.failed(exc, sent=sent, seconds=0.02) == DONE
    with pytest.raises(StorageTimeout):
        exchange.outcome()


@pytest.mark.parametrize(
    "exc",
    [redis.ConnectionError("reset"), ConnectionResetError(104, "reset"), OSError(32, "EPIPE")],
    ids=["redis", "reset", "oserror"],
)
def test_a_connection_broken_on_the_write_is_sent_again_once_and_after_it_never(
    exc: Exception,
) -> None:
    on_write = _exchange()
    assert on_write.failed(exc, sent=False, seconds=0.02) == RECONNECT
    assert on_write.command == EVALSHA
    assert on_write.failed(exc, sent=False, seconds=0.02) == DONE
    with pytest.raises(StorageUnavailable):
        on_write.outcome()
    on_read = _exchange()
    assert on_read.failed(exc, sent=True, seconds=0.02) == DONE  # it may have run
    with pytest.raises(StorageUnavailable):
        on_read.outcome()


def test_the_command_path_reports_raised_errors() -> None:
    reload = _exchange()
    assert reload.raised(NoScriptError("x")) == SEND
    assert reload.loading
    for exc, kind in (
        (redis.TimeoutError("x"), StorageTimeout),
        (redis.ConnectionError("x"), StorageUnavailable),
        (ResponseError("WRONGTYPE Operation against a key"), RequestRejected),
    ):
        exchange = _exchange()
        assert exchange.raised(exc) == DONE
        with pytest.raises(kind):
            exchange.outcome()


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (redis.TimeoutError("Timeout reading from socket"), StorageTimeout),
        (redis.ConnectionError("Connection refused"), StorageUnavailable),
        (redis.AuthenticationError("invalid password"), RequestRejected),
        (RedisClusterException("Redis Cluster cannot be connected"), StorageUnavailable),
        (InvalidResponse("Protocol error"), StorageUnavailable),
        (OutOfMemoryError("command not allowed"), StorageFull),
        (ResponseError("OOM command not allowed when used memory > 'maxmemory'"), StorageFull),
        (ReadOnlyError("You can't write against a read only replica."), StorageResponseError),
        (ResponseError("LOADING Redis is loading the dataset in memory"), StorageResponseError),
        (ResponseError("BUSY Redis is busy running a script"), StorageResponseError),
        (ClusterDownError("The cluster is down"), StorageResponseError),
        (TryAgainError("Multiple keys request during rehashing of slot"), StorageResponseError),
        (MovedError("3999 127.0.0.1:6381"), StorageResponseError),
        (AskError("3999 127.0.0.1:6381"), StorageResponseError),
        (ResponseError("CROSSSLOT Keys in request don't hash to the same slot"), RequestRejected),
        (ResponseError("WRONGTYPE Operation against a key"), RequestRejected),
        (ResponseError("ERR user_script:1: Script attempted to access a key"), RequestRejected),
        (DataError("Invalid input of type: 'NoneType'"), RequestRejected),
    ],
)
def test_every_client_error_has_one_class(exc: Exception, kind: type[Exception]) -> None:
    error = translate(exc)
    assert type(error) is kind
    assert error.__cause__ is exc
    # Only store failures reach a failure mode; RequestRejected never does.
    assert isinstance(error, StorageError) is (kind is not RequestRejected)
