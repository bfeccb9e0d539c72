"""The ``ratekeeper`` command line: the ``main`` group (``_main``) and one module per command:
``_demo`` (``demo``), ``_bench`` (``bench``), ``_admin`` (``peek``, ``hit``, ``reset``,
``keys``), ``_top`` (``top``) and ``_serve`` (``serve``, with ``_serve_options``), on the
options they share (``_options``). What a command does, apart from its options and output, is
in a tool module: ``_admin_ops`` (open a limiter, decide or reset identities), ``_bench_ops``
(the benchmark, with ``_histogram``), ``_demo_ops`` (the simulated clients) and ``_demo_app``
(the sample API of ``demo --serve``)."""

from __future__ import annotations

from . import _admin, _bench, _demo, _serve, _top  # noqa: F401  (each registers its commands)
from ._main import main

__all__ = ["main"]
