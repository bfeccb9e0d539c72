"""Web servers the tests start as processes (uvicorn, gunicorn): reading their log and waiting
for them to come up."""

from __future__ import annotations

import os
import subprocess
import time
from typing import IO, Any

import pytest

#: Seconds a server may take to come up on a loaded machine.
STARTUP = 60.0


def log_text(log: IO[bytes]) -> str:
    """What the server wrote so far. ``pread``: the server shares the file offset, which a
    seek and read here would move under its writes."""
    fd = log.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def wait_until(ready: Any, proc: subprocess.Popen[bytes], log: IO[bytes], what: str) -> Any:
    """Poll ``ready()`` until it returns something true, the process dies, or time is up (a
    server coming up in another process: there is no event to wait on)."""
    deadline = time.monotonic() + STARTUP
    while True:
        result = ready()
        if result:
            return result
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what} did not come up (exit {proc.poll()}):\n{log_text(log)[-3000:]}")
        time.sleep(0.05)
