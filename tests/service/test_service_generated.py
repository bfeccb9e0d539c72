"""The committed ``rls_pb2.py`` / ``rls_pb2.pyi`` are what grpcio-tools (a test dependency,
never a runtime one) generates from ``rls.proto``: regenerate and compare, so an edited proto
with stale generated code fails here. Regenerate with the command in rls.proto's header."""

from __future__ import annotations

import re
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
    assert _without_version((PACKAGE / f"rls_pb2.{suffix}").read_text()) == _without_version(fresh)


def _without_version(code: str) -> str:
    """The generated code without the protobuf version that generated it (a newer
    grpcio-tools stamps its own; the descriptor and the code must still be the same)."""
    code = re.sub(r"# Protobuf Python Version: .*\n", "", code)
    return re.sub(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)\n", "", code)
