"""The service's HTTP side, a small ASGI app served by uvicorn:

* ``POST /json``: a ``RateLimitRequest`` in proto3 JSON form, answered with the
  ``RateLimitResponse`` in the same form and envoyproxy/ratelimit's status codes: 200 (OK),
  429 (OVER_LIMIT), 400 (a body that is not a request, or a request that cannot be decided),
  500 (an overall code of UNKNOWN); 503 when the store failed under ``failure_mode="raise"``
* ``POST /reserve``: what ``/json`` takes and answers, each descriptor's hits reserved; a
  descriptor whose reservation is held gets a ``reservation`` token in its status (none when
  the request is refused as a whole: what it reserved is cancelled)
* ``POST /settle``: ``{"reservation": token, "actual": N}`` or ``{"reservation": token,
  "cancel": true}``, answered 200 with the response as ``/json`` shapes it (one status: where
  the descriptor stands after); 400 malformed, 403 a token that does not verify, 409 settled
  already, 410 expired or its rule gone; 503 as ``/json``
* ``GET /healthcheck``: 200 ``OK`` once the store has answered (and a configuration is
  loaded) until the server shuts down, else 500 with the reason, as upstream (see ``_health``)
* ``GET /metrics``: Prometheus exposition (see ``_metrics``)
* ``GET /rlconfig``: the configuration in force, as JSON
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from google.protobuf import json_format

from .._model.errors import StorageError
from .._model.rates import MAX_INT
from ..asgi import answer_lifespan
from ._decide import BadRequest, Decider
from ._health import Health
from ._metrics import ServiceMetrics
from ._tokens import TokenRefused
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
#: The endpoints that take a JSON body by POST.
_POSTS = ("/json", "/reserve", "/settle")


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
    ``health`` says what ``/healthcheck`` answers (without one: always healthy)."""

    def __init__(
        self, decider: Decider, metrics: ServiceMetrics, health: Health | None = None
    ) -> None:
        self.decider = decider
        self.metrics = metrics
        self.health = health

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in _POSTS:
            if method != "POST":
                await _respond(send, 405, b"use POST\n")
                return
            body = await self._body(receive)
            if body is None:
                await _respond(send, 413, b"request body too large\n")
                return
            await self._post(send, path, body)
        elif path in ("/healthcheck", "/metrics", "/rlconfig"):
            if method not in ("GET", "HEAD"):
                await _respond(send, 405, b"use GET\n")
            elif path == "/healthcheck":
                failing = None if self.health is None else self.health.reason
                if failing is None:
                    await _respond(send, 200, b"OK")
                else:
                    await _respond(send, 500, f"{failing}\n".encode())
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

    async def _post(self, send: Send, path: str, body: bytes) -> None:
        """``/json``, ``/reserve`` or ``/settle``: decide, then answer the response in proto3
        JSON with its status code, or an error as plain text."""
        tokens: dict[int, str] | None = None
        started = time.perf_counter()
        try:
            if path == "/settle":
                response = await self.decider.settle(*_settle_request(body))
            elif path == "/reserve":
                response, tokens = await self.decider.reserve(_rate_limit_request(body))
            else:
                response = await self.decider.should_rate_limit(_rate_limit_request(body))
        except BadRequest as exc:
            self.metrics.answered(path, started, exc)
            await _respond(send, 400, f"bad request: {exc}\n".encode())
            return
        except TokenRefused as exc:
            self.metrics.answered(path, started, exc)
            await _respond(send, exc.status, f"{exc}\n".encode())
            return
        except StorageError as exc:
            self.metrics.answered(path, started, exc)
            await _respond(send, 503, f"the store failed: {exc}\n".encode())
            return
        self.metrics.answered(path, started)
        data = json_format.MessageToDict(response)
        for index, token in (tokens or {}).items():
            data["statuses"][index]["reservation"] = token
        text = json.dumps(data, ensure_ascii=False).encode()  # as json_format.MessageToJson
        code = response.overall_code
        status = 429 if code == RateLimitResponse.OVER_LIMIT else 200
        if code == RateLimitResponse.UNKNOWN:
            status = 500
        if path == "/settle":
            status = 200  # settled: the body says whether a next unit fits
        await _respond(send, status, text, _JSON)


def _rate_limit_request(body: bytes) -> RateLimitRequest:
    try:
        return json_format.Parse(body, RateLimitRequest())
    except (json_format.ParseError, UnicodeDecodeError) as exc:
        raise BadRequest(str(exc)) from None


def _settle_request(body: bytes) -> tuple[str, int | None]:
    """``/settle``'s body: the token, and the actual cost (None: cancel)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"not JSON: {exc}") from None
    except RecursionError:  # nested deeper than the parser recurses: no token is
        raise BadRequest("not JSON this service reads: nested too deep") from None
    if not isinstance(data, dict):
        raise BadRequest('expected an object: {"reservation": token, "actual": N}')
    unknown = sorted(set(data) - {"reservation", "actual", "cancel"})
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}")
    token = data.get("reservation")
    if not isinstance(token, str) or not token:
        raise BadRequest('"reservation" must be the token /reserve answered')
    cancel = data.get("cancel", False)
    if not isinstance(cancel, bool):
        raise BadRequest('"cancel" must be true or false')
    actual = data.get("actual")
    if cancel == ("actual" in data):
        raise BadRequest('give "actual" (the units used) or "cancel": true, not both')
    if cancel:
        return token, None
    if isinstance(actual, bool) or not isinstance(actual, int) or not 0 <= actual <= MAX_INT:
        raise BadRequest(f'"actual" must be a whole number from 0 to 2**53, got {actual!r}')
    return token, actual
