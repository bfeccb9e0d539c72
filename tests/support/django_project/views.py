"""The test project's views: one behind the middleware's rule, two behind the decorator, two
DRF views (ratekeeper's throttle and DRF's own)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from typing import ClassVar

from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import ScopedRateThrottle
from rest_framework.views import APIView

from ratekeeper import Policy
from ratekeeper.django import ratelimit
from ratekeeper.drf import RatekeeperThrottle

SYNC_VIEW = Policy("dj-sync", "7/minute")
ASYNC_VIEW = Policy("dj-async", "9/minute")
#: A token budget: each answer is estimated at 200 tokens and reports 700 at its end.
TOKENS = Policy("dj-tokens", "1000/minute")


def _pid(response: JsonResponse) -> JsonResponse:
    response["X-Worker-Pid"] = str(os.getpid())
    return response


def health(request: HttpRequest) -> JsonResponse:
    return _pid(JsonResponse({"status": "ok"}))


def items(request: HttpRequest) -> JsonResponse:
    return _pid(JsonResponse({"items": [1, 2, 3]}))


def login(request: HttpRequest) -> JsonResponse:
    """Every password is wrong: a 401, which the settings' login rule counts."""
    return _pid(JsonResponse({"ok": False}, status=401))


@ratelimit(SYNC_VIEW, key="header:x-api-key")
def sync_view(request: HttpRequest) -> JsonResponse:
    return _pid(
        JsonResponse({"view": "sync", "decisions": len(getattr(request, "ratekeeper", ()))})
    )


@ratelimit(ASYNC_VIEW, key="header:x-api-key")
async def async_view(request: HttpRequest) -> JsonResponse:
    return _pid(
        JsonResponse({"view": "async", "decisions": len(getattr(request, "ratekeeper", ()))})
    )


@ratelimit(TOKENS, key="header:x-api-key", cost=200, reported_cost=True)
def tokens(request: HttpRequest) -> StreamingHttpResponse:
    """Streams an answer; the usage is known at its end (as from an LLM's last event)."""

    def answer() -> Iterator[bytes]:
        yield from (b"to", b"be", b"or", b"not")
        request.ratekeeper_cost = 700  # type: ignore[attr-defined]

    return StreamingHttpResponse(answer())


@ratelimit(TOKENS, key="header:x-api-key", cost=200, reported_cost=True)
async def async_tokens(request: HttpRequest) -> StreamingHttpResponse:
    async def answer() -> AsyncIterator[bytes]:
        for word in (b"to", b"be", b"or", b"not"):
            yield word
        request.ratekeeper_cost = 700  # type: ignore[attr-defined]

    return StreamingHttpResponse(answer())


class Burst(APIView):
    """50 per minute by ratekeeper's throttle."""

    throttle_classes: ClassVar[list[type]] = [RatekeeperThrottle]
    throttle_scope = "burst"

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class DRFBurst(APIView):
    """50 per minute by DRF's own ScopedRateThrottle, on the default (Redis) cache."""

    throttle_classes: ClassVar[list[type]] = [ScopedRateThrottle]
    throttle_scope = "drf-burst"

    def get(self, request: Request) -> Response:
        return Response({"ok": True})
