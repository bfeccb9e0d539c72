"""Django: a middleware configured from ``settings.RATEKEEPER``, a ``ratelimit`` decorator for
sync and async views, and system checks (``pip install 'ratekeeper[django]'``).

    # settings.py
    INSTALLED_APPS = [..., "ratekeeper.django"]          # the system checks
    MIDDLEWARE = [..., "ratekeeper.django.RateLimitMiddleware"]
    RATEKEEPER = {
        "STORAGE_URL": "redis://cache.internal:6379/0",
        "TRUSTED_PROXIES": ["10.0.0.0/8"],
        "RULES": [{"path": "/api/*", "policy": Policy("api", "100/minute")}],
    }

    # views.py
    @ratelimit("5/minute", key="post:username", methods={"POST"})
    def login(request): ...

Rules, headers and the 429 body are those of ``ratekeeper.asgi`` (one copy, in
``ratekeeper._http``). Under WSGI the blocking ``Limiter`` decides; under ASGI (and for async
views) the ``AsyncLimiter``, each built once per process from the settings on first use. The
decisions charged for a request are in ``request.ratekeeper``, a tuple of ``Decision``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.core.handlers.wsgi import WSGIRequest
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from .._algorithms.policy import Policy
from .._http import (
    Admission,
    LastChunk,
    Limiting,
    ReportedCost,
    Rule,
    Steps,
    answered,
    drive_async,
    drive_blocking,
    drive_sync,
    last_chunk_async,
    shown_headers,
    warn_memory_under_workers,
)
from .._limiters.limiter import Limiter
from .._model.decision import Decision
from .._model.errors import ConfigError
from . import checks as checks
from ._settings import (
    Config,
    SettingsError,
    current,
    on_django_request,
    request_view,
    resolve_key,
)

__all__ = ["RateLimitMiddleware", "SettingsError", "ratelimit", "request_view"]

Handler = Callable[[HttpRequest], Any]


def _record(request: HttpRequest, decisions: tuple[Decision, ...]) -> None:
    """Add ``decisions`` to ``request.ratekeeper`` (the middleware's, then a decorator's);
    an empty tuple when nothing was charged, as on ASGI and WSGI."""
    previous: tuple[Decision, ...] = getattr(request, "ratekeeper", ())
    request.ratekeeper = (*previous, *decisions)


def _state(request: HttpRequest) -> MutableMapping[str, Any]:
    """Where the limiters of a request record what its headers show: the ASGI scope's state,
    else the WSGI environ (``request.META``), as ``ratekeeper.asgi`` and ``.wsgi`` read them."""
    scope = getattr(request, "scope", None)
    state: MutableMapping[str, Any] = (
        scope.setdefault("state", {}) if isinstance(scope, dict) else request.META
    )
    return state


def _blocked(request: HttpRequest, admission: Admission) -> HttpResponse:
    """The response of a request a limiter answered: the limiters around leave it alone."""
    assert admission.response is not None
    answered(_state(request))
    status, headers, body = admission.response
    return HttpResponse(body, status=status, headers=dict(headers))


def _with_headers(
    limiting: Limiting,
    request: HttpRequest,
    response: HttpResponseBase,
    admission: Admission,
    headers: list[tuple[str, str]],
) -> Any:
    """``response`` with the headers of the admission (``headers``) and those of the limiters
    that ran inside this one (a decorated view behind the middleware), unless one of them
    answered the request."""
    decisions = admission.shown if admission.deferred else admission.decisions
    shown = shown_headers(_state(request), decisions, headers, legacy=limiting.legacy_headers)
    for name, value in shown or ():
        response[name] = value
    return response


def _run_sync(
    limiting: Limiting, limiter: Limiter, request: HttpRequest, handler: Callable[[], Any]
) -> Any:
    """Admit the request, run ``handler`` unless blocked, settle outcome-counted charges."""
    admission = drive_sync(limiting.admit(request_view(request)), limiter)
    if admission is None:
        _record(request, ())
        return handler()
    if admission.blocked:
        return _blocked(request, admission)
    before = admission.decisions
    _record(request, before)
    response = handler()  # Django turns a view's exception into a response before this
    headers = admission.headers
    if admission.deferred:
        headers = drive_sync(limiting.settle(admission, response.status_code), limiter)
        _record(request, admission.decisions[: len(admission.decisions) - len(before)])
        if limiting.reports(admission):
            steps = _finish(limiting, admission, request, response)
            if isinstance(response, StreamingHttpResponse):
                _finish_streamed(response, lambda complete: drive_sync(steps(complete), limiter))
            else:
                drive_sync(steps(True), limiter)
    return _with_headers(limiting, request, response, admission, headers)


def _finish(
    limiting: Limiting, admission: Admission, request: HttpRequest, response: HttpResponseBase
) -> Callable[[bool], Steps]:
    """The steps that settle a ``reported_cost`` charge: the cost the view stored in
    ``request.ratekeeper_cost``, or the rule's function of the response (``complete``: the
    last chunk was reached, else the response was abandoned)."""
    return lambda complete: limiting.finish(
        admission, response, getattr(request, "ratekeeper_cost", None), complete
    )


def _finish_streamed(response: StreamingHttpResponse, finish: Callable[[bool], Any]) -> None:
    """Settle before the streamed body's last chunk is sent, or when it is closed before it
    (``finish`` is sync)."""
    response.streaming_content = LastChunk(response.streaming_content, finish)


async def _run_async(
    limiting: Limiting, conf: Config, request: HttpRequest, handler: Callable[[], Awaitable[Any]]
) -> Any:
    """:func:`_run_sync` for an async view or chain, awaiting async callables.

    Under ASGI the store calls go through the AsyncLimiter of the server's event loop. Under
    WSGI, Django runs an async view on an event loop of its own for that one request (in
    ``async_to_sync``): there the blocking limiter makes the store calls, on its pool, instead
    of opening a connection on a loop that is closed after the request."""
    if isinstance(request, WSGIRequest):
        limiter = conf.limiter()

        def drive(steps: Steps) -> Awaitable[Any]:
            return drive_blocking(steps, limiter)
    else:
        async_limiter = conf.async_limiter()

        def drive(steps: Steps) -> Awaitable[Any]:
            return drive_async(steps, async_limiter)

    admission = await drive(limiting.admit(request_view(request)))
    if admission is None:
        _record(request, ())
        return await handler()
    if admission.blocked:
        return _blocked(request, admission)
    before = admission.decisions
    _record(request, before)
    response = await handler()
    headers = admission.headers
    if admission.deferred:
        headers = await drive(limiting.settle(admission, response.status_code))
        _record(request, admission.decisions[: len(admission.decisions) - len(before)])
        if limiting.reports(admission):
            steps = _finish(limiting, admission, request, response)

            async def finish(complete: bool) -> None:
                await drive(steps(complete))

            if not isinstance(response, StreamingHttpResponse):
                await finish(True)
            elif response.is_async:
                response.streaming_content = last_chunk_async(response.streaming_content, finish)
            elif isinstance(request, WSGIRequest):  # read by the WSGI server, blocking limiter
                _finish_streamed(response, lambda complete: drive_sync(steps(complete), limiter))
            else:  # Django under ASGI reads a sync body in a thread (sync_to_async)
                _finish_streamed(response, async_to_sync(finish))
    return _with_headers(limiting, request, response, admission, headers)


class RateLimitMiddleware:
    """Limits every request by the first matching rule of ``settings.RATEKEEPER`` (``RULES``,
    then ``POLICY`` for every other path; ``APPLICATION_POLICY`` on top), for WSGI and ASGI
    Django alike: Django gives it the sync or the async chain, and it answers in kind.
    Denied: 429 with problem+json and the RateLimit headers, before the view; admitted: the
    RateLimit headers on the view's response, the decisions in ``request.ratekeeper``.

    With ``ENABLED = False`` every request passes untouched and the store is never called.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Handler) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)
        conf = current()
        if conf.middleware(self.is_async) is None:
            raise SettingsError(
                "settings.RATEKEEPER: RateLimitMiddleware needs a 'POLICY', 'RULES' or "
                "'APPLICATION_POLICY' (the ratelimit decorator needs none)"
            )
        if conf.enabled:  # the blocking limiter has the same store as the asyncio one
            warn_memory_under_workers(conf.limiter(), "ratekeeper.django.RateLimitMiddleware")

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        conf = current()
        limiting = conf.middleware(False)
        if not conf.enabled or limiting is None:
            return self.get_response(request)
        return _run_sync(limiting, conf.limiter(), request, lambda: self.get_response(request))

    async def _acall(self, request: HttpRequest) -> Any:
        conf = current()
        limiting = conf.middleware(True)
        if not conf.enabled or limiting is None:
            return await self.get_response(request)
        return await _run_async(limiting, conf, request, lambda: self.get_response(request))


_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_.:/-]+")


def _view_policy(policy: Any, view: Callable[..., Any]) -> Any:
    """``policy``; a callable of the HttpRequest as one of the request view; or rates named
    after the view (``myapp.views.login``) as django-ratelimit names its groups."""
    if isinstance(policy, Policy):
        return policy
    if callable(policy):
        return on_django_request(policy)
    if not isinstance(policy, str):
        raise SettingsError(f"ratelimit: policy must be a Policy or rates, got {policy!r}")
    # A name starts with a letter or digit: a view of a script (``__main__``) is ``main.<view>``,
    # one of a ``_private`` module named without the leading underscore.
    module = "main" if view.__module__ == "__main__" else view.__module__
    name = _NOT_IN_NAME.sub("-", f"{module}.{view.__qualname__}").strip("-._")[:128]
    try:
        return Policy(name, policy)
    except ConfigError as exc:
        raise SettingsError(f"ratelimit on {view.__qualname__}: {exc}") from None


def _django_request(args: tuple[Any, ...]) -> HttpRequest:
    """The request among a view's arguments: the first (a function view) or the second (a
    method of a class-based view); a DRF Request gives its Django request."""
    for arg in args[:2]:
        request = getattr(arg, "_request", arg)
        if isinstance(request, HttpRequest):
            return request
    raise ImproperlyConfigured("ratelimit: the decorated view was not given a request")


#: django-ratelimit's arguments, and what to write instead: refused with this, not Python's
#: bare "unexpected keyword argument".
_DJANGO_RATELIMIT = {
    "rate": "give the rates as the first argument, ratelimit('5/m', key=...), or a Policy",
    "method": "write methods={'POST'} (a set of method names; leave it out for every method)",
    "block": "a denial is always a 429 before the view; block=False is shadow=True here "
    "(decide and send headers, never block)",
    "group": "give the views that share a budget the same Policy('name', rates)",
}


def _refuse_django_ratelimit(given: Mapping[str, object], has_policy: bool) -> None:
    """A clear TypeError for django-ratelimit's arguments (or any unknown one), raised when
    the view's module is imported."""
    for name in given:
        fix = _DJANGO_RATELIMIT.get(name)
        if fix is None:
            raise TypeError(f"ratelimit() got an unexpected keyword argument {name!r}")
        raise TypeError(
            f"ratelimit() has no {name}= (django-ratelimit's argument): {fix}; "
            "see docs/migration.md"
        )
    if not has_policy:
        raise TypeError(
            "ratelimit() needs the rates or a Policy as its first argument: "
            "ratelimit('5/m', key='ip')"
        )


def ratelimit(
    policy: Policy | str | Callable[[HttpRequest], Any] | None = None,
    *,
    key: Any = None,
    cost: int | Callable[[HttpRequest], Any] = 1,
    methods: Iterable[str] | None = None,
    shadow: bool = False,
    deduct_when: Callable[[int], bool] | None = None,
    reported_cost: ReportedCost = False,
    **django_ratelimit: object,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Limits one view, sync or async (``async def`` views run on the ``AsyncLimiter``).

        @ratelimit(Policy("search", "10/minute"), key="user_or_ip")
        def search(request): ...

        @ratelimit("5/minute", key="post:username", methods={"POST"})
        async def login(request): ...

    ``policy``: a Policy; rates (``"5/minute"``) for a policy named after the view; or a
    callable of the HttpRequest returning a Policy or None (not limited), chosen per request
    (free and pro plans). ``cost``: an int, or a callable of the HttpRequest returning one.
    On an ``async def`` view the callables may be ``async def`` too.
    ``key``: ``"ip"`` (the client address, through ``TRUSTED_PROXIES``), ``"user"``,
    ``"user_or_ip"``, ``"header:<name>"`` (hashed), ``"get:<name>"``, ``"post:<name>"``, a
    callable of the HttpRequest returning the identity (or None), or its dotted path; default:
    the settings' ``KEY``. A request with no identity is handled by ``MISSING_IDENTITY``.
    ``methods``: the methods charged (a rule naming GET also charges HEAD); others pass
    uncharged. ``shadow``: decide and send headers, never block. ``deduct_when``: a function
    of the response's status; the cost is reserved before the view runs and kept only when it
    returns true (``lambda status: status == 401`` counts failed logins), as a rule's does.
    ``reported_cost``: ``cost`` is an estimate, reserved before the view runs and settled to
    the real cost once the response is complete (a ``StreamingHttpResponse``: before its last
    chunk is sent). True reads ``request.ratekeeper_cost`` (set it in the view, or in the
    streamed body's generator); a function of the response returns the cost (None keeps the
    estimate): ``reported_cost=lambda response: int(response["X-Tokens-Used"])``.
    Denied: 429 with problem+json and the RateLimit headers, before the view runs.
    ``ENABLED = False`` turns it off. django-ratelimit's ``rate``, ``method``, ``block`` and
    ``group`` are a TypeError that says what to write instead.
    """
    _refuse_django_ratelimit(django_ratelimit, policy is not None)

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        chosen = _view_policy(policy, view)
        where = f"ratelimit on {view.__qualname__}"
        asynchronous = iscoroutinefunction(view)
        given: Any = methods if methods is None or isinstance(methods, str) else set(methods)

        def rule(rule_key: Any) -> Rule:
            charged = on_django_request(cost) if callable(cost) else cost
            return Rule(
                "*",
                chosen,
                methods=given,
                key=rule_key,
                cost=charged,
                deduct_when=deduct_when,
                reported_cost=reported_cost,
            )

        try:
            # Bad arguments fail at import, not at the first request.
            probe_key = None if key is None else resolve_key(key, "key")  # {where}: below
            Limiting(rules=[rule(probe_key)], asynchronous=asynchronous, settles_reported=True)
        except ConfigError as exc:
            raise SettingsError(f"{where}: {exc}") from None
        built: list[tuple[Config, Limiting]] = []

        def limiting(conf: Config) -> Limiting:
            # Built per settings object: the key and options come from settings.RATEKEEPER.
            if built and built[0][0] is conf:
                return built[0][1]
            rule_key = None if key is None else resolve_key(key, where, conf.trusted_proxies)
            made = conf.limiting_for(rule(rule_key), shadow=shadow, asynchronous=asynchronous)
            built[:] = [(conf, made)]
            return made

        if asynchronous:

            @functools.wraps(view)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                conf = current()
                if not conf.enabled:
                    return await view(*args, **kwargs)
                return await _run_async(
                    limiting(conf), conf, _django_request(args), lambda: view(*args, **kwargs)
                )

            return async_wrapper

        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            conf = current()
            if not conf.enabled:
                return view(*args, **kwargs)
            return _run_sync(
                limiting(conf), conf.limiter(), _django_request(args), lambda: view(*args, **kwargs)
            )

        return wrapper

    return decorate
