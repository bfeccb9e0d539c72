"""Django REST framework: ``RatekeeperThrottle``, an atomic scoped throttle
(``pip install 'ratekeeper[drf]'``).

    REST_FRAMEWORK = {
        "DEFAULT_THROTTLE_CLASSES": ["ratekeeper.drf.RatekeeperThrottle"],
        "DEFAULT_THROTTLE_RATES": {"uploads": "50/minute"},
    }

    class UploadView(APIView):
        throttle_scope = "uploads"

DRF's own throttles read the request history from the cache, then write it back, so concurrent
requests in several processes all pass the check before any of them writes (DRF #5181):
ratekeeper decides each request with one atomic script on the store of ``settings.RATEKEEPER``,
so the limit holds across processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rest_framework.settings import api_settings
from rest_framework.throttling import BaseThrottle

from ._http import anonymous_identity
from ._model.decision import Decision
from .django._settings import SettingsError, current, policy_for_rate, request_view

if TYPE_CHECKING:
    from rest_framework.request import Request as DRFRequest

__all__ = ["RatekeeperThrottle", "policy_for_rate"]


class RatekeeperThrottle(BaseThrottle):
    """Limits views that set ``throttle_scope`` to ``DEFAULT_THROTTLE_RATES[scope]``, per user
    when the request is authenticated (``user:<pk>``) and per client address otherwise (the
    ``ip:`` identity of ``ratekeeper.identity.client_ip`` with ``settings.RATEKEEPER``'s
    ``TRUSTED_PROXIES``; DRF's ``NUM_PROXIES`` is not used). A view without a scope is not
    throttled; a scope without a rate is ImproperlyConfigured, as in DRF.

    ``wait()`` is the denial's exact ``retry_after`` (DRF sends it, rounded up, as
    ``Retry-After``). The decision is also in ``request.ratekeeper`` (a tuple of Decision).
    Subclasses may set ``scope`` (used when the view has none), ``algorithm`` (default
    ``sliding_log``, exact like DRF's history) and ``cost``.
    """

    scope_attr = "throttle_scope"
    scope: str | None = None
    algorithm = "sliding_log"
    cost = 1

    def __init__(self) -> None:
        self.decision: Decision | None = None

    def get_rate(self, scope: str) -> str | None:
        rates = getattr(self, "THROTTLE_RATES", None)
        if rates is None:
            rates = api_settings.DEFAULT_THROTTLE_RATES
        if scope not in rates:
            raise SettingsError(f"No default throttle rate set for {scope!r} scope")
        rate: str | None = rates[scope]
        return rate

    def get_identity(self, request: DRFRequest, view: Any) -> str:
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            return f"user:{user.pk}"
        django_request = getattr(request, "_request", request)
        address = current().client_ip(request_view(django_request))
        return address if address is not None else anonymous_identity(None)

    def allow_request(self, request: DRFRequest, view: Any) -> bool:
        conf = current()
        if not conf.enabled:
            return True
        scope = getattr(view, self.scope_attr, None) or self.scope
        if not scope:
            return True
        policy = policy_for_rate(scope, self.get_rate(scope), self.algorithm)
        if policy is None:
            return True
        self.decision = conf.limiter().hit(policy, self.get_identity(request, view), self.cost)
        django_request = getattr(request, "_request", request)
        previous: tuple[Decision, ...] = getattr(django_request, "ratekeeper", ())
        django_request.ratekeeper = (*previous, self.decision)
        return self.decision.allowed

    def wait(self) -> float | None:
        """Seconds until the denied request would pass: the decision's ``retry_after``."""
        if self.decision is None or self.decision.allowed:
            return None
        return self.decision.retry_after
