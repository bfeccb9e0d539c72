"""The algorithms: each as a Lua script (``lua/<name>.lua``) and its Python reference, and the
registry of them.

Its modules: ``_base`` (the shared call format, documented there), one module per algorithm
(``sliding_log``, ``sliding_window``, ``fixed_window``, ``gcra``, ``concurrency``) and per other
script (``fleet``, ``top``), ``policy`` (``Policy``: rates enforced with one algorithm, checked
against it), ``keyspace`` (the keys a Python reference reads and writes) and ``scripts`` (the
Lua sources, loaded once with their SHA1).
"""

from __future__ import annotations

from dataclasses import replace

from .._model.errors import ConfigError
from . import concurrency, fixed_window, gcra, sliding_log, sliding_window
from ._base import (
    CHARGE,
    CONSUMES,
    HIT,
    PEEK,
    REFUND,
    RELEASE,
    RESERVE,
    RETRY_NEVER,
    RETRY_NONE,
    SETTLES,
    Algorithm,
    Args,
    Reply,
    decode_args,
    encode_args,
)

__all__ = [
    "ALGORITHMS",
    "CHARGE",
    "CONSUMES",
    "HIT",
    "PEEK",
    "REFUND",
    "RELEASE",
    "RESERVE",
    "RETRY_NEVER",
    "RETRY_NONE",
    "SETTLES",
    "Algorithm",
    "Args",
    "Reply",
    "decode_args",
    "encode_args",
    "get_algorithm",
]

ALGORITHMS: dict[str, Algorithm] = {
    algorithm.name: algorithm
    for algorithm in (
        sliding_log.ALGORITHM,
        sliding_window.ALGORITHM,
        fixed_window.ALGORITHM,
        gcra.ALGORITHM,
        # A token bucket refilled continuously is GCRA; the alias shares its script and keys.
        replace(gcra.ALGORITHM, name="token_bucket"),
        concurrency.ALGORITHM,
    )
}


def get_algorithm(name: str) -> Algorithm:
    """The algorithm called ``name``; a ConfigError naming the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(ALGORITHMS))
        raise ConfigError(f"unknown algorithm {name!r}: choose one of {known}") from None
