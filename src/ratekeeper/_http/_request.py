"""The request as key functions and rules see it, the same under ASGI and WSGI: the bottom of
the web layer (``identity`` builds key functions on it, ``_http`` decides with it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KeyFunc", "LazyHeaders", "Request"]


@dataclass(frozen=True, slots=True)
class Request:
    """What a key function sees of a request, the same under ASGI and WSGI.

    ``headers`` maps lower-case names to values; repeated headers are joined with ``", "`` in
    the order received, as RFC 9110 allows for list-valued fields. ``method`` is upper case,
    as frameworks route it (a ``post`` reaches the POST handler, and a POST rule). ``peer`` is
    the address of the connecting socket (the last proxy, if any), or None when the server
    does not say.
    ``raw`` is the ASGI scope, the WSGI environ or the framework's request, for key functions
    that need more.
    """

    method: str
    path: str
    headers: Mapping[str, str]
    peer: str | None
    raw: Any = field(default=None, compare=False, repr=False)


class LazyHeaders(Mapping[str, str]):
    """A request's headers, decoded by ``decode(source)`` on first use: a request whose key
    function never reads a header (``client_ip()`` with no trusted proxy) never decodes
    them."""

    __slots__ = ("_decode", "_decoded", "_source")

    def __init__(self, source: Any, decode: Callable[[Any], dict[str, str]]) -> None:
        self._source = source
        self._decode = decode
        self._decoded: dict[str, str] | None = None

    def _all(self) -> dict[str, str]:
        decoded = self._decoded
        if decoded is None:
            decoded = self._decoded = self._decode(self._source)
        return decoded

    def __getitem__(self, name: str) -> str:
        return self._all()[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self._all().get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


#: A key function returns the identity for a request, or None when it has none.
KeyFunc = Callable[[Request], "str | None"]
