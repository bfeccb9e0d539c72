"""Reloading the configuration while serving: on a change under the configured path (a file
edited, added or removed; a Kubernetes ConfigMap's ``..data`` symlink swapped to a new
timestamped directory) and on demand (SIGHUP).

Changes are found by polling: every ``interval`` seconds the path is listed and every entry is
``stat``-ed through its symlinks, with the real path it resolves to. A ConfigMap update swaps
``..data`` atomically, so the files' inodes and real paths change although their names do not;
inotify on the old directory would miss it (upstream's issues #70, #132, #355 and #379).
Polling a few files costs microseconds and needs no extra dependency.

A file that fails to load keeps the configuration in force: the error (``path:line:column:``)
is logged on the ``ratekeeper.service`` logger and counted; the next change is tried again.
Loading runs in a thread, and the new configuration replaces the old one in one assignment, so
no request waits for a reload or sees half of one.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from .._model.errors import ConfigError
from ._config import ServiceConfig
from ._loader import load_config

__all__ = ["ConfigWatcher", "fingerprint"]

log = logging.getLogger("ratekeeper.service")

_Fingerprint = tuple[tuple[str, str, int, int, int, int], ...]


def _entry(path: str) -> tuple[str, str, int, int, int, int]:
    try:
        st = os.stat(path)
    except OSError as exc:  # vanished mid-swap, a dangling link: a state of its own
        return (path, f"error:{exc.errno}", 0, 0, 0, 0)
    return (path, os.path.realpath(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def fingerprint(path: str | Path) -> _Fingerprint:
    """What a change under ``path`` changes: the path itself and, for a directory, each entry
    (hidden ones too: ``..data``), through symlinks, with the real path each resolves to."""
    root = os.fspath(path)
    entries = [_entry(root)]
    try:
        names = sorted(os.listdir(root))
    except NotADirectoryError:
        names = []
    except OSError:
        names = []
    entries.extend(_entry(os.path.join(root, name)) for name in names)
    return tuple(entries)


class ConfigWatcher:
    """Keeps ``apply(config)`` fed with the configuration at ``path``.

    ``generation`` counts configurations applied (1 after the first load) and ``failures``
    the loads refused; ``changed`` is an ``asyncio.Condition`` notified after every attempt,
    for tests and tools that wait for a reload instead of sleeping.
    """

    def __init__(
        self,
        path: str | Path,
        apply: Callable[[ServiceConfig], None],
        *,
        interval: float = 0.25,
        portable: bool = False,
        merge_domains: bool = False,
        on_result: Callable[[bool], None] | None = None,
    ) -> None:
        if not interval > 0:
            raise ConfigError(f"the reload interval must be > 0 seconds, got {interval!r}")
        self.path = os.fspath(path)
        self.apply = apply
        self.interval = interval
        self.portable = portable
        self.merge_domains = merge_domains
        self.on_result = on_result
        self.generation = 0
        self.failures = 0
        self.last_error: str | None = None
        self._seen: _Fingerprint | None = None
        self._lock = asyncio.Lock()
        self.changed = asyncio.Condition()

    def load_now(self) -> ServiceConfig:
        """The first load, before serving: an error here is raised (the server does not start
        on a bad configuration)."""
        seen = fingerprint(self.path)
        config = load_config(self.path, portable=self.portable, merge_domains=self.merge_domains)
        self._seen = seen
        self.apply(config)
        self.generation = 1
        if self.on_result is not None:
            self.on_result(True)
        return config

    async def reload(self, reason: str) -> bool:
        """Load the configuration again now; True when it was applied."""
        async with self._lock:
            for _ in range(3):  # the files changed while loading: load them once more
                seen = fingerprint(self.path)
                try:
                    config = await asyncio.to_thread(
                        load_config,
                        self.path,
                        portable=self.portable,
                        merge_domains=self.merge_domains,
                    )
                except ConfigError as exc:
                    ok, self.last_error = False, str(exc)
                    self._seen = seen
                    self.failures += 1
                    log.error(
                        "ratekeeper serve: %s: the configuration was not reloaded, the one "
                        "loaded before stays in force: %s",
                        reason,
                        exc,
                    )
                    break
                if fingerprint(self.path) != seen:
                    continue
                self._seen = seen
                self.apply(config)
                self.generation += 1
                ok, self.last_error = True, None
                log.info(
                    "ratekeeper serve: %s: configuration reloaded from %s (%d file(s))",
                    reason,
                    self.path,
                    len(config.sources),
                )
                break
            else:
                ok = False
        if self.on_result is not None:
            self.on_result(ok)
        async with self.changed:
            self.changed.notify_all()
        return ok

    async def poll_once(self) -> bool | None:
        """Reload if anything under the path changed since the last load; None if nothing did."""
        if fingerprint(self.path) == self._seen:
            return None
        return await self.reload("a change in the configuration files")

    async def run(self) -> None:
        """Poll until cancelled. An unexpected error (a bug, not a bad file) is logged with its
        traceback and polling goes on: the server keeps serving the configuration in force."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll_once()
            except Exception:
                log.exception("ratekeeper serve: watching %s failed", self.path)
