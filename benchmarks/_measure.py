"""What the benchmark scripts share: machine facts, CPU accounting and percentiles."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import redis
import redis.utils

import ratekeeper

__all__ = ["cpu_model", "machine_cpu", "machine_info", "max_load", "percentile", "server_cpu"]

#: Commands a client sends to make a decision; everything else in commandstats ran inside them.
TOP_LEVEL = frozenset({"evalsha", "evalsha_ro", "eval", "eval_ro", "fcall", "fcall_ro"})
#: Commands the harnesses (and redis-py's pipelines) send around the measured calls.
HARNESS = frozenset(
    {
        "config|resetstat",
        "info",
        "flushall",
        "ping",
        "script|load",
        "script|exists",
        "memory|usage",
        "client|setinfo",
    }
)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_REPO = Path(__file__).resolve().parent.parent


def machine_cpu() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the whole machine so far, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal guest guest_nice; guest is inside user.
    busy = sum(fields[:8]) - fields[3] - fields[4] - fields[7]
    return busy / _TICK, fields[7] / _TICK


def percentile(sorted_values: list[int], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * len(sorted_values)) - 1))
    return float(sorted_values[index])


def server_cpu(client: redis.Redis) -> float:
    """CPU seconds the server process has used (user + system, all threads)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def max_load(values: list[float | None]) -> str:
    """The largest known load figure, formatted, or '-'."""
    known = [v for v in values if v is not None]
    return f"{max(known):.2f}" if known else "-"


def cpu_model() -> str | None:
    """The processor's model name, from /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info(server: dict[str, Any] | None, *packages: str, **extra: Any) -> dict[str, Any]:
    """The machine, Python, ratekeeper (commit and a fingerprint of its source), redis-py, the
    server (if one), the versions of ``packages`` and anything in ``extra``."""
    try:
        commit: str | None = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    # The commit may not be what ran: also fingerprint the package source as it is now.
    digest = hashlib.sha256()
    package = Path(ratekeeper.__file__).parent
    for path in sorted(package.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".lua"):
            digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        **extra,
        "ratekeeper": ratekeeper.__version__,
        "ratekeeper_commit": commit,
        "ratekeeper_source_sha256": digest.hexdigest(),
        "redis_py": version("redis"),
        "hiredis": version("hiredis") if redis.utils.HIREDIS_AVAILABLE else None,
        **{name: version(name) for name in packages},
        **({"server": server} if server is not None else {}),
    }
