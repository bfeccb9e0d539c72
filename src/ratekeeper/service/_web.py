"""The service's HTTP side, a small ASGI app served by uvicorn:

* ``POST /json``: a ``RateLimitRequest`` in proto3 JSON form, answered with the
  ``RateLimitResponse`` in the same form and envoyproxy/ratelimit's status codes: 200 (OK),
  429 (OVER_LIMIT), 400 (a body that is not a request, or a request that cannot be decided),
  500 (an overall code of UNKNOWN); 503 when the store failed under ``failure_mode="raise"``
* ``GET /healthcheck``: 200 ``OK`` while a configuration is loaded and the server is not
  shutting down, else 503
* ``GET /metrics``: Prometheus exposition (see ``_metrics``)
* ``GET /rlconfig``: the configuration in force, as JSON
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from google.protobuf import json_format

from .._errors import StorageError
from ..asgi import answer_lifespan
from ._decide import BadRequest, Decider
from ._metrics import ServiceMetrics
from .rls_pb2 import RateLimitRequest, RateLimitResponse

__all__ = ["MAX_BODY", "ServiceApp"]

log = logging.getLogger("ratekeeper.service")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

#: The largest request body read (a request with thousands of descriptors fits easily).
MAX_BODY = 1 << 20

_JSON = b"application/json"
_TEXT = b"text/plain; charset=utf-8"


async def _respond(send: Send, status: int, body: bytes, content_type: bytes = _TEXT) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ServiceApp:
    """The ASGI app; ``decider.config`` is read on each request, so reloads show at once.
    ``healthy`` is cleared when the server starts shutting down."""

    def __init__(self, decider: Decider, metrics: ServiceMetrics) -> None:
        self.decider = decider
        self.metrics = metrics
        self.healthy = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/json":
            if method != "POST":
                await _respond(send, 405, b"use POST\n")
                return
            body = await self._body(receive)
            if body is None:
                await _respond(send, 413, b"request body too large\n")
                return
            await self._json(send, body)
        elif path in ("/healthcheck", "/metrics", "/rlconfig"):
            if method not in ("GET", "HEAD"):
                await _respond(send, 405, b"use GET\n")
            elif path == "/healthcheck":
                if self.healthy:
                    await _respond(send, 200, b"OK")
                else:
                    await _respond(send, 503, b"shutting down\n")
            elif path == "/metrics":
                text, content_type = self.metrics.render()
                await _respond(send, 200, text, content_type.encode())
            else:
                shown = self.decider.config.to_dict()
                await _respond(send, 200, json.dumps(shown, indent=2).encode() + b"\n", _JSON)
        else:
            await _respond(send, 404, b"not found\n")

    @staticmethod
    async def _body(receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b""
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _json(self, send: Send, body: bytes) -> None:
        try:
            request = json_format.Parse(body, RateLimitRequest())
        except (json_format.ParseError, UnicodeDecodeError) as exc:
            await _respond(send, 400, f"bad request: {exc}\n".encode())
            return
        try:
            response = await self.decider.should_rate_limit(request)
        except BadRequest as exc:
            await _respond(send, 400, f"bad request: {exc}\n".encode())
            return
        except StorageError as exc:
            await _respond(send, 503, f"the store failed: {exc}\n".encode())
            return
        text = json_format.MessageToJson(response, indent=None).encode()
        code = response.overall_code
        status = 429 if code == RateLimitResponse.OVER_LIMIT else 200
        if code == RateLimitResponse.UNKNOWN:
            status = 500
        await _respond(send, status, text, _JSON)
