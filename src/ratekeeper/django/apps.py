"""The app that registers ratekeeper's system checks (``INSTALLED_APPS``: "ratekeeper.django")."""

from __future__ import annotations

from django.apps import AppConfig


class RatekeeperConfig(AppConfig):
    name = "ratekeeper.django"
    label = "ratekeeper"
    verbose_name = "ratekeeper"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers them)
