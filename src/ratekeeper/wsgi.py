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
    Request,
    Rule,
    default_denied,
    make_rules,
    match_rule,
    merge_headers,
    response_headers,
    with_length,
)
from ._limiter import Limiter
from ._policy import Policy
from .identity import client_ip

__all__ = ["RateLimitMiddleware", "Rule", "flask_limit", "request_from_environ"]

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

_REASONS = {429: "Too Many Requests", 403: "Forbidden", 503: "Service Unavailable"}


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
    ) -> None:
        if not isinstance(limiter, Limiter):
            raise ConfigError("the WSGI middleware needs a blocking Limiter")
        self.app = app
        self.limiter = limiter
        self.rules = make_rules(policy, rules, exempt)
        self.key = key if key is not None else client_ip()
        self.shadow = shadow
        self.legacy_headers = legacy_headers
        self.denied = denied if denied is not None else default_denied

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        request = request_from_environ(environ)
        rule = match_rule(self.rules, request.method, request.path)
        if rule is None or rule.policy is None:
            return self.app(environ, start_response)
        identity = (rule.key or self.key)(request)
        if identity is None:
            return self.app(environ, start_response)
        decision = self.limiter.hit(rule.policy, identity, rule.cost)
        headers = response_headers(decision, legacy=self.legacy_headers)
        if not decision.allowed and not (self.shadow or rule.shadow):
            status, extra, body = self.denied(decision, request)
            out = with_length(merge_headers(extra, headers), body)
            start_response(f"{status} {_REASONS.get(status, 'Error')}", out)
            return [body]
        # Passed on (allowed, or shadow mode): no Retry-After, the client need not wait.
        headers = [h for h in headers if h[0] != "Retry-After"]
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
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A Flask view decorator that limits one endpoint (``pip install flask``).

        @app.get("/search")
        @flask_limit(limiter, Policy("search", "10/minute"))
        def search(): ...

    Adds the RateLimit headers to the view's response, or answers 429 with problem+json.
    """
    import functools

    import flask

    if not isinstance(limiter, Limiter):
        raise ConfigError("flask_limit needs a blocking Limiter")
    rule = Rule("*", policy, key=key, cost=cost)
    key_func = key if key is not None else client_ip()

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            request = request_from_environ(flask.request.environ)
            identity = key_func(request)
            if identity is None:
                return view(*args, **kwargs)
            decision = limiter.hit(policy, identity, rule.cost)
            headers = response_headers(decision, legacy=legacy_headers)
            if not decision.allowed:
                status, extra, body = default_denied(decision, request)
                return flask.Response(body, status=status, headers=merge_headers(extra, headers))
            response = flask.make_response(view(*args, **kwargs))
            for name, value in headers:
                response.headers[name] = value
            return response

        return wrapper

    return decorate
