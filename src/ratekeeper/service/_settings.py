"""envoyproxy/ratelimit's environment variables, read as ``ratekeeper serve``'s options, so an
upstream deployment (a Kubernetes manifest, a docker-compose file) runs with only its image and
command changed.

:func:`upstream_settings` is pure: the environment in, :class:`UpstreamSettings` out (the
options they mean, by ``serve``'s parameter names, and warnings), or a ``ConfigError`` that
names the variable. The CLI gives these values as defaults: a flag, or a ``RATEKEEPER_SERVE_*``
variable, wins. Only variables that are set (not empty) count, as upstream's defaults are
ratekeeper's where it matters (ports 8080 and 8081 on 0.0.0.0).

Every variable of upstream's ``src/settings/settings.go`` falls in one of these groups:

* the same meaning: listeners (``HOST``, ``PORT``, ``GRPC_HOST``, ``GRPC_PORT``, ``GRPC_UDS``,
  ``GRPC_MAX_CONNECTION_AGE[_GRACE]``), gRPC TLS (``GRPC_SERVER_USE_TLS``,
  ``GRPC_SERVER_TLS_CERT``/``_KEY``, ``GRPC_CLIENT_TLS_CACERT``, ``GRPC_CLIENT_TLS_SAN``), the
  configuration directory (``RUNTIME_*``), the store (``REDIS_URL``, ``REDIS_TYPE``,
  ``REDIS_SOCKET_TYPE``, ``REDIS_AUTH``, ``REDIS_SENTINEL_AUTH``, ``REDIS_TLS*``,
  ``REDIS_TIMEOUT``), ``CACHE_KEY_PREFIX``, logs (``LOG_LEVEL``, ``LOG_FORMAT``),
  ``SHADOW_MODE``, ``RESPONSE_DYNAMIC_METADATA``, ``STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT``,
  ``MERGE_DOMAIN_CONFIG``, ``QUOTA_MODE``, ``LIMIT_RESPONSE_HEADERS_ENABLED``,
  ``LIMIT_*_HEADER``, ``NEAR_LIMIT_RATIO``;
* refused, with what to do: what ratekeeper does not have and that changes decisions
  (``BACKEND_TYPE=memcache``, ``CONFIG_TYPE=GRPC_XDS_SOTW``), and store settings a storage URL
  cannot say;
* a warning: what changes no decision but that an operator may count on (statsd, a
  Prometheus or debug listener of its own, tracing, a second Redis for
  per-second limits, health tied to a connection or to a loaded domain, dot files);
* no effect, silently: upstream's client tuning (``REDIS_POOL_SIZE``, ``REDIS_PIPELINE_*``,
  ``REDIS_STARTUP_*``, ...), ``LOCAL_CACHE_SIZE_IN_BYTES`` (ratekeeper has its own bounded
  deny cache), ``EXPIRATION_JITTER_MAX_SECONDS``, and what upstream ignores itself in the
  same setting (``MEMCACHE_*`` with the Redis backend, ``CONFIG_GRPC_XDS_*`` with files,
  ``REDIS_PERSECOND_*`` without ``REDIS_PERSECOND``). Their values are still checked.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

from .._model.errors import ConfigError

__all__ = ["DEFAULT_CONFIG", "LOG_LEVELS", "UpstreamSettings", "go_duration", "upstream_settings"]

#: Where upstream reads its files when no ``RUNTIME_*`` variable is set.
DEFAULT_CONFIG = "/srv/runtime_data/current/config"

#: Upstream's (logrus') level names -> the logging level names ``--log-level`` takes.
LOG_LEVELS = {"panic": "critical", "fatal": "critical", "error": "error", "warn": "warning",
              "warning": "warning", "info": "info", "debug": "debug", "trace": "debug"}  # fmt: skip

_UPSTREAM_DEFAULT_REDIS_URL = "/var/run/nutcracker/ratelimit.sock"
_STORE_VARIABLES = ("REDIS_URL", "REDIS_TYPE", "REDIS_SOCKET_TYPE", "REDIS_AUTH", "REDIS_TLS")
_REDIS_TLS_FILES = ("REDIS_TLS_CACERT", "REDIS_TLS_CLIENT_CERT", "REDIS_TLS_CLIENT_KEY")
_GRPC_TLS_FILES = ("GRPC_SERVER_TLS_CERT", "GRPC_SERVER_TLS_KEY", "GRPC_CLIENT_TLS_CACERT",
                   "GRPC_CLIENT_TLS_SAN")  # fmt: skip

#: Go's strconv.ParseBool, which upstream's settings use.
_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                   "m": 60.0, "h": 3600.0}  # fmt: skip

#: Variables that, true, ask for what changes no decision but is missing: a warning each.
_STATS_ADVICE = (
    "ratekeeper serve has no push sink; its metrics are served for Prometheus at "
    "GET /metrics on the HTTP port (PORT): scrape that"
)
_WARN_WHEN_TRUE = {
    "USE_STATSD": _STATS_ADVICE + " (set USE_STATSD=false to silence this)",
    "USE_DOG_STATSD": _STATS_ADVICE,
    "USE_PROMETHEUS": "ratekeeper serve has no Prometheus listener of its own (PROMETHEUS_ADDR); "
    "its metrics are at GET /metrics on the HTTP port (PORT): point the scrape there",
    "TRACING_ENABLED": "ratekeeper serve exports no traces; nothing is sent",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION": "the health checks pass once the store has answered "
    "(as upstream's start-up ping), and do not follow the connections afterwards; store "
    "failures reach --failure-mode instead",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED": "ratekeeper serve never starts without a "
    "configuration that loads, and a reload that fails keeps the one in force; a configuration "
    "of no domains is healthy",
    "REDIS_PERSECOND": "ratekeeper serve keeps every limit, per-second ones too, in one store "
    "(REDIS_URL); REDIS_PERSECOND_URL is not used",
}
#: Upstream's debug listener (name: its default): another value is a warning.
_DEBUG = {"DEBUG_HOST": "0.0.0.0", "DEBUG_PORT": "6070"}
_NO_DEBUG = "ratekeeper serve has no debug listener; /rlconfig and /metrics are on the HTTP port"


@dataclass(frozen=True)
class UpstreamSettings:
    """What upstream's variables ask of ``ratekeeper serve``.

    ``options`` maps ``serve``'s parameter names to values; ``origins`` maps the same names to
    the variables each came from (for messages); ``warnings`` are what ratekeeper does
    differently, one line each, naming the variable.
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    origins: Mapping[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


def go_duration(text: str) -> float:
    """Seconds in a Go duration (``time.ParseDuration``: ``10s``, ``1h30m``, ``250ms``, ``0``);
    a ValueError when it is not one."""
    body = text.strip()
    sign = 1.0
    if body[:1] in ("+", "-"):
        sign, body = (-1.0 if body[0] == "-" else 1.0), body[1:]
    if body == "0":
        return 0.0
    if not body:
        raise ValueError(f"not a Go duration: {text!r}")
    total, at = 0.0, 0
    for match in _DURATION_PART.finditer(body):
        if match.start() != at:
            raise ValueError(f"not a Go duration: {text!r}")
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        at = match.end()
    if at != len(body):
        raise ValueError(f"not a Go duration: {text!r}")
    return sign * total


class _Reader:
    """The environment's set variables, read with the variable's name in every error."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = {name: value for name, value in env.items() if value != ""}
        self.options: dict[str, Any] = {}
        self.origins: dict[str, str] = {}
        self.warnings: list[str] = []

    def __contains__(self, name: str) -> bool:
        return name in self.env

    def text(self, name: str, default: str = "") -> str:
        return self.env.get(name, default)

    def parsed(self, name: str, parse: Callable[[str], Any], what: str, default: Any) -> Any:
        if name not in self.env:
            return default
        value = self.env[name]
        try:
            return parse(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not {what}") from None

    def flag(self, name: str, default: bool = False) -> bool:
        def parse(value: str) -> bool:
            if value in _TRUE:
                return True
            if value in _FALSE:
                return False
            raise ValueError(value)

        return bool(self.parsed(name, parse, "a boolean (true or false)", default))

    def integer(self, name: str, low: int, high: int) -> int | None:
        number = self.parsed(name, int, "a whole number", None)
        if number is not None and not low <= number <= high:
            raise ConfigError(f"{name}={number} is out of range: {low} to {high}")
        return None if number is None else int(number)

    def duration(self, name: str) -> float | None:
        value = self.parsed(name, go_duration, "a duration (10s, 1h30m, 250ms)", None)
        return None if value is None else float(value)

    def set(self, option: str, value: Any, *names: str) -> None:
        self.options[option] = value
        self.origins[option] = "/".join(names)

    def warn(self, name: str, advice: str) -> None:
        self.warnings.append(f"{name}={self.env[name]}: {advice}")


def upstream_settings(env: Mapping[str, str]) -> UpstreamSettings:
    """The options upstream's variables in ``env`` mean (see the module's docstring); a
    ConfigError naming the variable for a value that is not valid, or that asks for what
    ratekeeper serve does not do."""
    read = _Reader(env)
    _listeners(read)
    _grpc_tls(read)
    _runtime(read)
    _store(read)
    _decisions(read)
    _logs(read)
    _others(read)
    return UpstreamSettings(dict(read.options), dict(read.origins), tuple(read.warnings))


def _listeners(read: _Reader) -> None:
    if "HOST" in read:
        read.set("host", read.text("HOST"), "HOST")
    if "GRPC_HOST" in read or "HOST" in read:
        # upstream binds gRPC to GRPC_HOST (0.0.0.0 by default), whatever HOST says
        read.set("grpc_host", read.text("GRPC_HOST", "0.0.0.0"), "GRPC_HOST")
    for name, option in (("PORT", "http_port"), ("GRPC_PORT", "grpc_port")):
        port = read.integer(name, 0, 65535)
        if port is not None:
            read.set(option, port, name)
    if "GRPC_UDS" in read:
        read.set("grpc_uds", read.text("GRPC_UDS"), "GRPC_UDS")
    for name, option in (
        ("GRPC_MAX_CONNECTION_AGE", "grpc_max_connection_age"),
        ("GRPC_MAX_CONNECTION_AGE_GRACE", "grpc_max_connection_age_grace"),
    ):
        seconds = read.duration(name)
        if seconds is not None:
            if not seconds > 0:
                raise ConfigError(f"{name}={read.text(name)!r}: give a duration above 0")
            read.set(option, seconds, name)


def _grpc_tls(read: _Reader) -> None:
    given = [name for name in _GRPC_TLS_FILES if name in read]
    if not read.flag("GRPC_SERVER_USE_TLS"):
        for name in given:  # upstream serves plaintext then, and so does ratekeeper
            read.warn(name, "not used: GRPC_SERVER_USE_TLS is not true, gRPC is plaintext")
        return
    missing = [name for name in ("GRPC_SERVER_TLS_CERT", "GRPC_SERVER_TLS_KEY") if name not in read]
    if missing:
        raise ConfigError(
            f"GRPC_SERVER_USE_TLS=true needs {' and '.join(missing)}: the server's certificate "
            "chain and private key (PEM files)"
        )
    for name, option in (
        ("GRPC_SERVER_TLS_CERT", "grpc_tls_cert"),
        ("GRPC_SERVER_TLS_KEY", "grpc_tls_key"),
        ("GRPC_CLIENT_TLS_CACERT", "grpc_tls_client_ca"),
        ("GRPC_CLIENT_TLS_SAN", "grpc_tls_client_san"),
    ):
        if name in read:
            read.set(option, read.text(name), name)
    if "GRPC_CLIENT_TLS_SAN" in read and "GRPC_CLIENT_TLS_CACERT" not in read:
        raise ConfigError(
            "GRPC_CLIENT_TLS_SAN checks client certificates, which only GRPC_CLIENT_TLS_CACERT "
            "asks for: set it too (the CA that issues the clients' certificates)"
        )


def _runtime(read: _Reader) -> None:
    names = ("RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY", "RUNTIME_APPDIRECTORY")
    read.flag("RUNTIME_WATCH_ROOT", True)  # both ways are watched: see docs/service.md
    if not read.flag("RUNTIME_IGNOREDOTFILES", True) and "RUNTIME_IGNOREDOTFILES" in read:
        read.warn(
            "RUNTIME_IGNOREDOTFILES",
            "ratekeeper serve always skips names that start with a dot (a Kubernetes "
            "ConfigMap's ..data would load every file twice)",
        )
    if not any(name in read for name in names):
        return
    root = read.text("RUNTIME_ROOT", "/srv/runtime_data/current")
    parts = [root, read.text("RUNTIME_SUBDIRECTORY"), read.text("RUNTIME_APPDIRECTORY", "config")]
    path = os.path.join(*(part for part in parts if part))
    read.set("config", path, *names)


def _store(read: _Reader) -> None:
    backend = read.text("BACKEND_TYPE", "redis")
    if backend == "memcache":
        raise ConfigError(
            "BACKEND_TYPE=memcache: ratekeeper serve has no memcache backend; it keeps its "
            "limits in Redis or Valkey: set REDIS_URL (or --storage) and unset BACKEND_TYPE"
        )
    if backend != "redis":
        raise ConfigError(f"BACKEND_TYPE={backend!r} is not a backend: redis (or memcache)")
    timeout = read.duration("REDIS_TIMEOUT")
    if timeout is not None:
        if not 0 < timeout <= 60:
            raise ConfigError(
                f"REDIS_TIMEOUT={read.text('REDIS_TIMEOUT')!r}: ratekeeper serve takes a store "
                "timeout above 0 and up to 60s (a decision waits for it)"
            )
        read.set("timeout", timeout, "REDIS_TIMEOUT")
    for name in ("REDIS_POOL_SIZE", "REDIS_CLUSTER_PIPELINE_PARALLELISM", "REDIS_PIPELINE_LIMIT"):
        read.integer(name, 0, 2**31 - 1)  # upstream's client tuning: checked, no effect
    for name in (
        "REDIS_PIPELINE_WINDOW",
        "REDIS_STARTUP_INITIAL_INTERVAL",
        "REDIS_STARTUP_MAX_INTERVAL",
        "REDIS_STARTUP_MAX_ELAPSED_TIME",
    ):
        read.duration(name)
    if not any(name in read for name in _STORE_VARIABLES):
        for name in (
            "REDIS_SENTINEL_AUTH",
            "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
            *_REDIS_TLS_FILES,
        ):
            if name in read:
                read.warn(name, "not used: REDIS_URL is not set")
        return
    read.set("storage", _storage_url(read), *(n for n in _STORE_VARIABLES if n in read))


def _storage_url(read: _Reader) -> str:
    """REDIS_URL and its companions as a ratekeeper storage URL (the forms of
    ``ratekeeper._storage``)."""
    url = read.text("REDIS_URL", _UPSTREAM_DEFAULT_REDIS_URL)
    kind = read.text("REDIS_TYPE", "SINGLE").lower()
    socket_type = read.text("REDIS_SOCKET_TYPE", "unix").lower()
    tls = read.flag("REDIS_TLS")
    auth = read.text("REDIS_AUTH")
    if kind not in ("single", "sentinel", "cluster"):
        raise ConfigError(
            f"REDIS_TYPE={read.text('REDIS_TYPE')!r} is not a Redis type: SINGLE, SENTINEL or "
            "CLUSTER"
        )
    if socket_type not in ("tcp", "tcp4", "tcp6", "unix"):
        raise ConfigError(
            f"REDIS_SOCKET_TYPE={read.text('REDIS_SOCKET_TYPE')!r} is not a socket type: tcp or "
            "unix"
        )
    if "://" in url:
        scheme = url.split("://", 1)[0]
        if kind != "single" or scheme.lower() not in ("redis", "rediss", "unix"):
            raise ConfigError(
                f"REDIS_URL={url!r}: upstream's form is host:port (or a socket path, or a "
                "comma-separated list for SENTINEL and CLUSTER); give a ratekeeper storage URL "
                "in RATEKEEPER_STORAGE (or --storage) instead"
            )
        for name in ("REDIS_AUTH", "REDIS_TLS", *_REDIS_TLS_FILES):
            if name in read:
                raise ConfigError(
                    f"REDIS_URL={url!r} is a URL: put what {name} says in it (user:password@, "
                    f"rediss://, ?ssl_ca_certs=...) and unset {name}"
                )
        return url
    query = _redis_tls_query(read, tls, kind)
    userinfo = _userinfo(auth)
    if kind == "single" and socket_type == "unix":  # no TLS: the query is empty
        if tls:
            raise ConfigError(
                "REDIS_TLS=true with REDIS_SOCKET_TYPE=unix: ratekeeper does not speak TLS over "
                "a unix socket; use REDIS_SOCKET_TYPE=tcp, or unset REDIS_TLS"
            )
        if not url.startswith("/"):
            raise ConfigError(
                f"REDIS_URL={url!r} with REDIS_SOCKET_TYPE=unix (upstream's default) is a "
                "socket's absolute path; for host:port set REDIS_SOCKET_TYPE=tcp"
            )
        return f"unix://{userinfo}{quote(url)}"
    scheme = "rediss" if tls else "redis"
    tail = f"?{urlencode(query)}" if query else ""
    if kind == "single":
        return f"{scheme}://{userinfo}{_host_port(url, 'REDIS_URL')}{tail}"
    items = [item.strip() for item in url.split(",")]
    if kind == "cluster":
        hosts = ",".join(_host_port(item, "REDIS_URL") for item in items)
        return f"{scheme}+cluster://{userinfo}{hosts}{tail}"
    if len(items) < 2 or not items[0]:
        raise ConfigError(
            f"REDIS_URL={url!r} with REDIS_TYPE=SENTINEL is the primary's name and the "
            "sentinels: name,host:port[,host:port...]"
        )
    sentinel_auth = read.text("REDIS_SENTINEL_AUTH")
    if sentinel_auth != auth:
        raise ConfigError(
            "REDIS_SENTINEL_AUTH differs from REDIS_AUTH: ratekeeper gives the sentinels the "
            "credentials of the primary; make the two the same (both unset when neither asks "
            "for a password)"
        )
    hosts = ",".join(_host_port(item, "REDIS_URL") for item in items[1:])
    return f"{scheme}+sentinel://{userinfo}{hosts}/{quote(items[0], safe='')}{tail}"


def _userinfo(auth: str) -> str:
    if not auth:
        return ""
    user, colon, password = auth.partition(":")  # upstream: "password" or "user:password"
    if not colon:
        return f":{quote(auth, safe='')}@"
    return f"{quote(user, safe='')}:{quote(password, safe='')}@"


def _host_port(item: str, name: str) -> str:
    host, colon, port = item.rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not bare or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}: {item!r} is not host:port")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def _redis_tls_query(read: _Reader, tls: bool, kind: str) -> list[tuple[str, str]]:
    given = [
        name for name in (*_REDIS_TLS_FILES, "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION") if name in read
    ]
    if not tls:
        for name in given:  # upstream uses them only with REDIS_TLS
            read.warn(name, "not used: REDIS_TLS is not true")
        return []
    query = []
    if "REDIS_TLS_CACERT" in read:
        query.append(("ssl_ca_certs", read.text("REDIS_TLS_CACERT")))
    pair = [name for name in ("REDIS_TLS_CLIENT_CERT", "REDIS_TLS_CLIENT_KEY") if name in read]
    if len(pair) == 1:
        other = ({"REDIS_TLS_CLIENT_CERT", "REDIS_TLS_CLIENT_KEY"} - set(pair)).pop()
        raise ConfigError(f"{pair[0]} needs {other}: a client certificate and its key")
    if pair:
        query.append(("ssl_certfile", read.text("REDIS_TLS_CLIENT_CERT")))
        query.append(("ssl_keyfile", read.text("REDIS_TLS_CLIENT_KEY")))
    if read.flag("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION"):
        if kind != "single":
            raise ConfigError(
                "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION=true works with REDIS_TYPE=SINGLE only in "
                "ratekeeper serve: give the servers certificates that name them"
            )
        query.append(("ssl_check_hostname", "false"))
    return query


def _decisions(read: _Reader) -> None:
    if read.flag("SHADOW_MODE"):
        read.set("shadow_mode", True, "SHADOW_MODE")
    if read.flag("RESPONSE_DYNAMIC_METADATA"):
        read.set("response_dynamic_metadata", True, "RESPONSE_DYNAMIC_METADATA")
    if "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT" in read:
        # upstream counts a denied call's hits unless this is true (ratekeeper's default)
        charge = not read.flag("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT")
        read.set("charge_over_limit", charge, "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT")
    for name, option in (
        ("MERGE_DOMAIN_CONFIG", "merge_domain_config"),
        ("QUOTA_MODE", "quota_mode"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "limit_response_headers"),
    ):
        if read.flag(name):
            read.set(option, True, name)
    for name in ("LIMIT_LIMIT_HEADER", "LIMIT_REMAINING_HEADER", "LIMIT_RESET_HEADER"):
        if name in read:  # checked as a header name by the option
            read.set(name.lower(), read.text(name), name)
    ratio = read.parsed("NEAR_LIMIT_RATIO", float, "a number", None)
    if ratio is not None:
        if not 0 <= ratio <= 1:
            raise ConfigError(f"NEAR_LIMIT_RATIO={ratio} is out of range: 0 to 1")
        read.set("near_limit_ratio", float(ratio), "NEAR_LIMIT_RATIO")
    prefix = read.text("CACHE_KEY_PREFIX")
    if prefix:
        read.set("key_prefix", prefix, "CACHE_KEY_PREFIX")
    config_type = read.text("CONFIG_TYPE", "FILE")
    if config_type == "GRPC_XDS_SOTW":
        raise ConfigError(
            "CONFIG_TYPE=GRPC_XDS_SOTW: ratekeeper serve reads its configuration from files, "
            "not from an xDS server: mount the YAML files (RUNTIME_ROOT) and unset CONFIG_TYPE"
        )
    if config_type != "FILE":
        raise ConfigError(f"CONFIG_TYPE={config_type!r} is not FILE (or GRPC_XDS_SOTW)")
    read.flag("FORCE_START_WITHOUT_INITIAL_CONFIG")  # upstream: for xDS only


def _logs(read: _Reader) -> None:
    if "LOG_LEVEL" in read:
        level = LOG_LEVELS.get(read.text("LOG_LEVEL").lower())
        if level is None:
            raise ConfigError(
                f"LOG_LEVEL={read.text('LOG_LEVEL')!r} is not a level: " + ", ".join(LOG_LEVELS)
            )
        read.set("log_level", level, "LOG_LEVEL")
    if "LOG_FORMAT" in read:
        fmt = read.text("LOG_FORMAT").lower()
        if fmt not in ("text", "json"):
            raise ConfigError(f"LOG_FORMAT={read.text('LOG_FORMAT')!r} is not text or json")
        read.set("log_format", fmt, "LOG_FORMAT")


def _others(read: _Reader) -> None:
    for name, advice in _WARN_WHEN_TRUE.items():
        if name in read and read.flag(name):
            read.warn(name, advice)
    read.integer("DEBUG_PORT", 0, 65535)
    for name, default in _DEBUG.items():
        if name in read and read.text(name) != default:
            read.warn(name, _NO_DEBUG)
    for name in (
        "DISABLE_STATS",
        "REDIS_PERSECOND_TLS",
        "MEMCACHE_TLS",
        "CONFIG_GRPC_XDS_SERVER_USE_TLS",
    ):
        read.flag(name)  # no effect here; a value Go would refuse is refused
    read.integer("LOCAL_CACHE_SIZE_IN_BYTES", 0, 2**63 - 1)
    read.integer("EXPIRATION_JITTER_MAX_SECONDS", 0, 2**63 - 1)
