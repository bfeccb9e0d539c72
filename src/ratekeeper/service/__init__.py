"""``ratekeeper serve``: the Envoy rate limit service (gRPC v3) and an HTTP JSON API over
``AsyncLimiter``, configured by envoyproxy/ratelimit's YAML.

Its modules: ``_config`` (the rules and how descriptors find theirs), ``_loader`` (YAML files into
them) on ``_yaml_nodes`` (typed YAML nodes with their positions), ``_reload`` (watching the
files), ``_decide`` (a request's descriptors to store calls and back), ``_tokens`` (the signed
reservation tokens of ``/reserve`` and ``/settle``), ``_server`` (gRPC and HTTP), ``_web`` (the
JSON API), ``_metrics``, ``_listen`` (where and how gRPC listens: TCP or a unix socket, TLS),
``_settings`` (envoyproxy/ratelimit's environment variables as options), ``_logs`` (the
worker's log format), and ``rls_pb2`` (generated).

Install with ``pip install 'ratekeeper[server]'``. Nothing here is imported by ``ratekeeper``
itself; the CLI imports ``_server`` when ``serve`` runs.
"""
