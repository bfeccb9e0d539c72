"""``settings.RATEKEEPER``: read, checked and turned into the shared HTTP rules once per settings
object, with the limiters built on first use (one blocking, one asyncio, per process).

Every error names the setting: ``settings.RATEKEEPER['RULES'][1]['policy']: ...``. The cache is
dropped when Django's ``setting_changed`` signal names ``RATEKEEPER`` (``override_settings``).
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.http import HttpRequest
from django.utils.module_loading import import_string

from .._algorithms.policy import Policy
from .._http import KeyFunc, Limiting, Request, Rule, _is_async
from .._limiters.limiter import AsyncLimiter, Limiter
from .._limiters.options import storage_url
from .._model.errors import ConfigError
from ..identity import client_ip, header

__all__ = [
    "Config",
    "SettingsError",
    "current",
    "load",
    "on_django_request",
    "policy_for_rate",
    "request_view",
    "resolve_key",
]

SETTING = "RATEKEEPER"

#: Every key ``settings.RATEKEEPER`` may hold, with its default.
DEFAULTS: dict[str, Any] = {
    "ENABLED": True,
    "STORAGE_URL": None,  # None: $RATEKEEPER_STORAGE_URL, else memory://
    "KEY_PREFIX": "ratekeeper",
    "FAILURE_MODE": "open",
    "LIMITER_OPTIONS": {},
    "TRUSTED_PROXIES": (),
    "KEY": "ip",
    "POLICY": None,
    "RULES": (),
    "EXEMPT": (),
    "APPLICATION_POLICY": None,
    "APPLICATION_KEY": None,
    "SHADOW": False,
    "LEGACY_HEADERS": False,
    "MISSING_IDENTITY": "client_ip",
    "PREFLIGHT": "exempt",
}

#: The key names a ``key`` may be, besides a callable or the dotted path of one.
KEY_NAMES = "'ip', 'user', 'user_or_ip', 'header:<name>', 'get:<name>' or 'post:<name>'"


#: A policy used only to check the options of the rules built from the settings.
_PROBE = Policy("ratekeeper-settings-probe", "1/second")


class SettingsError(ConfigError, ImproperlyConfigured):
    """A bad ``settings.RATEKEEPER`` (or a bad argument to ``ratelimit``): both ratekeeper's
    ConfigError and Django's ImproperlyConfigured. The message starts with where it is."""


def request_view(request: HttpRequest) -> Request:
    """The framework-free view of a Django request that rules and key functions see: the path
    is ``path_info`` (without the script prefix), the peer is ``REMOTE_ADDR`` (the socket peer
    under WSGI and ASGI servers; ``client_ip`` decides how far forwarding headers are
    trusted), and ``raw`` is the HttpRequest."""
    return Request(
        method=request.method or "GET",
        path=request.path_info or "/",
        headers=request.headers,  # case-insensitive; a list-valued field is joined with ","
        peer=request.META.get("REMOTE_ADDR") or None,
        raw=request,
    )


def _user(request: Request) -> str | None:
    user = getattr(request.raw, "user", None)
    if user is None or not user.is_authenticated:
        return None
    return f"user:{user.pk}"


def _param(source: str, name: str) -> KeyFunc:
    def key(request: Request) -> str | None:
        values = getattr(request.raw, source.upper())
        value = values.get(name, "")
        return f"{source}:{name}:{value}" if value else None

    return key


def on_django_request(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` of the Django HttpRequest as a function of the request view (async stays
    async), so that a user's callable sees the request Django gives views."""
    if _is_async(func):

        async def on_view_async(request: Request) -> Any:
            return await func(request.raw)

        return on_view_async

    def on_view(request: Request) -> Any:
        return func(request.raw)

    return on_view


def resolve_key(spec: Any, where: str, trusted_proxies: Iterable[str] = ()) -> KeyFunc:
    """A key function for ``spec``: a name (see ``KEY_NAMES``), a callable of the HttpRequest
    returning the identity or None, or the dotted path of one."""
    if callable(spec):
        return on_django_request(spec)
    if not isinstance(spec, str) or not spec:
        raise SettingsError(f"{where}: a key is {KEY_NAMES}, or a callable; got {spec!r}")
    kind, _, name = spec.partition(":")
    if spec == "ip":
        return client_ip(trusted_proxies)
    if spec == "user":
        return _user
    if spec == "user_or_ip":
        ip = client_ip(trusted_proxies)
        return lambda request: _user(request) or ip(request)
    if kind in ("header", "get", "post") and name:
        return header(name) if kind == "header" else _param(kind, name)
    if "." in spec and ":" not in spec:
        try:
            func = import_string(spec)
        except ImportError as exc:
            raise SettingsError(
                f"{where}: cannot import the key function {spec!r}: {exc}"
            ) from None
        if not callable(func):
            raise SettingsError(f"{where}: {spec!r} is not callable")
        return on_django_request(func)
    raise SettingsError(f"{where}: unknown key {spec!r}; use {KEY_NAMES}, or a callable")


def policy_from(spec: Any, where: str) -> Policy | None:
    """A Policy, None, or the keyword arguments of one (``{"name": ..., "rates": ...}``)."""
    if spec is None or isinstance(spec, Policy):
        return spec
    if isinstance(spec, Mapping):
        try:
            return Policy(**spec)
        except (ConfigError, TypeError) as exc:
            raise SettingsError(f"{where}: {exc}") from None
    raise SettingsError(
        f"{where}: a policy is a ratekeeper.Policy or a dict of its arguments "
        f"({{'name': 'api', 'rates': '100/minute'}}), got {spec!r}"
    )


def _rule(spec: Any, where: str, trusted_proxies: Iterable[str]) -> Rule:
    if isinstance(spec, Rule):
        return spec  # its callables see the request view, as under ratekeeper.asgi
    if not isinstance(spec, Mapping):
        raise SettingsError(f"{where}: a rule is a dict such as {{'path': '/api/*', ...}}")
    fields = dict(spec)
    if "path" not in fields:
        raise SettingsError(f"{where}: a rule needs a 'path'")
    policy = fields.get("policy")
    if callable(policy) and not isinstance(policy, Policy):
        fields["policy"] = on_django_request(policy)
    else:
        fields["policy"] = policy_from(policy, f"{where}['policy']")
    if fields.get("key") is not None:
        fields["key"] = resolve_key(fields["key"], f"{where}['key']", trusted_proxies)
    if callable(fields.get("cost")):
        fields["cost"] = on_django_request(fields["cost"])
    if fields.get("methods") is not None and not isinstance(fields["methods"], str):
        fields["methods"] = frozenset(fields["methods"])
    try:
        return Rule(**fields)
    except (ConfigError, TypeError) as exc:
        raise SettingsError(f"{where}: {exc}") from None


class Config:
    """``settings.RATEKEEPER``, checked: the middleware's rules (:meth:`middleware`, None
    without a POLICY, RULES or APPLICATION_POLICY), the default key, the client address and
    the limiters' options."""

    def __init__(self, raw: Mapping[str, Any]) -> None:  # noqa: PLR0915
        where = f"settings.{SETTING}"
        if not isinstance(raw, Mapping):
            raise SettingsError(f"{where} must be a dict, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(DEFAULTS))
        if unknown:
            raise SettingsError(
                f"{where}: unknown setting {unknown[0]!r}; the settings are {', '.join(DEFAULTS)}"
            )
        values = {**DEFAULTS, **raw}
        enabled = values["ENABLED"]
        if not isinstance(enabled, bool):
            raise SettingsError(f"{where}['ENABLED'] must be True or False, got {enabled!r}")
        self.enabled: bool = enabled
        url = values["STORAGE_URL"]
        if url is not None and not isinstance(url, str):
            raise SettingsError(f"{where}['STORAGE_URL'] must be a str, got {url!r}")
        self.storage_url: str = storage_url(url or None)
        options = values["LIMITER_OPTIONS"]
        if not isinstance(options, Mapping):
            raise SettingsError(f"{where}['LIMITER_OPTIONS'] must be a dict of from_url options")
        self.options: dict[str, Any] = {
            **options,
            "key_prefix": values["KEY_PREFIX"],
            "failure_mode": values["FAILURE_MODE"],
        }
        proxies = values["TRUSTED_PROXIES"]
        if isinstance(proxies, str):
            raise SettingsError(f"{where}['TRUSTED_PROXIES'] must be a list of CIDRs, not a str")
        try:
            self.client_ip: KeyFunc = client_ip(proxies)
        except ConfigError as exc:
            raise SettingsError(f"{where}['TRUSTED_PROXIES']: {exc}") from None
        self.trusted_proxies: tuple[str, ...] = tuple(proxies)
        self.key: KeyFunc = resolve_key(values["KEY"], f"{where}['KEY']", self.trusted_proxies)
        self._common: dict[str, Any] = {
            "key": self.key,
            "legacy_headers": values["LEGACY_HEADERS"],
            "missing_identity": values["MISSING_IDENTITY"],
            "preflight": values["PREFLIGHT"],
            "settles_reported": True,
        }
        policy = policy_from(values["POLICY"], f"{where}['POLICY']")
        rules = values["RULES"]
        if isinstance(rules, (str, Mapping)) or not isinstance(rules, Iterable):
            raise SettingsError(f"{where}['RULES'] must be a list of rules")
        built = [
            _rule(rule, f"{where}['RULES'][{i}]", self.trusted_proxies)
            for i, rule in enumerate(rules)
        ]
        application = values["APPLICATION_POLICY"]
        if not callable(application) or isinstance(application, Policy):
            application = policy_from(application, f"{where}['APPLICATION_POLICY']")
        else:
            application = on_django_request(application)
        application_key = values["APPLICATION_KEY"]
        if application_key is not None:
            application_key = resolve_key(
                application_key, f"{where}['APPLICATION_KEY']", self.trusted_proxies
            )
        # The middleware's rules, for an async chain (async callables allowed) and a sync one
        # (refused there, with the error kept for a sync chain to raise).
        self._middleware: dict[bool, Limiting | SettingsError | None] = {False: None, True: None}
        try:
            # MISSING_IDENTITY and PREFLIGHT are checked here even when only decorators use them.
            Limiting(rules=[Rule("*", _PROBE)], asynchronous=True, **self._common)
            if policy is not None or built or application is not None:
                for asynchronous in (True, False):
                    try:
                        self._middleware[asynchronous] = Limiting(
                            policy=policy,
                            rules=built,
                            exempt=values["EXEMPT"],
                            shadow=values["SHADOW"],
                            application_policy=application,
                            application_key=application_key,
                            asynchronous=asynchronous,
                            **self._common,
                        )
                    except ConfigError as exc:
                        if asynchronous:
                            raise
                        self._middleware[False] = SettingsError(
                            f"{where}: {exc} (under WSGI; ASGI Django can await it)"
                        )
        except ConfigError as exc:
            raise SettingsError(f"{where}: {exc}") from None
        self._lock = threading.Lock()
        self._sync: Limiter | None = None
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncLimiter] = (
            weakref.WeakKeyDictionary()
        )
        # Bad URLs and options are found now; nothing is sent until the first decision.
        self.limiter()

    def middleware(self, asynchronous: bool) -> Limiting | None:
        """The middleware's rules for a sync or an async chain; None when there are none."""
        found = self._middleware[asynchronous]
        if isinstance(found, SettingsError):
            raise found
        return found

    def limiting_for(self, rule: Rule, *, shadow: bool, asynchronous: bool) -> Limiting:
        """The rules of one decorated view, with the settings' key and options."""
        try:
            return Limiting(rules=[rule], shadow=shadow, asynchronous=asynchronous, **self._common)
        except ConfigError as exc:
            raise SettingsError(f"settings.{SETTING}: {exc}") from None

    def limiter(self) -> Limiter:
        """The process's blocking limiter, for WSGI requests and sync views."""
        limiter = self._sync
        if limiter is None:
            with self._lock:
                if self._sync is None:
                    self._sync = self._open(Limiter)
                limiter = self._sync
        return limiter

    def async_limiter(self) -> AsyncLimiter:
        """The asyncio limiter of the running event loop (one for an ASGI server's process),
        for ASGI requests and async views: its connections belong to that loop."""
        loop = asyncio.get_running_loop()
        limiter = self._async.get(loop)
        if limiter is None:
            with self._lock:
                limiter = self._async.get(loop)
                if limiter is None:
                    limiter = self._async[loop] = self._open(AsyncLimiter)
        return limiter

    def _open(self, kind: type[Any]) -> Any:
        try:
            return kind.from_url(self.storage_url, **self.options)
        except (ConfigError, TypeError) as exc:  # TypeError: an unknown option
            raise SettingsError(f"settings.{SETTING}[{self._culprit()!r}]: {exc}") from None

    def _culprit(self) -> str:
        """The setting that makes ``from_url`` fail: each is added in turn until it does."""
        given: dict[str, Any] = {}
        for setting, names in (
            ("STORAGE_URL", ()),
            ("KEY_PREFIX", ("key_prefix",)),
            ("FAILURE_MODE", ("failure_mode",)),
        ):
            given.update((name, self.options[name]) for name in names)
            try:
                Limiter.from_url(self.storage_url, **given).close()
            except (ConfigError, TypeError):
                return setting
        return "LIMITER_OPTIONS"

    def close(self) -> None:
        """Close the blocking limiter (an asyncio one is closed with its event loop)."""
        if self._sync is not None:
            self._sync.close()


def load() -> Config:
    """``settings.RATEKEEPER`` (an empty dict when unset), checked."""
    return Config(getattr(settings, SETTING, {}))


_lock = threading.Lock()
_current: Config | None = None


def current() -> Config:
    """The checked settings of this process, loaded once (again after ``override_settings``)."""
    global _current  # noqa: PLW0603
    conf = _current
    if conf is None:
        with _lock:
            if _current is None:
                _current = load()
            conf = _current
    return conf


def _changed(*, setting: str, **kwargs: Any) -> None:
    global _current
    if setting == SETTING:
        with _lock:
            old, _current = _current, None
        if old is not None:
            old.close()


setting_changed.connect(_changed, dispatch_uid="ratekeeper.django.settings")


#: A DRF throttle scope, as it appears in a policy name (``drf:<scope>``).
_SCOPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,120}", re.ASCII)


@functools.lru_cache(maxsize=256)
def policy_for_rate(scope: str, rate: str | None, algorithm: str = "sliding_log") -> Policy | None:
    """The policy ``drf:<scope>`` at ``rate`` (DRF's ``"50/minute"``, or any rates ratekeeper
    parses, ``"10/second;1000/day"``); None for a rate of None (not throttled, as in DRF)."""
    if rate is None:
        return None
    where = f"REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'][{scope!r}]"
    if not isinstance(scope, str) or _SCOPE.fullmatch(scope) is None:
        raise SettingsError(
            f"{where}: a throttle scope is 1-121 characters of A-Z a-z 0-9 _ . : / - starting "
            "with a letter or digit"
        )
    try:
        return Policy(f"drf:{scope}", rate, algorithm)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise SettingsError(f"{where}: {exc}") from None
