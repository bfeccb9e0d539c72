"""``ratekeeper serve``: one asyncio loop per process serving gRPC (grpc.aio) and HTTP
(uvicorn) over one ``AsyncLimiter``, and ``--workers N`` processes on the same ports.

gRPC answers ``/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`` through a generic
handler over the project's own copy of Envoy's messages (``rls.proto``: upstream's field
numbers, another package name), and the standard health service (grpcio-health-checking, the
gRPC team's own implementation, the one Kubernetes' and Envoy's gRPC health checks speak).

Workers share nothing but the store: each binds the ports with ``SO_REUSEPORT`` (gRPC's
``grpc.so_reuseport`` option; a reuse-port socket handed to uvicorn), so the kernel spreads
connections over them. With one worker, reuse-port is off, so a port another program holds
is an error rather than a silent share. Their metrics meet in a private directory the parent
makes and removes (``_metrics.WorkerMetricsDir``), so any worker's scrape shows them all.

Reservation tokens (``/reserve``, ``/settle``) are signed with ``reservation_key``: when none is
given, ``serve`` draws one before the workers start, so every worker reads the others' tokens
(another replica needs the same key given to both).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from google.protobuf.message import DecodeError

from .._limiters.limiter import AsyncLimiter
from .._model.errors import ConfigError, StorageError
from .._model.options import FailureMode
from ._config import ServiceConfig
from ._decide import DEFAULT_LIMIT_HEADERS, BadRequest, Decider
from ._health import STOPPING, Health
from ._listen import GrpcTls, client_san_interceptor, grpc_target
from ._loader import load_config
from ._logs import configure_logging, status_line
from ._metrics import NEAR_LIMIT_RATIO, ServiceMetrics, WorkerMetricsDir, single_process_metrics
from ._reload import ConfigWatcher
from ._tokens import Tokens
from ._web import ServiceApp
from .rls_pb2 import RateLimitRequest, RateLimitResponse

__all__ = ["RLS_METHOD", "RLS_SERVICE", "ServeOptions", "Service", "serve"]

log = logging.getLogger("ratekeeper.service")

#: The gRPC service and method Envoy calls.
RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
RLS_METHOD = f"/{RLS_SERVICE}/ShouldRateLimit"
#: The names the gRPC health service answers for (besides ""): the service's, and
#: envoyproxy/ratelimit's "ratelimit", which its deployments' probes ask for.
HEALTH_NAMES = (RLS_SERVICE, "ratelimit")


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``ratekeeper serve`` takes (see its ``--help``)."""

    config: str
    storage: str | None = None
    host: str = "0.0.0.0"
    grpc_port: int = 8081
    http_port: int = 8080
    workers: int = 1
    failure_mode: FailureMode = "raise"
    timeout: float | None = None
    key_prefix: str = "ratekeeper"
    response_headers: bool = False
    reload_interval: float = 0.25
    grace: float = 5.0
    portable: bool = False
    #: Signs reservation tokens; None: a random key (drawn once by ``serve`` for its workers).
    reservation_key: str | None = field(default=None, repr=False)
    #: Seconds a reservation token may be settled in.
    reservation_ttl: float = 600.0
    #: ``duration_until_reset`` to the nanosecond instead of upstream's whole seconds.
    exact_durations: bool = False
    #: Upstream's SHADOW_MODE: every answer OK overall (the statuses still tell).
    shadow_mode: bool = False
    #: Upstream's RESPONSE_DYNAMIC_METADATA: fill the response's ``dynamic_metadata``.
    response_dynamic_metadata: bool = False
    #: Count every rule's denied hits, as upstream does (a rule's ``charge_over_limit``).
    charge_over_limit: bool = False
    #: Upstream's MERGE_DOMAIN_CONFIG: a domain's descriptors may be spread over several files.
    merge_domain_config: bool = False
    #: Upstream's QUOTA_MODE: every descriptor in quota mode (the request is refused only when
    #: all of them are over their limits).
    quota_mode: bool = False
    #: Upstream's LIMIT_RESPONSE_HEADERS_ENABLED: the limit, remaining and reset headers of
    #: the descriptor closest to its limit, named ``limit_header_names``.
    limit_response_headers: bool = False
    #: Upstream's LIMIT_LIMIT_HEADER, LIMIT_REMAINING_HEADER and LIMIT_RESET_HEADER.
    limit_header_names: tuple[str, str, str] = DEFAULT_LIMIT_HEADERS
    #: Upstream's NEAR_LIMIT_RATIO: hits past this share of a limit count as near_limit.
    near_limit_ratio: float = NEAR_LIMIT_RATIO
    #: gRPC's own bind address (None: ``host``, as HTTP's); upstream's GRPC_HOST.
    grpc_host: str | None = None
    #: Serve gRPC on this unix socket instead of TCP (upstream's GRPC_UDS).
    grpc_uds: str | None = None
    #: TLS (and mTLS, with a client CA) on the gRPC listener; None: plaintext.
    grpc_tls: GrpcTls | None = None
    #: Seconds after which gRPC closes a connection with GOAWAY, and then lets its calls
    #: finish (upstream's GRPC_MAX_CONNECTION_AGE and _GRACE); None: never.
    grpc_max_connection_age: float | None = None
    grpc_max_connection_age_grace: float | None = None
    #: A logging level name (None: warnings, and the service's reloads), text or json.
    log_level: str | None = None
    log_format: str = "text"


def _reuse_port_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # uvicorn writes a response's head and body apart: without TCP_NODELAY (which accepted
    # sockets inherit) the body waits for the client's delayed ACK, about 40 ms a response on
    # a kept-alive connection.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Service:
    """One worker: the limiter, the decider, the gRPC server, the HTTP server, the watcher.

    ``await service.start()`` binds and serves (``grpc_port`` and ``http_port`` are then the
    bound ports, useful with port 0), ``await service.stop()`` drains and closes.
    """

    def __init__(
        self,
        options: ServeOptions,
        *,
        reuse_port: bool | None = None,
        metrics_dir: str | None = None,
    ) -> None:
        self.options = options
        self.reuse_port = options.workers > 1 if reuse_port is None else reuse_port
        # metrics_dir: the workers' shared metrics (serve --workers N), one view in a scrape
        self.metrics = ServiceMetrics(
            multiprocess_dir=metrics_dir, near_limit_ratio=options.near_limit_ratio
        )
        self.limiter: AsyncLimiter | None = None
        self.decider: Decider | None = None
        self.watcher = ConfigWatcher(
            options.config,
            self._apply,
            interval=options.reload_interval,
            portable=options.portable,
            merge_domains=options.merge_domain_config,
            on_result=self.metrics.reloaded,
        )
        self.grpc_port = options.grpc_port
        self.http_port = options.http_port
        self._tasks: list[asyncio.Task[Any]] = []
        self._grpc: Any = None
        self._health: Any = None
        #: What the health checks answer: failing until the store answers, and once stopping.
        self.health = Health(None, HEALTH_NAMES)
        self._http: Any = None
        self._app: ServiceApp | None = None
        self._config: ServiceConfig | None = None

    def _apply(self, config: ServiceConfig) -> None:
        self._config = config
        if self.decider is not None:
            self.decider.config = config

    async def _rpc(self, body: bytes, context: Any) -> RateLimitResponse:
        assert self.decider is not None
        started = time.perf_counter()
        try:
            # parsed here, not by gRPC: bytes that are not a request get INVALID_ARGUMENT
            # with a plain message, not gRPC's "Unexpected error"
            request = _parse_request(body)
            response = await self.decider.should_rate_limit(request)
        except BadRequest as exc:
            import grpc  # here, not per call: an import statement costs even when loaded

            self.metrics.answered("ShouldRateLimit", started, exc)
            await context.abort(getattr(grpc.StatusCode, exc.grpc_code), str(exc))
        except StorageError as exc:
            import grpc

            self.metrics.answered("ShouldRateLimit", started, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the store failed: {exc}")
        else:
            self.metrics.answered("ShouldRateLimit", started)
            return response
        raise AssertionError("unreachable: context.abort raises")

    async def start(self) -> None:
        import grpc
        import uvicorn
        from grpc_health.v1 import health, health_pb2_grpc

        options = self.options
        config = self.watcher.load_now()
        self.limiter = AsyncLimiter.from_url(
            options.storage,
            key_prefix=options.key_prefix,
            failure_mode=options.failure_mode,
            # "local" in a fleet of workers and pods: each grants its share of the limit,
            # counted through the store while it answers (see the library's AutoShare)
            local_share="auto" if options.failure_mode == "local" else 1.0,
            metrics=self.metrics.limiter_metrics,
            timeout=options.timeout,
            connect_timeout=options.timeout,
        )
        key = options.reservation_key or secrets.token_urlsafe(32)
        self.decider = Decider(
            self.limiter,
            config,
            metrics=self.metrics,
            response_headers=options.response_headers,
            tokens=Tokens(key.encode(), options.reservation_ttl),
            exact_durations=options.exact_durations,
            shadow_mode=options.shadow_mode,
            dynamic_metadata=options.response_dynamic_metadata,
            charge_over_limit=options.charge_over_limit,
            quota_mode=options.quota_mode,
            limit_headers=options.limit_header_names if options.limit_response_headers else None,
        )
        self._health = health.aio.HealthServicer()
        self.health = Health(self._health, HEALTH_NAMES)
        await self.health.publish()  # NOT_SERVING until the store answers
        self._app = ServiceApp(self.decider, self.metrics, self.health)

        grpc_options: list[tuple[str, int]] = [
            ("grpc.so_reuseport", 1 if self.reuse_port else 0),
            ("grpc.max_concurrent_streams", 1024),
        ]
        for name, seconds in (
            ("grpc.max_connection_age_ms", options.grpc_max_connection_age),
            ("grpc.max_connection_age_grace_ms", options.grpc_max_connection_age_grace),
        ):
            if seconds is not None:
                grpc_options.append((name, max(1, round(seconds * 1000))))
        tls = options.grpc_tls
        server = grpc.aio.server(
            options=grpc_options,
            interceptors=(
                [client_san_interceptor(tls.client_san)] if tls and tls.client_san else None
            ),
        )
        handler = grpc.unary_unary_rpc_method_handler(
            self._rpc, response_serializer=RateLimitResponse.SerializeToString
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(RLS_SERVICE, {"ShouldRateLimit": handler}),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        target = self.grpc_address
        try:
            if tls is not None:
                bound = server.add_secure_port(target, tls.credentials())
            else:
                bound = server.add_insecure_port(target)
        except RuntimeError:  # grpcio raises when it cannot bind; older ones return 0
            bound = 0
        if bound == 0:
            raise ConfigError(
                f"cannot serve gRPC on {target}: the address is in use or not available"
            )
        if not options.grpc_uds:
            self.grpc_port = bound
        try:
            sock = _reuse_port_socket(options.host, options.http_port, self.reuse_port)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve HTTP on {_address(options.host, options.http_port)}: {exc}"
            ) from None
        self.http_port = sock.getsockname()[1]
        await server.start()
        self._grpc = server

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:  # the worker handles signals
                yield

        uconfig = uvicorn.Config(
            self._app, log_level="warning", access_log=False, lifespan="off", workers=1
        )
        self._http = _Server(uconfig)
        self._tasks.append(asyncio.create_task(self._http.serve(sockets=[sock])))
        self._tasks.append(asyncio.create_task(self.watcher.run()))
        while not self._http.started:
            if self._tasks[0].done():
                self._tasks[0].result()  # uvicorn failed to start: raise its error
            await asyncio.sleep(0.005)
        if not await self.health.probe(self.limiter):  # a store that answers: healthy at once
            self._tasks.append(asyncio.create_task(self.health.wait_for_store(self.limiter)))

    @property
    def grpc_address(self) -> str:
        """Where gRPC listens: ``host:port`` (the bound port once started) or ``unix:PATH``."""
        options = self.options
        return grpc_target(options.grpc_host or options.host, self.grpc_port, options.grpc_uds)

    async def reload(self) -> bool:
        """Reload the configuration now (SIGHUP)."""
        return await self.watcher.reload("SIGHUP")

    async def stop(self) -> None:
        """Fail health checks, finish the RPCs in flight (up to ``grace`` seconds), close."""
        await self.health.fail(STOPPING)
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._grpc is not None:
            await self._grpc.stop(self.options.grace)
        if self._http is not None:
            self._http.should_exit = True
        for task in self._tasks[1:]:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.limiter is not None:
            await self.limiter.close()


async def run_worker(
    options: ServeOptions, ready: Callable[[Service], None], metrics_dir: str | None = None
) -> None:
    """Serve until SIGTERM or SIGINT; SIGHUP reloads the configuration. ``metrics_dir``: the
    workers' shared metrics directory (``serve`` with several workers)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    service = Service(options, metrics_dir=metrics_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[bool]] = set()

    def on_hup() -> None:
        task = loop.create_task(service.reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    try:
        await service.start()
        ready(service)
        await stop.wait()
    finally:
        await service.stop()


def _parse_request(body: bytes) -> RateLimitRequest:
    try:
        return RateLimitRequest.FromString(body)
    except DecodeError as exc:
        # e.g. a string that is not UTF-8 (proto3 strings must be)
        raise BadRequest(f"the request is not a RateLimitRequest: {exc}") from None


def _ready_line(service: Service) -> None:
    options = service.options
    tls = " (TLS)" if options.grpc_tls else ""
    status_line(
        f"ratekeeper serve: worker {os.getpid()} ready: gRPC on {service.grpc_address}{tls}, "
        f"HTTP on {_address(options.host, service.http_port)}, configuration from "
        f"{options.config}"
    )


def _worker_main(options: ServeOptions, metrics_dir: str | None = None) -> None:
    configure_logging(options.log_level, options.log_format)
    try:
        asyncio.run(run_worker(options, _ready_line, metrics_dir))
    except ConfigError as exc:
        print(f"ratekeeper serve: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def serve(options: ServeOptions) -> int:
    """Run the server in this process (one worker) or in ``workers`` child processes; the
    exit status. The configuration is loaded once here first, so a bad file stops it before
    any port is bound. Without a ``reservation_key``, one is drawn here, for every worker, and
    a warning says so: another replica would refuse this one's tokens."""
    if options.reservation_key is None:
        options = replace(options, reservation_key=secrets.token_urlsafe(32))
        configure_logging(options.log_level, options.log_format)
        log.warning(
            "no reservation key given (--reservation-key or RATEKEEPER_SERVE_RESERVATION_KEY): "
            "this run drew its own, so the tokens /reserve answers settle only on its workers; "
            "give every replica the same key"
        )
    if options.workers == 1:
        single_process_metrics()  # a user's PROMETHEUS_MULTIPROC_DIR is not ours to write
        _worker_main(options)
        return 0
    if (options.grpc_port == 0 and not options.grpc_uds) or options.http_port == 0:
        raise ConfigError("--workers above 1 needs fixed ports: port 0 gives each its own")
    if options.grpc_uds:
        raise ConfigError("a unix socket (--grpc-uds) serves one worker: --workers 1")
    # a bad file stops here, once
    load_config(
        options.config, portable=options.portable, merge_domains=options.merge_domain_config
    )
    # The workers' metrics meet in a private directory, so a scrape sums them all.
    with WorkerMetricsDir() as metrics:
        return _run_workers(options, metrics)


def _run_workers(options: ServeOptions, metrics: WorkerMetricsDir) -> int:
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(
            target=_worker_main, args=(options, metrics.path), name=f"ratekeeper-worker-{i}"
        )
        for i in range(options.workers)
    ]
    with metrics.starting():  # the workers' environment names it before they import anything
        for child in children:
            child.start()

    def forward(signum: int, frame: Any) -> None:
        for child in children:
            if child.pid is not None and child.is_alive():
                os.kill(child.pid, signum)

    signal.signal(signal.SIGHUP, forward)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    # A worker that exits ends the server: the others are stopped too.
    sentinels = {child.sentinel: child for child in children}
    from multiprocessing.connection import wait

    while sentinels:
        for ready in wait(list(sentinels)):
            child = sentinels.pop(ready)  # type: ignore[arg-type]
            child.join()
            metrics.exited(child.pid)
            code = child.exitcode or 0
            if code not in (0, -signal.SIGTERM, -signal.SIGINT):
                status = status or (code if code > 0 else 1)
            for other in sentinels.values():
                if other.pid is not None and other.is_alive():
                    os.kill(other.pid, signal.SIGTERM)
    return status
