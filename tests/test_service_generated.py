"""The committed ``rls_pb2.py`` / ``rls_pb2.pyi`` are what grpcio-tools (a test dependency,
never a runtime one) generates from ``rls.proto``: regenerate and compare, so an edited proto
with stale generated code fails here. Regenerate with the command in rls.proto's header."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pytest
from grpc_tools import protoc

import ratekeeper.service

PACKAGE = Path(ratekeeper.service.__file__).resolve().parent
SRC = PACKAGE.parent.parent


@pytest.mark.parametrize("suffix", ["py", "pyi"])
def test_generated_code_is_fresh(tmp_path: Path, suffix: str) -> None:
    proto = PACKAGE / "rls.proto"
    args = [
        "grpc_tools.protoc",
        f"-I{SRC}",
        f"-I{files('grpc_tools') / '_proto'}",  # the well-known types, as the command has
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        str(proto.relative_to(SRC)),
    ]
    assert protoc.main(args) == 0
    fresh = (tmp_path / "ratekeeper" / "service" / f"rls_pb2.{suffix}").read_text()
    assert (PACKAGE / f"rls_pb2.{suffix}").read_text() == fresh
