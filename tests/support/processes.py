"""Processes the tests start (Redis servers, sentinels, web servers, ``ratekeeper serve``):
stopping them, reading their log and waiting for them to come up.

Only the standard library: the benchmarks reach this module through ``servers.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import IO, Any

#: Seconds a server may take to come up on a loaded machine.
STARTUP = 60.0


def stop_process(proc: subprocess.Popen[Any], grace: float = 10.0) -> int:
    """SIGTERM, and SIGKILL if it has not exited within ``grace`` seconds (its whole process
    group when it leads one, as a server started with ``start_new_session`` does, so no worker
    it forked is left behind); reaped. Returns its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
    return proc.wait(10)


def log_text(log: IO[bytes]) -> str:
    """What the process wrote so far. ``pread``: the process shares the file offset, which a
    seek and read here would move under its writes."""
    fd = log.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def wait_until(ready: Any, proc: subprocess.Popen[bytes], log: IO[bytes], what: str) -> Any:
    """Poll ``ready()`` until it returns something true (returned), the process dies, or
    ``STARTUP`` seconds pass (a server coming up in another process: there is no event to wait
    on); then fail with the end of its log."""
    deadline = time.monotonic() + STARTUP
    while True:
        result = ready()
        if result:
            return result
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(
                f"{what} did not come up (exit {proc.poll()}):\n{log_text(log)[-3000:]}"
            )
        time.sleep(0.05)
