from __future__ import annotations

from django.urls import path

from . import views

urlpatterns = [
    path("health", views.health),
    path("api/items", views.items),
    path("login", views.login),
    path("views/sync", views.sync_view),
    path("views/async", views.async_view),
    path("tokens/sync", views.tokens),
    path("tokens/async", views.async_tokens),
    path("drf/burst", views.Burst.as_view()),
    path("drf/drf-burst", views.DRFBurst.as_view()),
]
