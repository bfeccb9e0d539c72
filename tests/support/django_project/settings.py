"""Settings of the test project (see the package docstring)."""

from __future__ import annotations

import os

from ratekeeper import CircuitBreaker, Policy

STORAGE_URL = os.environ.get("RATEKEEPER_DJANGO_STORAGE_URL", "memory://")
KEY_PREFIX = os.environ.get("RATEKEEPER_DJANGO_KEY_PREFIX", "django-tests")
#: Seconds a store call may take: never exceeded on a loaded machine, so counts stay exact.
PATIENT = 10.0

DEBUG = os.environ.get("RATEKEEPER_DJANGO_DEBUG") == "1"
SECRET_KEY = "tests-only-not-secret"
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.support.django_project.urls"
USE_TZ = True
DATABASES: dict[str, dict[str, str]] = {}
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    "ratekeeper.django",
]
MIDDLEWARE = ["ratekeeper.django.RateLimitMiddleware"]

RATEKEEPER = {
    "STORAGE_URL": STORAGE_URL,
    "KEY_PREFIX": KEY_PREFIX,
    "FAILURE_MODE": "raise",  # a guess by a failure mode would make counts meaningless
    "LIMITER_OPTIONS": (
        {}
        if STORAGE_URL.startswith("memory:")
        else {
            "timeout": PATIENT,
            "connect_timeout": PATIENT,
            "breaker": CircuitBreaker(slow_call=PATIENT),
        }
    ),
    "KEY": "header:x-api-key",
    "RULES": [
        {"path": "/api/*", "policy": Policy("dj-api", "12/minute")},
        # The README's login rule: only failed logins (401) count.
        {
            "path": "/login",
            "policy": Policy("dj-login", "3/15 minutes"),
            "deduct_when": lambda status: status == 401,
        },
    ],
    "EXEMPT": ["/health"],
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "DEFAULT_THROTTLE_RATES": {"burst": "50/minute", "drf-burst": "50/minute"},
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}

# DRF's own ScopedRateThrottle keeps its history in the default cache: Redis, when the tests
# give a Redis URL (django.core.cache.backends.redis on the same server), else local memory.
CACHES = {
    "default": (
        {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
        if STORAGE_URL.startswith("memory:")
        else {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": STORAGE_URL,
            "KEY_PREFIX": KEY_PREFIX,
        }
    )
}
