"""Metrics hooks, and adapters for Prometheus and OpenTelemetry.

Pass ``metrics=`` to a limiter: an object with the methods of :class:`Metrics` (subclass it
and override what you need). The limiter calls them after each decision, each store call and
each breaker transition; nothing inside the algorithms is timed.

:class:`PrometheusMetrics` (``pip install 'ratekeeper[prometheus]'``) and :class:`OTelMetrics`
(``pip install 'ratekeeper[otel]'``) export the same instruments, listed once in
:data:`INSTRUMENTS`, and count them by one rule (:class:`_Exporter`). Neither library is imported
until its adapter is built.
"""

from ._engine.metrics import INSTRUMENTS, Instrument, Metrics, OTelMetrics, PrometheusMetrics

__all__ = ["INSTRUMENTS", "Instrument", "Metrics", "OTelMetrics", "PrometheusMetrics"]
