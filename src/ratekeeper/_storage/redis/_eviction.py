"""The one check a limiter makes of the server's configuration: may it evict limiter keys?

redis-py internals: none.
Tested with redis-py 5.0.1 (the floor) to 8.1.0, in CI's three environments.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["eviction_warning", "log_eviction_warning", "parse_info"]

log = logging.getLogger("ratekeeper")


def eviction_warning(info: dict[str, Any]) -> str | None:
    """A warning when the server may evict limiter keys (from ``INFO memory``), else None.

    Every limiter key has a TTL, so ``volatile-*`` policies can evict them too: an evicted key
    is a silently reset limit. Only ``noeviction`` (or no ``maxmemory``) keeps them.
    """
    maxmemory = int(info.get("maxmemory", 0) or 0)
    policy = str(info.get("maxmemory_policy", "noeviction"))
    if maxmemory > 0 and policy != "noeviction":
        return (
            f"ratekeeper: the store has maxmemory={maxmemory} with maxmemory-policy={policy}: "
            "under memory pressure it may evict limiter keys (all of them have TTLs, so "
            "volatile-* policies too), which silently resets limits. Use noeviction and let "
            "the failure mode decide when the store is full."
        )
    return None


def log_eviction_warning(info: dict[str, Any]) -> None:
    """Log ``eviction_warning(info)``, if there is one."""
    warning = eviction_warning(info)
    if warning:
        log.warning("%s", warning)


def parse_info(raw: bytes | str) -> dict[str, str]:
    """``INFO``'s ``name:value`` lines (``str`` from a client that decodes responses)."""
    fields = {}
    text = raw if isinstance(raw, str) else raw.decode(errors="replace")
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and not name.startswith("#"):
            fields[name] = value
    return fields
