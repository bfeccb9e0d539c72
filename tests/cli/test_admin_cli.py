"""``ratekeeper peek | hit | reset | keys``: the installed console script on the private servers,
its JSON parsed and checked exactly, exit codes, the environment in place of flags, and bad
input or a failing store refused in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import click
import pytest
import redis
from click.testing import CliRunner

from ratekeeper import Limiter, Policy
from ratekeeper.cli import main

from ..support.servers import RedisServer

SCRIPT = shutil.which("ratekeeper", path=os.path.dirname(sys.executable))
RECORD_FIELDS = {
    "identity", "allowed", "limit", "remaining", "reset_after", "retry_after", "exceeds_limit",
    "cost", "policy", "rate", "degraded", "reason",
}  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any RATEKEEPER_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATEKEEPER_")}
    return env | extra


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed ``ratekeeper`` script, as a shell would run it."""
    assert SCRIPT is not None, "the ratekeeper console script is not installed beside python"
    return subprocess.run(
        [SCRIPT, *args],
        env=clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def target(server: RedisServer, key_prefix: str, rates: str = "3/minute") -> list[str]:
    return [
        "--storage", server.url, "--policy", "api", "--rates", rates, "--key-prefix", key_prefix,
    ]  # fmt: skip


def library_keys(
    identity: str | int, key_prefix: str = "ratekeeper", algorithm: str = "sliding_log"
) -> list[str]:
    """What the library says the keys are (Limiter.keys needs no store)."""
    with Limiter.from_url("memory://", key_prefix=key_prefix) as limiter:
        return list(limiter.keys(Policy("api", "3/minute", algorithm), identity))


def records(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert done.stderr == "", done.stderr
    assert "Infinity" not in done.stdout
    assert "NaN" not in done.stdout
    data: list[dict[str, Any]] = json.loads(done.stdout)
    assert isinstance(data, list)
    for record in data:
        assert set(record) == RECORD_FIELDS
    return data


def expect(record: dict[str, Any], identity: str, allowed: bool, remaining: int) -> None:
    assert record["identity"] == identity
    assert record["allowed"] is allowed
    assert (record["limit"], record["remaining"]) == (3, remaining)
    assert (record["policy"], record["rate"], record["cost"]) == ("api", "3/minute", 1)
    assert (record["degraded"], record["reason"], record["exceeds_limit"]) == (False, None, False)
    assert 0 <= record["reset_after"] <= 60
    if allowed:
        assert record["retry_after"] is None
    else:
        assert 0 < record["retry_after"] <= 60


# -- the console script on a real server ------------------------------------------------------


def test_hit_spends_until_denied_peek_spends_nothing_reset_frees(
    server: RedisServer, admin: redis.Redis, key_prefix: str
) -> None:
    args = target(server, key_prefix)
    peeked = run("peek", *args, "--json", "alice")
    assert peeked.returncode == 0
    [record] = records(peeked)
    expect(record, "alice", True, 3)
    assert record["reset_after"] == 0

    for remaining in (2, 1, 0):
        done = run("hit", *args, "--json", "alice")
        assert done.returncode == 0, done.stderr
        [record] = records(done)
        expect(record, "alice", True, remaining)
    denied = run("hit", *args, "--json", "alice")
    assert denied.returncode == 1
    [record] = records(denied)
    expect(record, "alice", False, 0)

    for _ in range(2):  # peek consumes nothing, and says a hit would be denied
        peeked = run("peek", *args, "--json", "alice")
        assert peeked.returncode == 1
        [record] = records(peeked)
        expect(record, "alice", False, 0)

    keys = library_keys("alice", key_prefix)
    assert admin.exists(*keys) == len(keys)
    reset = run("reset", *args, "--json", "alice")
    assert reset.returncode == 0, reset.stderr
    assert json.loads(reset.stdout) == [
        {"identity": "alice", "reset": True, "keys": keys, "existed": len(keys)}
    ]
    assert admin.exists(*keys) == 0
    again = run("hit", *args, "--json", "alice")
    assert again.returncode == 0
    expect(records(again)[0], "alice", True, 2)


def test_several_identities_in_order_and_any_denial_exits_1(
    server: RedisServer, key_prefix: str
) -> None:
    args = target(server, key_prefix)
    assert run("hit", *args, "--cost", "3", "bob").returncode == 0
    done = run("hit", *args, "--json", "carol", "bob", "42")
    assert done.returncode == 1
    carol, bob, user = records(done)
    expect(carol, "carol", True, 2)
    expect(bob, "bob", False, 0)
    expect(user, "42", True, 2)
    # The library's int 42 and the shell's "42" are one identity.
    with Limiter.from_url(server.url, key_prefix=key_prefix) as limiter:
        assert limiter.peek(Policy("api", "3/minute"), 42).remaining == 2


def test_a_cost_above_the_limit_is_valid_json(server: RedisServer, key_prefix: str) -> None:
    done = run("peek", *target(server, key_prefix), "--json", "--cost", "4", "dave")
    assert done.returncode == 1
    [record] = records(done)
    assert record["allowed"] is False
    assert (record["retry_after"], record["exceeds_limit"], record["cost"]) == (None, True, 4)


def test_table_shows_each_decision(server: RedisServer, key_prefix: str) -> None:
    args = target(server, key_prefix)
    run("hit", *args, "--cost", "3", "erin")
    done = run("hit", *args, "frank", "erin")
    assert done.returncode == 1
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert f"hit policy 'api' (3/minute, sliding_log) on {server.url}, cost 1" in " ".join(
        line.strip() for line in lines
    )
    [frank] = [line.split() for line in lines if line.strip().startswith("frank")]
    [erin] = [line.split() for line in lines if line.strip().startswith("erin")]
    assert frank == ["frank", "allowed", "3", "2", "60.000", "s", "-"]
    assert erin[:4] == ["erin", "denied", "3", "0"]
    assert 0 < float(erin[6]) <= 60
    assert erin[7] == "s"


def test_reset_and_keys_print_the_keys(server: RedisServer, key_prefix: str) -> None:
    args = target(server, key_prefix)
    expected = library_keys("gina", key_prefix)
    listed = run("keys", *args, "--json", "gina", "7")
    assert listed.returncode == 0
    assert json.loads(listed.stdout) == [
        {"identity": "gina", "keys": library_keys("gina", key_prefix)},
        {"identity": "7", "keys": library_keys(7, key_prefix)},
    ]
    shown = run("keys", *args, "gina")
    assert shown.stdout.splitlines() == ["'gina':", *(f"  {key}" for key in expected)]
    untouched = run("reset", *args, "gina")  # gina never spent anything
    assert untouched.returncode == 0
    assert f"reset 'gina': nothing was stored (no key of {', '.join(expected)})" in (
        untouched.stdout
    )
    assert run("hit", *args, "gina").returncode == 0
    reset = run("reset", *args, "gina")
    assert reset.returncode == 0
    assert f"reset 'gina': deleted {', '.join(expected)}" in reset.stdout


def test_keys_follow_the_algorithm_and_need_no_storage() -> None:
    """``keys`` sends nothing to the store, so it does not ask for one."""
    args = ["--policy", "api", "--rates", "3/minute"]
    for algorithm in ("sliding_log", "sliding_window", "gcra", "concurrency"):
        result = CliRunner(env={"RATEKEEPER_STORAGE_URL": None}).invoke(
            main, ["keys", *args, "--algorithm", algorithm, "--json", "x"]
        )
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)[0]["keys"] == library_keys("x", algorithm=algorithm)
    with_url = CliRunner().invoke(
        main, ["keys", "--storage", "redis://127.0.0.1:1", *args, "--json", "x"]
    )
    assert json.loads(with_url.stdout)[0]["keys"] == library_keys("x")  # the same keys


# -- the environment ------------------------------------------------------------------------


def test_environment_in_place_of_flags(server: RedisServer, key_prefix: str) -> None:
    env = clean_env(
        RATEKEEPER_STORAGE_URL=server.url,
        RATEKEEPER_POLICY="api",
        RATEKEEPER_RATES="3/minute",
        RATEKEEPER_ALGORITHM="gcra",
        RATEKEEPER_KEY_PREFIX=key_prefix,
        RATEKEEPER_COST="2",
        RATEKEEPER_JSON="1",
        RATEKEEPER_TIMEOUT="5",
    )
    done = run("hit", "henry", env=env)
    assert done.returncode == 0, done.stderr
    [record] = json.loads(done.stdout)
    assert (record["allowed"], record["remaining"], record["cost"]) == (True, 1, 2)
    # A flag beats its variable.
    done = run("peek", "--cost", "1", "henry", env=env)
    assert done.returncode == 0
    assert json.loads(done.stdout)[0]["remaining"] == 1
    done = run("peek", "henry", env=env)  # a cost of 2 no longer fits
    assert done.returncode == 1
    # RATEKEEPER_STORAGE comes before RATEKEEPER_STORAGE_URL; the algorithm was read (gcra keys).
    env["RATEKEEPER_STORAGE"], env["RATEKEEPER_STORAGE_URL"] = server.url, "ftp://nowhere"
    listed = run("keys", "henry", env=env)
    assert listed.returncode == 0, listed.stderr
    gcra = library_keys("henry", key_prefix, "gcra")
    assert json.loads(listed.stdout) == [{"identity": "henry", "keys": gcra}]
    env["RATEKEEPER_JSON"] = "0"
    assert run("reset", "henry", env=env).stdout.startswith("reset policy 'api'")


def test_every_option_of_every_command_has_a_variable() -> None:
    names: dict[str, set[str]] = {}
    assert isinstance(main, click.Group)
    for command in main.commands.values():
        for param in command.params:
            if not isinstance(param, click.Option) or param.name == "help":
                continue
            assert param.show_envvar, (command.name, param.name)
            envvars = [param.envvar] if isinstance(param.envvar, str) else param.envvar
            assert envvars, (command.name, param.name)
            for envvar in envvars:
                assert envvar.startswith("RATEKEEPER_")
                names.setdefault(envvar, set()).add(param.name or "")
    assert names["RATEKEEPER_STORAGE"] == names["RATEKEEPER_STORAGE_URL"] == {"storage"}
    assert all(len(params) == 1 for params in names.values()), names  # one meaning per name
    help_text = CliRunner().invoke(main, ["hit", "--help"]).output
    for envvar in ("RATEKEEPER_STORAGE_URL", "RATEKEEPER_POLICY", "RATEKEEPER_RATES"):
        assert envvar in help_text


# -- bad input and failing stores -------------------------------------------------------------


def assert_one_line_error(
    done: subprocess.CompletedProcess[str], code: int, *fragments: str
) -> str:
    assert done.returncode == code, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, done.stderr
    assert done.stderr.rstrip("\n").endswith(errors[0])  # nothing after the error line
    for fragment in fragments:
        assert fragment in errors[0]
    return errors[0]


GOOD = ["--storage", "redis://127.0.0.1:1", "--policy", "api", "--rates", "3/minute"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--storage", "ftp://example"], ["unsupported storage URL 'ftp://example'"]),
        (["--storage", "redis://:pw@127.0.0.1:notaport"], ["invalid Redis URL", ":***@"]),
        (["--storage", "memory://"], ["'--storage'", "memory:// keeps its state"]),
        (["--rates", "10/"], ["Invalid value for '--rates'", "cannot parse rate '10/'"]),
        (["--algorithm", "nope"], ["Invalid value for '--algorithm'"]),
        (["--algorithm", "concurrency"], ["Invalid value for '--algorithm'"]),
        (["--policy", "has space"], ["policy name 'has space' is invalid"]),
        (["--burst", "2"], ["burst"]),
        (["--key-prefix", "{x}"], ["key_prefix '{x}' is invalid"]),
        (["--cost", "0"], ["Invalid value for '--cost'"]),
        (["--timeout", "0"], ["Invalid value for '--timeout'"]),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], fragments: list[str]) -> None:
    line = assert_one_line_error(run("hit", *GOOD, *args, "alice"), 2, *fragments)
    assert "pw@" not in line


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([*GOOD], "Missing argument 'IDENTITY...'"),
        ([*GOOD, ""], "an identity must not be empty"),
        (["--policy", "api", "--rates", "1/s", "x"], "Missing option '--storage'"),
        (["--storage", "redis://h", "--rates", "1/s", "x"], "Missing option '--policy'"),
    ],
)
def test_missing_input_is_one_line_exit_2(args: list[str], fragment: str) -> None:
    result = CliRunner().invoke(main, ["peek", *args])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert fragment in result.stderr
    assert "Traceback" not in result.output


def test_unreachable_store_is_one_line_exit_3() -> None:
    args = ["--storage", "redis://:hunter2@127.0.0.1:1", "--policy", "api", "--rates", "1/s"]
    for command in ("peek", "hit", "reset"):
        line = assert_one_line_error(
            run(command, *args, "alice"),
            3,
            "the store at redis://:***@127.0.0.1:1 failed the call for 'alice'",
            "StorageUnavailable",
        )
        assert "hunter2" not in line
    # keys never calls the store.
    assert run("keys", *args, "alice").returncode == 0


def test_a_refused_call_names_the_identity_and_what_was_done(
    server: RedisServer, admin: redis.Redis, key_prefix: str
) -> None:
    args = target(server, key_prefix)
    [key] = library_keys("ivan", key_prefix)
    admin.set(key, "not a log")  # WRONGTYPE for the script: a refused call, not a decision
    assert_one_line_error(
        run("hit", *args, "--json", "jane", "ivan"),
        3,
        "refused the call for 'ivan'; 1 before it done",
        "RequestRejected",
    )
    assert run("peek", *args, "--json", "jane").stdout.count('"remaining": 2') == 1
