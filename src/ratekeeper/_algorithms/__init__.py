"""The algorithm registry. The shared call format is documented in ``_base``."""

from __future__ import annotations

from .._errors import ConfigError
from . import sliding_log
from ._base import RETRY_NEVER, RETRY_NONE, Algorithm, Args, Reply, decode_args, encode_args

__all__ = [
    "ALGORITHMS",
    "RETRY_NEVER",
    "RETRY_NONE",
    "Algorithm",
    "Args",
    "Reply",
    "decode_args",
    "encode_args",
    "get_algorithm",
]

ALGORITHMS: dict[str, Algorithm] = {
    algorithm.name: algorithm for algorithm in (sliding_log.ALGORITHM,)
}


def get_algorithm(name: str) -> Algorithm:
    """The algorithm called ``name``; a ConfigError naming the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(ALGORITHMS))
        raise ConfigError(f"unknown algorithm {name!r}: choose one of {known}") from None
