"""``ratekeeper serve``: the Envoy rate limit service (gRPC v3) and an HTTP JSON API over
``AsyncLimiter``, configured by envoyproxy/ratelimit's YAML (``_config``).

Install with ``pip install 'ratekeeper[server]'``. Nothing here is imported by ``ratekeeper``
itself; the CLI imports ``_server`` when ``serve`` runs.
"""
