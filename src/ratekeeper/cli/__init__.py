"""The ``ratekeeper`` command line: the ``main`` group (``_main``) and one module per command:
``_demo`` (``demo``), ``_bench`` (``bench``), ``_admin`` (``peek``, ``hit``, ``reset``,
``keys``), ``_top`` (``top``) and ``_serve`` (``serve``), on the options they share
(``_options``)."""

from __future__ import annotations

from . import _admin, _bench, _demo, _serve, _top  # noqa: F401  (each registers its commands)
from ._main import main

__all__ = ["main"]
