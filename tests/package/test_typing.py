"""The options are typed: ``mypy --strict`` on a user's file flags a misspelt option, a wrong
failure mode or algorithm, and a store option where it does not apply, at the line it is
written; a file using every option rightly passes. The ``Literal`` types name the same values
the runtime checks accept."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

from ratekeeper import Algorithm, FailureMode
from ratekeeper._algorithms import ALGORITHMS
from ratekeeper._algorithms.policy import FAILURE_MODES

#: A user's file with one mistake a line from line 4, then one that is right.
BAD = """\
from ratekeeper import AsyncLimiter, Limiter, Policy
from ratekeeper._storage import open_sync

Limiter.from_url("memory://", failur_mode="open")
Limiter.from_url("memory://", failure_mode="opne")
Policy("p", "1/s", algorithm="slidinglog")
Policy("p", "1/s", failure_mode="closd")
AsyncLimiter.from_url(timeout="fast")
Limiter.from_url(batching=True)
Limiter(open_sync("memory://"), failure_mode="clsoed")
Limiter.from_client(object(), timeout=1.0)
"""
#: (line, code, what the message says) for each mistake in BAD, in order.
EXPECTED = [
    (4, "call-arg", 'Unexpected keyword argument "failur_mode" for "from_url" of "Limiter"'),
    (5, "arg-type", 'Argument "failure_mode" to "from_url" of "Limiter"'),
    (
        6,
        "arg-type",
        'Argument "algorithm" to "Policy" has incompatible type "Literal[\'slidinglog\']"',
    ),
    (
        7,
        "arg-type",
        'Argument "failure_mode" to "Policy" has incompatible type "Literal[\'closd\']"',
    ),
    (8, "arg-type", 'Argument "timeout" to "from_url" of "AsyncLimiter"'),
    (9, "call-arg", 'Unexpected keyword argument "batching" for "from_url" of "Limiter"'),
    (
        10,
        "arg-type",
        'Argument "failure_mode" to "Limiter" has incompatible type "Literal[\'clsoed\']"',
    ),
    (11, "call-arg", 'Unexpected keyword argument "timeout" for "from_client" of "Limiter"'),
]

GOOD = """\
import redis
import redis.asyncio

from ratekeeper import AsyncLimiter, CircuitBreaker, FailureMode, Limiter, ManualClock, Policy
from ratekeeper import AutoShare
from ratekeeper._storage import open_sync
from ratekeeper.metrics import Metrics
from ratekeeper.typing import Algorithm

mode: FailureMode = "closed"
algorithm: Algorithm = "gcra"
Limiter.from_url()
Limiter.from_url("memory://", failure_mode=mode, key_prefix="app", deny_cache=0)
Limiter.from_url(
    "redis://localhost", failure_mode="local", local_share=0.5, breaker=CircuitBreaker(),
    metrics=Metrics(), clock=ManualClock(0.0), timeout=0.1, connect_timeout=0.1,
    max_connections=8, redis_options={"ssl": False},
)
AsyncLimiter.from_url("redis://localhost", timeout=1, batching=False)
Limiter.from_client(redis.Redis(socket_timeout=0.1), failure_mode="raise")
AsyncLimiter.from_client(redis.asyncio.Redis(), batching=False, local_share="auto")
Limiter(open_sync("memory://"), failure_mode="local", local_share=AutoShare(ttl=3.0))
Policy("p", "1/s", algorithm, burst=2, failure_mode="open")
Policy("q", "1/s", "sliding_window")
"""

_REPORT = re.compile(
    r"^(?P<file>\w+\.py):(?P<line>\d+): error: (?P<message>.*)  \[(?P<code>[\w-]+)\]$"
)


def test_mypy_strict_flags_each_mistake_at_its_line_and_passes_a_right_file(
    tmp_path: Path,
) -> None:
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "good.py").write_text(GOOD)
    result = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--strict", "--no-error-summary"),
            *("--cache-dir", str(tmp_path / "cache"), "bad.py", "good.py"),
        ],
        cwd=tmp_path,  # no project configuration: a user's own file and settings
        capture_output=True,
        text=True,
        timeout=300,
        check=False,  # mypy exits 1: there are errors to read
    )
    errors = [m.groupdict() for m in map(_REPORT.match, result.stdout.splitlines()) if m]
    assert result.returncode == 1, result.stdout + result.stderr
    assert [e for e in errors if e["file"] != "bad.py"] == [], result.stdout
    assert [(int(e["line"]), e["code"]) for e in errors] == [(ln, c) for ln, c, _ in EXPECTED]
    for error, (_, _, said) in zip(errors, EXPECTED, strict=True):
        assert said in error["message"]
    assert 'did you mean "failure_mode"?' in errors[0]["message"]


def test_the_literal_types_name_exactly_what_the_runtime_accepts() -> None:
    assert set(get_args(Algorithm)) == set(ALGORITHMS)
    assert FAILURE_MODES == get_args(FailureMode) == ("open", "closed", "local", "raise")
