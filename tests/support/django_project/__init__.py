"""A small Django project for the Django and DRF tests.

``settings`` reads the store from ``RATEKEEPER_DJANGO_STORAGE_URL`` and a key prefix from
``RATEKEEPER_DJANGO_KEY_PREFIX``; ``RATEKEEPER_DJANGO_DEBUG=1`` turns DEBUG on. The servers in
``tests/http/test_django_servers.py`` run ``wsgi:application`` under gunicorn and
``asgi:application`` under uvicorn; in-process tests call :func:`configure` (the same
settings, without ``DJANGO_SETTINGS_MODULE``) and change ``RATEKEEPER`` with ``override_settings``.
"""

from __future__ import annotations

import importlib


def configure() -> None:
    """Configure Django in this process with the project's settings, once."""
    import django
    from django.conf import settings

    if not settings.configured:
        project = importlib.import_module("tests.support.django_project.settings")
        settings.configure(
            **{name: getattr(project, name) for name in dir(project) if name.isupper()}
        )
        django.setup()
