"""The names ratekeeper's options accept, as types a type checker holds a call to.

>>> from ratekeeper.typing import FailureMode
>>> mode: FailureMode = "closed"

``Limiter.from_url(..., failure_mode=...)`` and ``Policy(..., algorithm=...)`` take these, so
``mypy`` or an IDE flags ``failure_mode="opne"`` where it is written; the same values are still
checked when the call runs (a ConfigError naming the bad one).
"""

from ._limiters.options import LimiterOptions, UrlOptions
from ._model.options import Algorithm, FailureMode, LocalShare

__all__ = ["Algorithm", "FailureMode", "LimiterOptions", "LocalShare", "UrlOptions"]
