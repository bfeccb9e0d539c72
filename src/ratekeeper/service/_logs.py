"""The worker's logs on stderr: a level (``--log-level``, upstream's ``LOG_LEVEL``) and a format,
text or JSON (``--log-format``, upstream's ``LOG_FORMAT``). JSON lines carry upstream's field
names (``@timestamp``, ``@message``, ``level``), so a collector set up for it reads them.

Without a level, the root logger shows warnings and ``ratekeeper.service`` its reloads (info).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["JsonFormatter", "configure_logging", "status_line"]

_TEXT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
_format = ["text"]


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``@timestamp`` (RFC 3339, UTC), ``level``, ``@message``,
    ``logger``, ``pid`` and, with an exception, ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "@timestamp": _timestamp(record.created),
            "level": record.levelname.lower(),
            "@message": record.getMessage(),
            "logger": record.name,
            "pid": record.process,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def _timestamp(created: float) -> str:
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{whole}.{int(created % 1 * 1_000_000):06d}Z"


def configure_logging(level: str | None = None, fmt: str = "text") -> None:
    """Log to stderr at ``level`` (a logging level name; None: warnings, and the service's
    reloads) in ``fmt`` (``text`` or ``json``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
    logging.basicConfig(
        level=level.upper() if level else logging.WARNING, handlers=[handler], force=True
    )
    service = logging.getLogger("ratekeeper.service")
    service.setLevel(level.upper() if level else logging.INFO)  # reloads are worth a line
    _format[0] = fmt


def status_line(message: str) -> None:
    """A line every run prints whatever the level (the ready line), in the logs' format."""
    if _format[0] == "json":
        message = json.dumps(
            {"@timestamp": _timestamp(time.time()), "level": "info", "@message": message},
            ensure_ascii=False,
        )
    print(message, file=sys.stderr, flush=True)
