"""Figures the fault tests measure, written once: printed, kept in a JSON results file, and
rendered into ``docs/resilience-figures.md`` when the suite is asked to.

``record(name, **figures)`` is called by the tests that measure (``test_chaos``, the cluster and
Sentinel suites). ``RESULTS`` (under the temp directory) keeps every run's figures, newest per
name. With ``RATEKEEPER_WRITE_FIGURES=1``, the session's end rewrites the page from the figures
recorded in that session (``tests/conftest.py``), so the page a developer commits is the one a
run produced, not numbers copied by hand; many of those tests are marked ``chaos``, which the
plain ``pytest`` leaves out, so the run selects every test::

    RATEKEEPER_WRITE_FIGURES=1 pytest -m "chaos or not chaos" tests/storage/test_chaos.py \
        tests/storage/test_cluster.py tests/storage/test_sentinel.py \
        tests/engine/test_failure_modes.py tests/service/test_service_batching.py \
        tests/storage/test_batching.py
"""

from __future__ import annotations

import json
import platform
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["PAGE", "RESULTS", "record", "write_page"]

RESULTS = Path(tempfile.gettempdir()) / "ratekeeper-chaos-results.json"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "resilience-figures.md"

#: What this session measured, by name, in the order it was recorded.
_SESSION: dict[str, dict[str, Any]] = {}


def record(name: str, **figures: Any) -> None:
    """Print measured figures and add them to RESULTS (and to this session's page)."""
    print(f"\n{name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    _SESSION[name] = figures
    try:
        results = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        results = {}
    results[name] = figures
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True))


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return "; ".join(str(v) for v in value) or "-"
    return str(value).replace("|", "/")


def write_page(path: Path = PAGE) -> bool:
    """Rewrite ``path`` from this session's figures; False (nothing written) if none."""
    if not _SESSION:
        return False
    lines = [
        "# Resilience figures, as the suite last measured them",
        "",
        "Written by the test suite (`RATEKEEPER_WRITE_FIGURES=1 pytest ...`, see",
        f"`tests/support/figures.py`) on {platform.machine()}, Python {platform.python_version()}:",
        "every row is what one test passed to `record(...)`. The bound each figure is held to",
        "is asserted by the test that measured it; [resilience.md](resilience.md) explains",
        "them.",
        "",
        "| measurement | figures |",
        "|---|---|",
    ]
    for name, figures in sorted(_SESSION.items()):
        shown = "<br>".join(f"{key} = {_cell(value)}" for key, value in figures.items())
        lines.append(f"| `{name}` | {shown} |")
    path.write_text("\n".join(lines) + "\n")
    return True
