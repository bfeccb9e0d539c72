"""WSGI rate limiting middleware for Flask, Django and any WSGI app, on the blocking Limiter.

    from ratekeeper import Limiter, Policy
    from ratekeeper.wsgi import RateLimitMiddleware

    app.wsgi_app = RateLimitMiddleware(
        app.wsgi_app, limiter=Limiter.from_url("redis://localhost:6379/0"),
        policy=Policy("api", "100/minute"),
    )

The arguments are those of :class:`ratekeeper.asgi.RateLimitMiddleware`; here a rule's policy,
key and cost callables are plain functions (an ``async def`` one is refused). The decisions
charged for a request are in ``environ["ratekeeper"]``, a tuple of Decision.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ._http import (
    COST_KEY,
    STATE_KEY,
    Admission,
    DeductWhen,
    LastChunk,
    Limiting,
    PolicyChoice,
    ReportedCost,
    ResponseView,
    Rule,
    add_charged,
    answered,
    drive_sync,
    merge_headers,
    shown_headers,
)
from ._http._middleware import EndpointOptions, Middleware, endpoint_limiting
from ._http._request import LazyHeaders, Request
from ._limiters.limiter import Limiter

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["RateLimitMiddleware", "ResponseView", "Rule", "flask_limit", "request_from_environ"]

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

_REASONS = {
    400: "Bad Request",
    429: "Too Many Requests",
    403: "Forbidden",
    503: "Service Unavailable",
}


def _environ_headers(environ: dict[str, Any]) -> dict[str, str]:
    return {
        name[5:].replace("_", "-").lower(): value
        for name, value in environ.items()
        if name.startswith("HTTP_") and isinstance(value, str)
    }


def request_from_environ(environ: dict[str, Any]) -> Request:
    """The framework-free view of a WSGI environ (its headers are decoded when first read)."""
    return Request(
        method=environ.get("REQUEST_METHOD", "GET").upper(),  # as Werkzeug and Django route it
        path=environ.get("PATH_INFO", "/") or "/",
        headers=LazyHeaders(environ, _environ_headers),
        peer=environ.get("REMOTE_ADDR") or None,
        raw=environ,
    )


class RateLimitMiddleware(Middleware[WSGIApp, Limiter]):
    """Limits every request by the first matching rule and the application policy; see the
    ASGI middleware for the arguments."""

    kind = "WSGI"
    drives = Limiter
    refusal = "the WSGI middleware needs a blocking Limiter"

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if not self.limiting.enabled:
            return self.app(environ, start_response)
        admission: Admission | None = drive_sync(
            self.limiting.admit(request_from_environ(environ)), self.limiter
        )
        if admission is None:
            environ[STATE_KEY] = ()
            return self.app(environ, start_response)
        if admission.response is not None:
            status, out, body = admission.response
            start_response(f"{status} {_REASONS.get(status, 'Error')}", out)
            return [body]
        environ[STATE_KEY] = admission.decisions
        if admission.deferred:
            return self._deferred(admission, environ, start_response)
        headers = admission.headers
        if not headers:
            return self.app(environ, start_response)

        def start(status: str, app_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            merged = merge_headers(app_headers, self.shown(environ, admission.decisions, headers))
            if exc_info is not None:
                return start_response(status, merged, exc_info)
            return start_response(status, merged)

        return self.app(environ, start)

    def _deferred(
        self, admission: Admission, environ: dict[str, Any], start_response: StartResponse
    ) -> Iterable[bytes]:
        """Call the app, charging the ``deduct_when`` policies when it starts its response
        (an exception before that: as a 500), and settling ``reported_cost`` ones before the
        body's last chunk is handed to the server."""
        settled = False
        response = ResponseView(500, {}, environ)

        def settle(status: int) -> list[tuple[str, str]]:
            nonlocal settled
            settled = True
            headers: list[tuple[str, str]] = drive_sync(
                self.limiting.settle(admission, status), self.limiter
            )
            return headers

        def start(status: str, app_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            nonlocal response
            if not settled:
                code = status.split(" ", 1)[0]
                number = int(code) if code.isdigit() else 500
                response = ResponseView(
                    number, {name.lower(): value for name, value in app_headers}, environ
                )
                headers = settle(number)
                app_headers = merge_headers(
                    app_headers, self.shown(environ, admission.shown, headers)
                )
            if exc_info is not None:
                return start_response(status, app_headers, exc_info)
            return start_response(status, app_headers)

        try:
            body = self.app(environ, start)
        except Exception:
            if not settled:
                settle(500)
            raise
        if not self.limiting.reports(admission):
            return body

        def finish(complete: bool) -> None:
            steps = self.limiting.finish(admission, response, environ.get(COST_KEY), complete)
            drive_sync(steps, self.limiter)

        return LastChunk(body, finish)


def _settle_reported(
    limiting: Limiting, limiter: Limiter, admission: Admission, response: Any
) -> None:
    """Settle a ``reported_cost`` charge of a Flask response: now when its whole body is
    there, else (streamed) before its last chunk is sent."""
    import flask

    environ = flask.request.environ

    def finish(complete: bool) -> None:
        steps = limiting.finish(admission, response, environ.get(COST_KEY), complete)
        drive_sync(steps, limiter)

    if response.is_sequence:
        finish(True)
    else:
        response.response = LastChunk(response.response, finish)


def flask_limit(
    limiter: Limiter,
    policy: PolicyChoice,
    *,
    deduct_when: DeductWhen | None = None,
    reported_cost: ReportedCost = False,
    **options: Unpack[EndpointOptions],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A Flask view decorator that limits one endpoint (``pip install flask``; async views
    need ``flask[async]``).

        @app.get("/search")
        @flask_limit(limiter, Policy("search", "10/minute"))
        def search(): ...

    Works on sync and ``async def`` views alike. Charges every request the view serves (Flask
    serves HEAD with a GET view). Adds the RateLimit headers to the view's response, or answers
    as the middleware does: 429 with problem+json. ``policy``, ``key`` and ``cost`` may be
    plain functions of the request view; the other options (``legacy_headers``, ``denied``,
    ``missing_identity``, ``preflight``, ``enabled``) are those of the middleware
    (``missing_identity="reject"`` answers 400 with problem+json). ``deduct_when``: a function
    of the response's status; the cost is reserved before the view runs and kept only when it
    returns true (an exception in the view counts as 500), as a rule's does.
    ``reported_cost``: ``cost`` is an estimate, reserved before the view runs and settled to
    the real cost before the response's last chunk is sent, streamed or not: True reads
    ``flask.request.environ["ratekeeper_cost"]`` (set it in the view, or in a streamed body's
    generator); a function of the ``flask.Response`` returns the cost (None keeps the
    estimate). The decisions charged are in ``flask.request.environ["ratekeeper"]``.
    """
    import functools

    import flask

    limiting = endpoint_limiting(
        "flask_limit",
        limiter,
        Limiter,
        policy,
        options,
        asynchronous=False,
        deduct_when=deduct_when,
        reported_cost=reported_cost,
        settles_reported=True,
    )

    def admit() -> Admission | None:
        environ = flask.request.environ
        admission: Admission | None = drive_sync(
            limiting.admit(request_from_environ(environ)), limiter
        )
        if admission is not None and admission.response is None:
            add_charged(environ, admission.decisions)
        return admission

    def respond(admission: Admission | None, result: Any) -> Any:
        response = flask.make_response(result)
        if admission is not None:
            decisions, ours = admission.decisions, admission.headers
            if admission.deferred:
                ours = drive_sync(limiting.settle(admission, response.status_code), limiter)
                decisions = admission.shown
            headers = shown_headers(
                flask.request.environ, decisions, ours, legacy=limiting.legacy_headers
            )
            for name, value in headers or ():
                response.headers[name] = value
            if admission.deferred and limiting.reports(admission):
                _settle_reported(limiting, limiter, admission, response)
        return response

    def failed(admission: Admission | None) -> None:
        """The view raised: its outcome counts as a 500."""
        if admission is not None and admission.deferred:
            drive_sync(limiting.settle(admission, 500), limiter)

    def refused(admission: Admission) -> Any:
        assert admission.response is not None
        answered(flask.request.environ)
        status, headers, body = admission.response
        return flask.Response(body, status=status, headers=headers)

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(view):

            @functools.wraps(view)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                admission = admit()
                if admission is not None and admission.response is not None:
                    return refused(admission)
                try:
                    result = await view(*args, **kwargs)
                except Exception:
                    failed(admission)
                    raise
                return respond(admission, result)

            return async_wrapper

        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            admission = admit()
            if admission is not None and admission.response is not None:
                return refused(admission)
            try:
                result = view(*args, **kwargs)
            except Exception:
                failed(admission)
                raise
            return respond(admission, result)

        return wrapper

    return decorate
