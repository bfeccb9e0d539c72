"""WSGI rate limiting middleware for Flask, Django and any WSGI app, on the blocking Limiter.

    from ratekeeper import Limiter, Policy
    from ratekeeper.wsgi import RateLimitMiddleware

    app.wsgi_app = RateLimitMiddleware(
        app.wsgi_app, limiter=Limiter.from_url("redis://localhost:6379/0"),
        policy=Policy("api", "100/minute"),
    )

The arguments are those of :class:`ratekeeper.asgi.RateLimitMiddleware`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from ._errors import ConfigError
from ._http import (
    DeniedResponse,
    KeyFunc,
    Limiting,
    MissingIdentity,
    Outcome,
    Preflight,
    Request,
    Rule,
    merge_headers,
)
from ._limiter import Limiter
from ._policy import Policy

__all__ = ["RateLimitMiddleware", "Rule", "flask_limit", "request_from_environ"]

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

_REASONS = {
    400: "Bad Request",
    429: "Too Many Requests",
    403: "Forbidden",
    503: "Service Unavailable",
}


def request_from_environ(environ: dict[str, Any]) -> Request:
    """The framework-free view of a WSGI environ."""
    headers = {
        name[5:].replace("_", "-").lower(): value
        for name, value in environ.items()
        if name.startswith("HTTP_") and isinstance(value, str)
    }
    return Request(
        method=environ.get("REQUEST_METHOD", "GET"),
        path=environ.get("PATH_INFO", "/") or "/",
        headers=headers,
        peer=environ.get("REMOTE_ADDR") or None,
        raw=environ,
    )


class RateLimitMiddleware:
    """Limits every request by the first matching rule; see the ASGI middleware for arguments."""

    def __init__(
        self,
        app: WSGIApp,
        *,
        limiter: Limiter,
        policy: Policy | None = None,
        key: KeyFunc | None = None,
        rules: Iterable[Rule] = (),
        exempt: Iterable[str | re.Pattern[str]] = (),
        shadow: bool = False,
        legacy_headers: bool = False,
        denied: DeniedResponse | None = None,
        missing_identity: MissingIdentity = "client_ip",
        preflight: Preflight = "exempt",
    ) -> None:
        if not isinstance(limiter, Limiter):
            raise ConfigError("the WSGI middleware needs a blocking Limiter")
        self.app = app
        self.limiter = limiter
        self.limiting = Limiting(
            policy=policy,
            key=key,
            rules=rules,
            exempt=exempt,
            shadow=shadow,
            legacy_headers=legacy_headers,
            denied=denied,
            missing_identity=missing_identity,
            preflight=preflight,
        )

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        request = request_from_environ(environ)
        route = self.limiting.route(request)
        if route is None:
            return self.app(environ, start_response)
        if isinstance(route, Outcome):
            outcome = route
        else:
            decision = self.limiter.hit(route.policy, route.identity, route.rule.cost)
            outcome = self.limiting.outcome(route.rule, decision, request)
        if outcome.response is not None:
            status, out, body = outcome.response
            start_response(f"{status} {_REASONS.get(status, 'Error')}", out)
            return [body]
        headers = outcome.headers
        if not headers:
            return self.app(environ, start_response)

        def start(status: str, app_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            merged = merge_headers(app_headers, headers)
            if exc_info is not None:
                return start_response(status, merged, exc_info)
            return start_response(status, merged)

        return self.app(environ, start)


def flask_limit(
    limiter: Limiter,
    policy: Policy,
    *,
    key: KeyFunc | None = None,
    cost: int = 1,
    legacy_headers: bool = False,
    missing_identity: MissingIdentity = "client_ip",
    preflight: Preflight = "exempt",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A Flask view decorator that limits one endpoint (``pip install flask``).

        @app.get("/search")
        @flask_limit(limiter, Policy("search", "10/minute"))
        def search(): ...

    Charges every request the view serves (Flask serves HEAD with a GET view). Adds the
    RateLimit headers to the view's response, or answers 429 with problem+json.
    ``missing_identity`` and ``preflight`` are those of the middleware (``"reject"`` answers
    400 with problem+json).
    """
    import functools

    import flask

    if not isinstance(limiter, Limiter):
        raise ConfigError("flask_limit needs a blocking Limiter")
    limiting = Limiting(
        rules=[Rule("*", policy, key=key, cost=cost)],
        legacy_headers=legacy_headers,
        missing_identity=missing_identity,
        preflight=preflight,
    )

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            request = request_from_environ(flask.request.environ)
            route = limiting.route(request)
            if route is None:
                return view(*args, **kwargs)
            if isinstance(route, Outcome):
                outcome = route
            else:
                decision = limiter.hit(policy, route.identity, route.rule.cost)
                outcome = limiting.outcome(route.rule, decision, request)
            if outcome.response is not None:
                status, headers, body = outcome.response
                return flask.Response(body, status=status, headers=headers)
            response = flask.make_response(view(*args, **kwargs))
            for name, value in outcome.headers:
                response.headers[name] = value
            return response

        return wrapper

    return decorate
