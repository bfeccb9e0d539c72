"""redis-py's command path: an exchange driven through ``client.execute_command``.

Used for Redis Cluster, where redis-py's client finds the node that serves a slot and follows
MOVED and ASK redirections as the cluster changes (``_config`` narrows the errors after which
it sends a command again to those that say it did not run). It is also where calls of an
asyncio cluster batch go when their node redirected them or could not be reached.

``execute_command`` sends and reads in one, so a broken connection cannot be told apart from
one that broke after the write: it is never sent again here (redis-py's own check-out replaces
a connection the server closed while it was idle). Error replies go on to the exchange as
replies; other client errors end it. Nothing else is caught.

redis-py internals: none; ``execute_command`` and its exceptions.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import time
from typing import Any

from ._errors import CLIENT_ERRORS
from ._exchange import DONE, Exchange

__all__ = ["arun_command_path", "run_command_path"]


def _spelled(exchange: Exchange) -> tuple[Any, ...]:
    # redis-py's cluster client sends "SCRIPT LOAD", spelled as one word, to every primary.
    if exchange.loading:
        return ("SCRIPT LOAD", *exchange.command[2:])
    return exchange.command


def run_command_path(client: Any, exchange: Exchange) -> None:
    """Drive ``exchange`` to its end on a blocking client."""
    step = 0
    while step != DONE:
        exchange.sent = time.perf_counter()  # the last round trip (redis-py may connect in it)
        try:
            reply = client.execute_command(*_spelled(exchange))
        except CLIENT_ERRORS as exc:
            step = exchange.raised(exc)
        else:
            step = exchange.replied(reply)


async def arun_command_path(client: Any, exchange: Exchange) -> None:
    """Drive ``exchange`` to its end on an asyncio client."""
    step = 0
    while step != DONE:
        exchange.sent = time.perf_counter()  # the last round trip (redis-py may connect in it)
        try:
            reply = await client.execute_command(*_spelled(exchange))
        except CLIENT_ERRORS as exc:
            step = exchange.raised(exc)
        else:
            step = exchange.replied(reply)
