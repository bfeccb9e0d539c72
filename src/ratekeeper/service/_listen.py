"""Where the gRPC server listens and how: TCP (``host:port``) or a unix socket (``unix:PATH``,
upstream's ``GRPC_UDS``), plaintext or TLS, with client certificates required when a client CA
is given (mTLS, upstream's ``GRPC_CLIENT_TLS_CACERT``) and, optionally, a name the client's
certificate must carry (``GRPC_CLIENT_TLS_SAN``).

The files are checked once before serving (:meth:`GrpcTls.check`: a ``ConfigError`` naming the
file), and read again when they change, as upstream does: gRPC asks
:meth:`GrpcTls.fetch` before each new connection's handshake; a ``stat`` of the files tells
whether to reload them (a rotated certificate serves the next connection; a broken one is
logged and the one in force stays).
"""

from __future__ import annotations

import inspect
import logging
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._model.errors import ConfigError

__all__ = ["GrpcTls", "client_san_interceptor", "grpc_target"]

log = logging.getLogger("ratekeeper.service")


def grpc_target(host: str, port: int, uds: str | None) -> str:
    """The address gRPC binds: ``unix:PATH`` for a unix socket, else ``host:port``."""
    if uds:
        return f"unix:{uds}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _stamp(path: str) -> tuple[int, int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0, 0)
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass(frozen=True)
class GrpcTls:
    """The gRPC listener's TLS: PEM files of the certificate chain and key, and of the CA
    whose certificates clients must present (None: no client certificate asked for)."""

    cert: str
    key: str
    client_ca: str | None = None
    #: A DNS name (or IP address) the client's certificate must carry (with ``client_ca``).
    client_san: str | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.cert, self.key) + ((self.client_ca,) if self.client_ca else ())

    def check(self) -> None:
        """Load the files as a TLS server would; a ConfigError naming the file otherwise."""
        if self.client_san is not None and self.client_ca is None:
            raise ConfigError("a client certificate name (SAN) needs the client CA too")
        for path in self.paths:
            if not os.path.isfile(path):
                raise ConfigError(f"{path}: no such TLS file")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"{self.cert}, {self.key}: not a PEM certificate chain and its private key ({exc})"
            ) from None
        if self.client_ca:
            try:
                context.load_verify_locations(self.client_ca)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(f"{self.client_ca}: not PEM CA certificates ({exc})") from None

    def configuration(self) -> Any:
        """The files as gRPC's server certificate configuration."""
        import grpc

        def read(path: str) -> bytes:
            with open(path, "rb") as file:
                return file.read()

        chain = [(read(self.key), read(self.cert))]
        ca = read(self.client_ca) if self.client_ca else None
        return grpc.ssl_server_certificate_configuration(chain, root_certificates=ca)

    def credentials(self) -> Any:
        """gRPC server credentials that read the files again when they change (one port
        each: gRPC's dynamic credentials serve a single listener)."""
        import grpc

        self.check()
        reloading = _Reloading(self)
        return grpc.dynamic_ssl_server_credentials(
            self.configuration(),
            reloading.fetch,
            require_client_authentication=self.client_ca is not None,
        )


class _Reloading:
    """The files' state as last loaded, and gRPC's fetcher over it."""

    def __init__(self, tls: GrpcTls) -> None:
        self.tls = tls
        self.stamp = self._stamp()
        self.lock = threading.Lock()

    def _stamp(self) -> tuple[tuple[int, int, int, int], ...]:
        return tuple(_stamp(path) for path in self.tls.paths)

    def fetch(self) -> Any:
        """What gRPC asks before a handshake (on its threads): a new configuration when a
        file changed, else None (keep the one in force)."""
        stamp = self._stamp()
        with self.lock:
            if stamp == self.stamp:
                return None
            self.stamp = stamp
            try:
                self.tls.check()
                configuration = self.tls.configuration()
            except (ConfigError, OSError) as exc:
                log.error(
                    "ratekeeper serve: the gRPC TLS files changed but do not load; the "
                    "certificate in force stays: %s",
                    exc,
                )
                return None
        log.info("ratekeeper serve: gRPC TLS files reloaded (%s)", self.tls.cert)
        return configuration


def _names(context: Any) -> list[str]:
    auth = context.auth_context()
    return [n.decode() for n in auth.get("x509_subject_alternative_name", ())]


def _matches(pattern: str, name: str) -> bool:
    """A certificate's SAN ``pattern`` (``*.example.com`` covers one label) names ``name``."""
    pattern, name = pattern.lower().rstrip("."), name.lower().rstrip(".")
    if pattern.startswith("*."):
        head, dot, rest = name.partition(".")
        return bool(head) and bool(dot) and rest == pattern[2:]
    return pattern == name


def client_san_interceptor(san: str) -> Any:
    """A grpc.aio server interceptor refusing (UNAUTHENTICATED) every call whose client
    certificate does not carry ``san`` among its subject alternative names."""
    import grpc

    def allowed(context: Any) -> bool:
        return any(_matches(pattern, san) for pattern in _names(context))

    refusal = f"the client certificate does not name {san}"

    def unary(inner: Callable[..., Any]) -> Callable[..., Any]:
        async def checked(request: Any, context: Any) -> Any:
            if not allowed(context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
            return await inner(request, context)

        return checked

    def streaming(inner: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(inner):
            return unary(inner)  # a handler that writes with context.write (the health Watch)

        async def checked(request: Any, context: Any) -> Any:
            if not allowed(context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
            async for item in inner(request, context):
                yield item

        return checked

    class _ClientSan(grpc.aio.ServerInterceptor):  # type: ignore[misc]
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = await continuation(details)
            if handler is None:
                return None
            if handler.unary_unary is not None:
                return handler._replace(unary_unary=unary(handler.unary_unary))
            if handler.unary_stream is not None:
                return handler._replace(unary_stream=streaming(handler.unary_stream))
            return handler  # no client-streaming method is served

    return _ClientSan()
