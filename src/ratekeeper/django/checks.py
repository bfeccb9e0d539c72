"""System checks (``manage.py check``) for ``settings.RATEKEEPER`` and the DRF throttle rates.

* ``ratekeeper.E001``: ``settings.RATEKEEPER`` is invalid (a bad URL, rate, policy, rule, key
  or option); the message names the setting.
* ``ratekeeper.E002``: a rate in ``REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']`` that
  ``RatekeeperThrottle`` cannot parse, when that throttle is a default throttle class.
* ``ratekeeper.W001``: ``memory://`` backs the limits while ``DEBUG`` is off: each worker
  process keeps its own counts, so N workers admit N times the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register

from ._settings import SettingsError, load, policy_for_rate

__all__ = ["check_settings", "check_throttle_rates"]

TAG = "ratekeeper"


@register(TAG)
def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    try:
        conf = load()
    except SettingsError as exc:
        return [
            Error(
                str(exc),
                hint="See the README's 'Django and Django REST framework' section.",
                id="ratekeeper.E001",
            )
        ]
    conf.close()
    if conf.enabled and conf.storage_url.startswith("memory:") and not settings.DEBUG:
        return [
            Warning(
                "settings.RATEKEEPER['STORAGE_URL'] is memory:// (or unset) while DEBUG is off: "
                "every worker process keeps its own counts, so N workers admit N times each "
                "limit.",
                hint="Set STORAGE_URL to the redis:// or valkey:// URL that all workers share.",
                id="ratekeeper.W001",
            )
        ]
    return []


@register(TAG)
def check_throttle_rates(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    config = getattr(settings, "REST_FRAMEWORK", None) or {}
    classes = config.get("DEFAULT_THROTTLE_CLASSES", ())
    if not any(str(c).startswith("ratekeeper.drf.") for c in classes):
        return []
    errors: list[CheckMessage] = []
    for scope, rate in (config.get("DEFAULT_THROTTLE_RATES") or {}).items():
        try:
            policy_for_rate(scope, rate)
        except SettingsError as exc:
            errors.append(Error(str(exc), id="ratekeeper.E002"))
    return errors
