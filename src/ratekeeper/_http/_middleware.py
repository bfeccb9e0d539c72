"""What the ASGI and WSGI integrations share: their options, checked once when one is built.

``RateLimitMiddleware(app, *, limiter, **options)``: ``options`` are :class:`Limiting`'s
(``MiddlewareOptions`` types them; the ASGI middleware's docstring describes them). Each
middleware says which limiter it drives; this base refuses the other kind, builds the
``Limiting`` and warns about ``memory://`` under several workers.

``fastapi_dependency(limiter, policy, **options)`` and ``flask_limit(...)`` limit one endpoint:
:func:`endpoint_limiting` checks their arguments (``EndpointOptions``) and builds theirs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, MutableMapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypedDict, TypeVar

from .._algorithms.policy import Policy
from .._limiters.limiter import AsyncLimiter, Limiter
from .._model.decision import Decision
from .._model.errors import ConfigError
from ._base import (
    CostChoice,
    DeductWhen,
    DeniedResponse,
    KeyChoice,
    MissingIdentity,
    PolicyChoice,
    Preflight,
    ReportedCost,
)
from ._limiting import Limiting
from ._nested import shown_headers
from ._rules import Rule
from ._workers import warn_memory_under_workers

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["EndpointOptions", "Middleware", "MiddlewareOptions", "endpoint_limiting"]

_App = TypeVar("_App")
_L = TypeVar("_L", "Limiter", "AsyncLimiter")


class MiddlewareOptions(TypedDict, total=False):
    """The options of the ASGI and WSGI middlewares, by keyword (:class:`Limiting`'s)."""

    policy: Policy | None
    key: KeyChoice | None
    rules: Iterable[Rule]
    exempt: Iterable[str | re.Pattern[str]]
    shadow: bool
    legacy_headers: bool
    denied: DeniedResponse | None
    missing_identity: MissingIdentity
    preflight: Preflight
    application_policy: PolicyChoice
    application_key: KeyChoice | None
    enabled: bool


class Middleware(Generic[_App, _L]):
    """The middleware's app, limiter and ``Limiting``."""

    #: "ASGI" or "WSGI", for messages.
    kind: ClassVar[str]
    #: The limiter class it drives, and what it says when given another.
    drives: ClassVar[type]
    refusal: ClassVar[str]

    def __init__(self, app: _App, *, limiter: _L, **options: Unpack[MiddlewareOptions]) -> None:
        if not isinstance(limiter, self.drives):
            raise ConfigError(self.refusal)
        self.app = app
        self.limiter: _L = limiter
        asgi = self.kind == "ASGI"
        self.limiting = Limiting(**options, asynchronous=asgi, settles_reported=True)
        if self.limiting.enabled:
            warn_memory_under_workers(limiter, f"the {self.kind} middleware's limiter")

    def shown(
        self,
        state: MutableMapping[str, Any],
        decisions: tuple[Decision, ...],
        headers: list[tuple[str, str]],
    ) -> list[tuple[str, str]]:
        """The headers to add to the app's response for ``decisions`` (rendered as
        ``headers``) and those of a limiter that ran in the app on the same request (a
        ``fastapi_dependency``, a ``flask_limit``): none when that one answered it."""
        shown = shown_headers(
            state, decisions, headers, legacy=self.limiting.legacy_headers, record=False
        )
        return [] if shown is None else shown


class EndpointOptions(TypedDict, total=False):
    """The options of ``fastapi_dependency`` and ``flask_limit``: the endpoint's key function
    and cost, and the middleware's options of the same names."""

    key: KeyChoice | None
    cost: CostChoice
    legacy_headers: bool
    denied: DeniedResponse | None
    missing_identity: MissingIdentity
    preflight: Preflight
    enabled: bool


def endpoint_limiting(
    where: str,
    limiter: object,
    drives: type,
    policy: PolicyChoice,
    options: EndpointOptions,
    *,
    asynchronous: bool,
    deduct_when: DeductWhen | None = None,
    reported_cost: ReportedCost = False,
    settles_reported: bool = False,
) -> Limiting:
    """The ``Limiting`` of one endpoint charged to ``policy``, for ``where`` (the decorator or
    dependency, named in errors), which drives a limiter of the class ``drives``; on
    ``memory://`` under several workers, the warning the middlewares give."""
    for name in options:
        if name not in EndpointOptions.__optional_keys__:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
    if not isinstance(limiter, drives):
        raise ConfigError(
            f"{where} needs {'an AsyncLimiter' if asynchronous else 'a blocking Limiter'}"
        )
    if policy is None:
        raise ConfigError(f"{where} needs a policy, or a callable returning one")
    rest: dict[str, Any] = dict(options)
    rule = Rule(
        "*",
        policy,
        key=rest.pop("key", None),
        cost=rest.pop("cost", 1),
        deduct_when=deduct_when,
        reported_cost=reported_cost,
    )
    limiting = Limiting(
        rules=[rule], **rest, asynchronous=asynchronous, settles_reported=settles_reported
    )
    if limiting.enabled:
        warn_memory_under_workers(limiter, f"{where}'s limiter")  # type: ignore[arg-type]
    return limiting
