"""gRPC over TLS (and mTLS) and over a unix socket: the same requests get the same answers as
over plain TCP; client certificates are required when a client CA is given, and a required name
is checked; a rotated certificate serves the next connection; bad TLS options stop ``serve``
before it starts, naming what is wrong. Certificates are made by the ``openssl`` command."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner

from ratekeeper.cli._main import main
from ratekeeper.service._listen import GrpcTls, _matches
from ratekeeper.service._server import Service

from ..support.servers import RedisServer
from ..support.service_support import OURS, running, write

CONFIG = """\
domain: tls
descriptors:
  - key: user
    rate_limit: {unit: day, requests_per_unit: 3}
"""


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Pki:
    directory: Path

    def path(self, name: str) -> str:
        return str(self.directory / name)

    def read(self, name: str) -> bytes:
        return (self.directory / name).read_bytes()

    def ca(self, name: str) -> None:
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                 "-nodes", "-days", "1", "-subj", f"/CN={name}",
                 "-keyout", self.path(f"{name}.key"), "-out", self.path(f"{name}.pem"))  # fmt: skip

    def issue(self, ca: str, name: str, extensions: str) -> None:
        """``name``.pem and ``name``.key, signed by ``ca``, with ``extensions`` (x509v3)."""
        (self.directory / f"{name}.ext").write_text(extensions + "\n")
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-subj", f"/CN={name}", "-keyout", self.path(f"{name}.key"),
                 "-out", self.path(f"{name}.csr"))  # fmt: skip
        _openssl("x509", "-req", "-in", self.path(f"{name}.csr"),
                 "-CA", self.path(f"{ca}.pem"), "-CAkey", self.path(f"{ca}.key"),
                 "-CAcreateserial", "-days", "1", "-out", self.path(f"{name}.pem"),
                 "-extfile", self.path(f"{name}.ext"))  # fmt: skip

    def client(self, ca: str, name: str) -> grpc.ChannelCredentials:
        """Credentials trusting ``ca`` and presenting the ``name`` certificate (None: none)."""
        chain = (self.read(f"{name}.key"), self.read(f"{name}.pem")) if name else (None, None)
        return grpc.ssl_channel_credentials(self.read(f"{ca}.pem"), *chain)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    if shutil.which("openssl") is None:
        pytest.fail("the TLS tests need the openssl command to make their certificates")
    pki = Pki(tmp_path)
    server = "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"
    pki.ca("ca")
    pki.issue("ca", "server", server)
    pki.issue("ca", "envoy", "subjectAltName=DNS:envoy.internal\nextendedKeyUsage=clientAuth")
    pki.issue("ca", "other", "subjectAltName=DNS:other.internal\nextendedKeyUsage=clientAuth")
    pki.ca("rogue")
    pki.issue("rogue", "intruder", "subjectAltName=DNS:envoy.internal")
    pki.ca("ca2")
    pki.issue("ca2", "server2", server)
    return pki


def _tls(pki: Pki, san: str | None = None) -> GrpcTls:
    return GrpcTls(pki.path("server.pem"), pki.path("server.key"), pki.path("ca.pem"), san)


def _channel(service: Service, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    target = service.grpc_address
    if credentials is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(
        target, credentials, options=[("grpc.ssl_target_name_override", "localhost")]
    )


async def _answers(channel: grpc.aio.Channel, user: str, n: int) -> list[Any]:
    call = OURS.caller(channel)
    answers = []
    for _ in range(n):
        response = await call(OURS.request("tls", [("user", user)]), timeout=10)
        for status in response.statuses:  # the one field that moves with the clock
            status.ClearField("duration_until_reset")
        answers.append(response)
    return answers


def test_tls_and_unix_answer_as_tcp(
    tmp_path: Path, pki: Pki, servers: dict[str, RedisServer]
) -> None:
    """The same five requests over plain TCP, mTLS TCP, a unix socket and mTLS on a unix
    socket (four services on one store, each with its own key prefix): the same answers."""
    config = write(tmp_path / "tls.yaml", CONFIG)
    url = next(iter(servers.values())).url
    envoy = pki.client("ca", "envoy")

    async def scenario() -> dict[str, list[Any]]:
        seen = {}
        for name, options, credentials in (
            ("tcp", {}, None),
            ("tcp+tls", {"grpc_tls": _tls(pki, "envoy.internal")}, envoy),
            ("unix", {"grpc_uds": str(tmp_path / "plain.sock")}, None),
            ("unix+tls", {"grpc_uds": str(tmp_path / "tls.sock"), "grpc_tls": _tls(pki)}, envoy),
        ):
            async with running(config, url, **options) as service:
                if "unix" in name:
                    assert service.grpc_address == f"unix:{options['grpc_uds']}"
                async with _channel(service, credentials) as channel:
                    seen[name] = await _answers(channel, "alice", 5)
        return seen

    seen = asyncio.run(scenario())
    codes = [OURS.response_type.Code.Name(r.overall_code) for r in seen["tcp"]]
    assert codes == ["OK", "OK", "OK", "OVER_LIMIT", "OVER_LIMIT"]
    assert [r.statuses[0].limit_remaining for r in seen["tcp"]] == [2, 1, 0, 0, 0]
    for name in ("tcp+tls", "unix", "unix+tls"):
        assert seen[name] == seen["tcp"], name


async def _code(service: Service, credentials: grpc.ChannelCredentials | None) -> str:
    async with _channel(service, credentials) as channel:
        try:
            response = await OURS.caller(channel)(
                OURS.request("tls", [("user", "bob")]), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)
        return str(OURS.response_type.Code.Name(response.overall_code))


def test_mtls_requires_the_clients_certificate(
    tmp_path: Path, pki: Pki, servers: dict[str, RedisServer]
) -> None:
    config = write(tmp_path / "tls.yaml", CONFIG)
    url = next(iter(servers.values())).url

    async def scenario() -> dict[str, str]:
        async with running(config, url, grpc_tls=_tls(pki, "envoy.internal")) as service:
            return {
                "no certificate": await _code(service, pki.client("ca", "")),
                "another CA's": await _code(service, pki.client("ca", "intruder")),
                "another name": await _code(service, pki.client("ca", "other")),
                "envoy's": await _code(service, pki.client("ca", "envoy")),
                "plaintext": await _code(service, None),
            }

    assert asyncio.run(scenario()) == {
        "no certificate": "UNAVAILABLE",  # the handshake fails
        "another CA's": "UNAVAILABLE",
        "another name": "UNAUTHENTICATED",  # GRPC_CLIENT_TLS_SAN
        "envoy's": "OK",
        "plaintext": "UNAVAILABLE",
    }


def test_a_rotated_certificate_serves_the_next_connection(
    tmp_path: Path, pki: Pki, servers: dict[str, RedisServer]
) -> None:
    """The files are read again when they change (cert-manager's rotation): the next
    connection gets the new certificate; files that do not load keep the one in force."""
    config = write(tmp_path / "tls.yaml", CONFIG)
    url = next(iter(servers.values())).url
    tls = GrpcTls(pki.path("server.pem"), pki.path("server.key"))  # TLS, no client CA
    trusts_old, trusts_new = pki.client("ca", ""), pki.client("ca2", "")

    async def scenario() -> list[tuple[str, str]]:
        async with running(config, url, grpc_tls=tls) as service:
            before = (await _code(service, trusts_old), await _code(service, trusts_new))
            Path(tls.key).write_bytes(b"not a key")  # half a rotation: refused, old one stays
            half = (await _code(service, trusts_old), await _code(service, trusts_new))
            Path(tls.key).write_bytes(pki.read("server2.key"))
            Path(tls.cert).write_bytes(pki.read("server2.pem"))
            after = (await _code(service, trusts_old), await _code(service, trusts_new))
            return [before, half, after]

    assert asyncio.run(scenario()) == [
        ("OK", "UNAVAILABLE"),
        ("OK", "UNAVAILABLE"),
        ("UNAVAILABLE", "OK"),
    ]


def test_client_san_patterns() -> None:
    assert _matches("envoy.internal", "ENVOY.internal.")
    assert _matches("*.internal", "envoy.internal")
    assert not _matches("*.internal", "a.envoy.internal")
    assert not _matches("*.internal", "internal")
    assert not _matches("other.internal", "envoy.internal")


def test_bad_tls_options_stop_serve(tmp_path: Path, pki: Pki) -> None:
    config = str(write(tmp_path / "tls.yaml", CONFIG))
    base = ["serve", "--config", config, "--storage", "memory://"]

    def refused(*args: str, env: dict[str, str] | None = None) -> str:
        result = CliRunner().invoke(main, [*base, *args], env=env)
        assert result.exit_code == 2, result.output
        return " ".join(result.output.split())

    assert "'--grpc-tls-key': TLS needs a certificate and its key" in refused(
        "--grpc-tls-cert", pki.path("server.pem")
    )
    assert "'--grpc-tls-client-ca': needs --grpc-tls-cert" in refused(
        "--grpc-tls-client-ca", pki.path("ca.pem")
    )
    assert "give --grpc-tls-client-ca too" in refused(
        "--grpc-tls-cert", pki.path("server.pem"), "--grpc-tls-key", pki.path("server.key"),
        "--grpc-tls-client-san", "envoy.internal",
    )  # fmt: skip
    mismatched = refused(
        "--grpc-tls-cert", pki.path("server.pem"), "--grpc-tls-key", pki.path("envoy.key")
    )
    assert f"{pki.path('server.pem')}, {pki.path('envoy.key')}: not a PEM certificate" in mismatched
    assert f"{pki.path('server.key')}: not PEM CA certificates" in refused(
        "--grpc-tls-cert", pki.path("server.pem"), "--grpc-tls-key", pki.path("server.key"),
        "--grpc-tls-client-ca", pki.path("server.key"),
    )  # fmt: skip
    assert "a unix socket serves one worker" in refused(
        "--grpc-uds", str(tmp_path / "s.sock"), "--workers", "2", "--storage", "redis://h:1"
    )
    # upstream's names: the same checks
    upstream = {"GRPC_SERVER_USE_TLS": "true", "GRPC_SERVER_TLS_CERT": pki.path("server.pem"),
                "GRPC_SERVER_TLS_KEY": pki.path("ca.key")}  # fmt: skip
    assert "not a PEM certificate chain and its private key" in refused(env=upstream)
