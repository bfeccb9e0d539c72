"""envoyproxy/ratelimit's environment variables as ``ratekeeper serve``'s options: the pure
mapping (``upstream_settings``), what each storage form becomes (checked by ratekeeper's own URL
parser), refusals and warnings that name the variable, flags winning over the variables, and
one ``ratekeeper serve`` started with no flags and only upstream's variables, deciding over gRPC
and HTTP and reloading when ``RUNTIME_ROOT``'s symlink is swapped."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from ratekeeper._model.errors import ConfigError
from ratekeeper._storage.redis._config import plan
from ratekeeper.cli._main import main
from ratekeeper.service._settings import go_duration, upstream_settings

from ..support.servers import RedisServer, free_port
from ..support.service_support import OURS, serve_process, write

#: What upstream's docker-compose.yml gives its ratelimit container.
COMPOSE = {
    "USE_STATSD": "false",
    "LOG_LEVEL": "debug",
    "REDIS_SOCKET_TYPE": "tcp",
    "REDIS_URL": "redis:6379",
    "RUNTIME_ROOT": "/data",
    "RUNTIME_SUBDIRECTORY": "ratelimit",
    "MEMCACHE_HOST_PORT": "memcached:11211",  # upstream ignores it with the Redis backend
}


def options(env: dict[str, str]) -> dict[str, Any]:
    return dict(upstream_settings(env).options)


def refused(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as caught:
        upstream_settings(env)
    return str(caught.value)


def test_upstream_compose_file() -> None:
    settings = upstream_settings(COMPOSE)
    assert settings.options == {
        "config": "/data/ratelimit/config",
        "storage": "redis://redis:6379",
        "log_level": "debug",
    }
    assert settings.origins["config"] == "RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY"
    assert settings.warnings == ()


def test_nothing_set_means_nothing() -> None:
    assert upstream_settings({}) == upstream_settings({"PATH": "/bin", "REDIS_URL": ""})
    assert options({}) == {}


@pytest.mark.parametrize(
    ("env", "path"),
    [
        ({"RUNTIME_ROOT": "/data"}, "/data/config"),
        ({"RUNTIME_SUBDIRECTORY": "ratelimit"}, "/srv/runtime_data/current/ratelimit/config"),
        (
            {"RUNTIME_ROOT": "/d", "RUNTIME_SUBDIRECTORY": "s", "RUNTIME_APPDIRECTORY": "a"},
            "/d/s/a",
        ),
        ({"RUNTIME_ROOT": "/d", "RUNTIME_WATCH_ROOT": "false"}, "/d/config"),
    ],
)
def test_runtime_directories(env: dict[str, str], path: str) -> None:
    assert options(env)["config"] == path


@pytest.mark.parametrize(
    ("env", "url"),
    [
        ({"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "10.0.0.5:6380"}, "redis://10.0.0.5:6380"),
        ({"REDIS_URL": "/var/run/redis.sock"}, "unix:///var/run/redis.sock"),  # unix: default
        ({"REDIS_AUTH": "pw"}, "unix://:pw@/var/run/nutcracker/ratelimit.sock"),
        (
            {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "[::1]:6379", "REDIS_AUTH": "app:p@ss:w"},
            "redis://app:p%40ss%3Aw@[::1]:6379",
        ),
        (
            {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "r:6379", "REDIS_TLS": "true",
             "REDIS_TLS_CACERT": "/ca.pem", "REDIS_TLS_CLIENT_CERT": "/c.pem",
             "REDIS_TLS_CLIENT_KEY": "/k.pem", "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION": "true"},
            "rediss://r:6379?ssl_ca_certs=%2Fca.pem&ssl_certfile=%2Fc.pem&ssl_keyfile=%2Fk.pem"
            "&ssl_check_hostname=false",
        ),
        (
            {"REDIS_TYPE": "cluster", "REDIS_URL": "n1:7000, n2:7001", "REDIS_AUTH": "pw"},
            "redis+cluster://:pw@n1:7000,n2:7001",
        ),
        (
            {"REDIS_TYPE": "SENTINEL", "REDIS_URL": "mymaster,s1:26379,s2:26379",
             "REDIS_TLS": "1", "REDIS_AUTH": "pw", "REDIS_SENTINEL_AUTH": "pw"},
            "rediss+sentinel://:pw@s1:26379,s2:26379/mymaster",
        ),
        ({"REDIS_URL": "redis://u:p@h:1/2"}, "redis://u:p@h:1/2"),  # a URL passes through
    ],
)  # fmt: skip
def test_redis_forms(env: dict[str, str], url: str) -> None:
    assert options(env)["storage"] == url


def test_redis_forms_are_ratekeeper_urls() -> None:
    """What the mapping writes, ratekeeper's URL parser reads back as upstream meant it."""
    sentinel = plan(
        options({"REDIS_TYPE": "sentinel", "REDIS_URL": "m,s1:26379,s2:26380",
                 "REDIS_AUTH": "u:pw", "REDIS_SENTINEL_AUTH": "u:pw", "REDIS_TLS": "true",
                 "REDIS_TLS_CACERT": "/etc/ca.pem"})["storage"],
        {},
    )  # fmt: skip
    assert (sentinel.kind, sentinel.service, sentinel.hosts) == (
        "sentinel", "m", [("s1", 26379), ("s2", 26380)]
    )  # fmt: skip
    assert sentinel.kwargs["username"] == "u"
    assert sentinel.kwargs["password"] == "pw"
    assert sentinel.kwargs["ssl"] is True
    assert sentinel.kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    cluster = plan(options({"REDIS_TYPE": "CLUSTER", "REDIS_URL": "a:1,b:2"})["storage"], {})
    assert (cluster.kind, cluster.hosts) == ("cluster", [("a", 1), ("b", 2)])


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"BACKEND_TYPE": "memcache"}, ("BACKEND_TYPE=memcache", "REDIS_URL")),
        ({"CONFIG_TYPE": "GRPC_XDS_SOTW"}, ("CONFIG_TYPE=GRPC_XDS_SOTW", "RUNTIME_ROOT")),
        ({"SHADOW_MODE": "yes"}, ("SHADOW_MODE='yes'", "boolean")),
        ({"NEAR_LIMIT_RATIO": "1.5"}, ("NEAR_LIMIT_RATIO=1.5", "0 to 1")),
        ({"QUOTA_MODE": "on"}, ("QUOTA_MODE='on'", "boolean")),
        ({"GRPC_PORT": "70000"}, ("GRPC_PORT=70000", "0 to 65535")),
        ({"PORT": "http"}, ("PORT='http'", "whole number")),
        ({"LOG_LEVEL": "verbose"}, ("LOG_LEVEL='verbose'", "debug")),
        ({"LOG_FORMAT": "xml"}, ("LOG_FORMAT='xml'",)),
        ({"REDIS_TIMEOUT": "10"}, ("REDIS_TIMEOUT='10'", "duration")),
        ({"REDIS_TIMEOUT": "2m"}, ("REDIS_TIMEOUT='2m'", "60s")),
        ({"GRPC_MAX_CONNECTION_AGE": "0s"}, ("GRPC_MAX_CONNECTION_AGE",)),
        ({"REDIS_TYPE": "ring"}, ("REDIS_TYPE='ring'", "SENTINEL")),
        ({"REDIS_SOCKET_TYPE": "udp"}, ("REDIS_SOCKET_TYPE='udp'",)),
        ({"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "redis"},
         ("REDIS_URL", "'redis' is not host:port")),
        ({"REDIS_URL": "redis:6379"}, ("REDIS_URL='redis:6379'", "REDIS_SOCKET_TYPE=tcp")),
        ({"REDIS_URL": "/s.sock", "REDIS_TLS": "true"}, ("REDIS_TLS=true", "unix")),
        ({"REDIS_TYPE": "sentinel", "REDIS_URL": "s1:26379"}, ("name,host:port",)),
        ({"REDIS_TYPE": "sentinel", "REDIS_URL": "m,s1:1", "REDIS_AUTH": "pw"},
         ("REDIS_SENTINEL_AUTH differs from REDIS_AUTH",)),
        ({"REDIS_TYPE": "cluster", "REDIS_URL": "a:1", "REDIS_TLS": "true",
          "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION": "true"},
         ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",)),
        ({"REDIS_URL": "redis://h:1", "REDIS_AUTH": "pw"}, ("is a URL", "REDIS_AUTH")),
        ({"REDIS_URL": "h:1", "REDIS_SOCKET_TYPE": "tcp", "REDIS_TLS": "true",
          "REDIS_TLS_CLIENT_CERT": "/c.pem"},
         ("REDIS_TLS_CLIENT_CERT needs REDIS_TLS_CLIENT_KEY",)),
        ({"GRPC_SERVER_USE_TLS": "true", "GRPC_SERVER_TLS_CERT": "/c.pem"},
         ("GRPC_SERVER_USE_TLS=true needs GRPC_SERVER_TLS_KEY",)),
        ({"GRPC_SERVER_USE_TLS": "true", "GRPC_SERVER_TLS_CERT": "/c", "GRPC_SERVER_TLS_KEY": "/k",
          "GRPC_CLIENT_TLS_SAN": "envoy"}, ("GRPC_CLIENT_TLS_SAN", "GRPC_CLIENT_TLS_CACERT")),
        ({"REDIS_POOL_SIZE": "ten"}, ("REDIS_POOL_SIZE='ten'",)),  # no effect, still checked
    ],
)  # fmt: skip
def test_refusals_name_the_variable(env: dict[str, str], names: tuple[str, ...]) -> None:
    message = refused(env)
    for name in names:
        assert name in message


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        ({"USE_STATSD": "true", "STATSD_HOST": "statsd"}, ("USE_STATSD=true", "GET /metrics")),
        ({"USE_PROMETHEUS": "true"}, ("USE_PROMETHEUS=true", "PROMETHEUS_ADDR")),
        ({"DEBUG_PORT": "7070"}, ("DEBUG_PORT=7070", "/rlconfig")),
        ({"REDIS_PERSECOND": "true", "REDIS_PERSECOND_URL": "r2:6379"}, ("REDIS_PERSECOND=true",)),
        ({"TRACING_ENABLED": "true"}, ("TRACING_ENABLED=true",)),
        ({"RUNTIME_IGNOREDOTFILES": "false"}, ("RUNTIME_IGNOREDOTFILES=false", "dot")),
        ({"GRPC_SERVER_TLS_CERT": "/c.pem"}, ("GRPC_SERVER_TLS_CERT=/c.pem", "plaintext")),
        ({"REDIS_URL": "/s", "REDIS_TLS_CACERT": "/ca.pem"}, ("REDIS_TLS_CACERT", "REDIS_TLS")),
        ({"REDIS_HEALTH_CHECK_ACTIVE_CONNECTION": "true"}, ("health",)),
    ],
)  # fmt: skip
def test_warnings_name_the_variable(env: dict[str, str], fragments: tuple[str, ...]) -> None:
    (warning,) = upstream_settings(env).warnings
    for fragment in fragments:
        assert fragment in warning


@pytest.mark.parametrize(
    "env",
    [
        {"USE_STATSD": "false", "DEBUG_PORT": "6070", "DEBUG_HOST": "0.0.0.0"},  # defaults
        {"MEMCACHE_HOST_PORT": "m:11211", "CONFIG_GRPC_XDS_NODE_ID": "n", "DISABLE_STATS": "1"},
        {"REDIS_POOL_SIZE": "20", "REDIS_PIPELINE_WINDOW": "150us",
         "LOCAL_CACHE_SIZE_IN_BYTES": "0", "EXPIRATION_JITTER_MAX_SECONDS": "300",
         "RUNTIME_IGNOREDOTFILES": "true",
         "RUNTIME_WATCH_ROOT": "false", "FORCE_START_WITHOUT_INITIAL_CONFIG": "true"},
    ],
)  # fmt: skip
def test_quietly_accepted(env: dict[str, str]) -> None:
    settings = upstream_settings(env)
    assert settings.options == {}
    assert settings.warnings == ()


def test_listeners_tls_logs_and_decisions() -> None:
    assert options(
        {"HOST": "127.0.0.1", "PORT": "9080", "GRPC_PORT": "9081", "GRPC_UDS": "/run/rl.sock",
         "GRPC_MAX_CONNECTION_AGE": "1h30m", "GRPC_MAX_CONNECTION_AGE_GRACE": "90s",
         "GRPC_SERVER_USE_TLS": "true", "GRPC_SERVER_TLS_CERT": "/c.pem",
         "GRPC_SERVER_TLS_KEY": "/k.pem", "GRPC_CLIENT_TLS_CACERT": "/ca.pem",
         "GRPC_CLIENT_TLS_SAN": "envoy.internal", "LOG_LEVEL": "WARN", "LOG_FORMAT": "JSON",
         "SHADOW_MODE": "true", "RESPONSE_DYNAMIC_METADATA": "T", "CACHE_KEY_PREFIX": "rl_",
         "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT": "false", "REDIS_TIMEOUT": "500ms",
         "NEAR_LIMIT_RATIO": "0.9", "QUOTA_MODE": "true", "MERGE_DOMAIN_CONFIG": "1",
         "LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_RESET_HEADER": "X-Reset"}
    ) == {
        "host": "127.0.0.1", "grpc_host": "0.0.0.0",  # upstream's GRPC_HOST default
        "http_port": 9080, "grpc_port": 9081, "grpc_uds": "/run/rl.sock",
        "grpc_max_connection_age": 5400.0, "grpc_max_connection_age_grace": 90.0,
        "grpc_tls_cert": "/c.pem", "grpc_tls_key": "/k.pem", "grpc_tls_client_ca": "/ca.pem",
        "grpc_tls_client_san": "envoy.internal", "log_level": "warning", "log_format": "json",
        "shadow_mode": True, "response_dynamic_metadata": True, "key_prefix": "rl_",
        "charge_over_limit": True, "timeout": 0.5, "near_limit_ratio": 0.9, "quota_mode": True,
        "merge_domain_config": True, "limit_response_headers": True,
        "limit_reset_header": "X-Reset",
    }  # fmt: skip
    assert options({"STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT": "true"}) == {
        "charge_over_limit": False
    }


def test_every_option_is_a_serve_parameter() -> None:
    """The mapping speaks serve's parameter names (a renamed option would be a silent no-op)."""
    produced = {
        "config", "storage", "host", "grpc_host", "http_port", "grpc_port", "grpc_uds",
        "grpc_max_connection_age", "grpc_max_connection_age_grace", "grpc_tls_cert",
        "grpc_tls_key", "grpc_tls_client_ca", "grpc_tls_client_san", "log_level", "log_format",
        "shadow_mode", "response_dynamic_metadata", "key_prefix", "charge_over_limit",
        "timeout",
    }  # fmt: skip
    names = {param.name for param in main.commands["serve"].params}
    assert produced <= names


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10s", 10.0), ("1h30m", 5400.0), ("250ms", 0.25), ("1.5h", 5400.0), ("0", 0.0),
     ("150us", 0.00015), ("-2s", -2.0), ("2m3s", 123.0)],
)  # fmt: skip
def test_go_duration(text: str, seconds: float) -> None:
    assert go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "s", "1x", "1h 2m", "h1"])
def test_go_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a Go duration"):
        go_duration(text)


def test_flags_and_own_variables_win(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Upstream's variables are defaults: a flag beats them, and so does RATEKEEPER_SERVE_*."""
    (tmp_path / "config").mkdir()
    monkeypatch.setenv("RUNTIME_ROOT", str(tmp_path))
    monkeypatch.setenv("GRPC_PORT", "9081")
    monkeypatch.setenv("PORT", "9080")
    monkeypatch.setenv("RATEKEEPER_SERVE_HTTP_PORT", "7080")
    monkeypatch.setenv("LOG_FORMAT", "json")
    command = main.commands["serve"]
    with command.make_context("serve", ["--grpc-port", "6081"]) as ctx:
        assert ctx.params["grpc_port"] == 6081  # the flag
        assert ctx.params["http_port"] == 7080  # RATEKEEPER_SERVE_HTTP_PORT
        assert ctx.params["log_format"] == "json"  # LOG_FORMAT: nothing else said
        assert ctx.params["config"] == str(tmp_path / "config")  # RUNTIME_ROOT


def test_a_missing_runtime_directory_is_named(tmp_path: Path) -> None:
    from click.testing import CliRunner

    env = {"RUNTIME_ROOT": str(tmp_path / "nowhere"), "RUNTIME_SUBDIRECTORY": "ratelimit"}
    result = CliRunner().invoke(main, ["serve"], env=env)
    assert result.exit_code == 2
    assert (
        f"RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY: {tmp_path}/nowhere/ratelimit/"
        "config: no such configuration directory" in result.output
    )
    refused_result = CliRunner().invoke(main, ["serve"], env={"BACKEND_TYPE": "memcache"})
    assert refused_result.exit_code == 2
    assert "BACKEND_TYPE=memcache" in refused_result.output
    # --help is not stopped by the environment
    assert CliRunner().invoke(main, ["serve", "--help"], env={"PORT": "x"}).exit_code == 0


CONFIG_V1 = """\
domain: upstream
descriptors:
  - key: user
    rate_limit: {unit: day, requests_per_unit: 3}
"""


async def _calls(grpc_port: int, http_port: int, user: str, n: int) -> list[str]:
    """``n`` decisions for ``user``, alternating gRPC and HTTP; their overall codes."""
    codes = []
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http,
    ):
        call = OURS.caller(channel)
        for i in range(n):
            if i % 2 == 0:
                response = await call(OURS.request("upstream", [("user", user)]))
                codes.append(OURS.response_type.Code.Name(response.overall_code))
            else:
                body = {"domain": "upstream",
                        "descriptors": [{"entries": [{"key": "user", "value": user}]}]}  # fmt: skip
                answer = await http.post("/json", json=body)
                codes.append(answer.json()["overallCode"])
    return codes


def test_serve_with_upstream_variables_only(
    tmp_path: Path, servers: dict[str, RedisServer]
) -> None:
    """No flag: upstream's variables say where the files, the store and the ports are; the
    decisions are shared by gRPC and HTTP; swapping RUNTIME_ROOT's symlink to a new directory
    (upstream's RUNTIME_WATCH_ROOT) reloads."""
    server = next(iter(servers.values()))
    v1 = write(tmp_path / "v1" / "ratelimit" / "config" / "limits.yaml", CONFIG_V1).parents[2]
    root = tmp_path / "current"
    root.symlink_to(v1)
    grpc_port, http_port = free_port(), free_port()
    env = {
        "RUNTIME_ROOT": str(root),
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "RUNTIME_WATCH_ROOT": "true",
        "RUNTIME_IGNOREDOTFILES": "true",
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": f"127.0.0.1:{server.port}",
        "REDIS_TIMEOUT": "2s",
        "HOST": "127.0.0.1",
        "GRPC_HOST": "127.0.0.1",
        "GRPC_PORT": str(grpc_port),
        "PORT": str(http_port),
        "CACHE_KEY_PREFIX": f"upstream{grpc_port}",
        "USE_STATSD": "false",
        "LOG_LEVEL": "info",
    }
    # none of serve's own variables is set (CI sets RATEKEEPER_REQUIRE_SERVERS, the tests' own)
    serve_command = main.commands["serve"]
    own = {
        name
        for param in serve_command.params
        for name in ([param.envvar] if isinstance(param.envvar, str) else param.envvar or [])
    }
    assert own
    assert not own & set(os.environ)
    with serve_process(env=env) as serve:
        (line,) = serve.wait_for("ready")
        assert f"gRPC on 127.0.0.1:{grpc_port}, HTTP on 127.0.0.1:{http_port}" in line
        assert f"configuration from {root}/ratelimit/config" in line
        codes = asyncio.run(_calls(grpc_port, http_port, "alice", 5))
        assert codes == ["OK", "OK", "OK", "OVER_LIMIT", "OVER_LIMIT"]
        with server.client() as admin:  # CACHE_KEY_PREFIX is the keys' prefix
            assert admin.keys(f"upstream{grpc_port}:*")
        # a new version in a new directory, then the symlink swapped at once (os.replace)
        v2 = write(
            tmp_path / "v2" / "ratelimit" / "config" / "limits.yaml",
            CONFIG_V1.replace("requests_per_unit: 3", "requests_per_unit: 5"),
        ).parents[2]
        (tmp_path / "next").symlink_to(v2)
        os.replace(tmp_path / "next", root)
        serve.wait_for("configuration reloaded")
        codes = asyncio.run(_calls(grpc_port, http_port, "bob", 6))
        assert codes == ["OK"] * 5 + ["OVER_LIMIT"]  # the new limit
