"""The names ratekeeper's options accept, as types a type checker holds a call to.

>>> from ratekeeper.typing import FailureMode
>>> mode: FailureMode = "closed"

``Limiter.from_url(..., failure_mode=...)`` and ``Policy(..., algorithm=...)`` take these, so
``mypy`` or an IDE flags ``failure_mode="opne"`` where it is written; the same values are still
checked when the call runs (a ConfigError naming the bad one).
"""

from __future__ import annotations

from typing import Literal, TypeAlias

from ._fleet import AutoShare

__all__ = ["Algorithm", "FailureMode", "LocalShare"]

#: What a limiter does when the store cannot decide: allow (``open``), deny (``closed``),
#: decide with an in-process limiter at a share of each limit (``local``), or raise the
#: StorageError to the caller (``raise``).
FailureMode: TypeAlias = Literal["open", "closed", "local", "raise"]

#: The algorithms a Policy can use (``token_bucket`` is an alias of ``gcra``).
Algorithm: TypeAlias = Literal[
    "sliding_log", "sliding_window", "fixed_window", "gcra", "token_bucket", "concurrency"
]

#: The share of each limit one process may grant in the ``local`` failure mode: a number in
#: (0, 1], or ``"auto"`` (an ``AutoShare`` for its timing) for a share that follows the number
#: of live instances.
LocalShare: TypeAlias = float | Literal["auto"] | AutoShare
