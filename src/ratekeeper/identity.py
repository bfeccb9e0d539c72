"""Who is asking: key functions that turn a request into an identity.

A key function takes a :class:`ratekeeper.identity.Request` (the same under ASGI and WSGI) and
returns an identity string, or None when it has none (then the next one in :func:`first` is
tried). When the middleware's key function returns None, its ``missing_identity`` option
decides: by default the request is limited by its socket peer's address, under an
``anonymous:`` identity that no key function here returns. Identities are hashed into keys by
the limiter; the ones here never carry raw secrets.

``client_ip`` trusts forwarding headers only as far as they were written by proxies you trust:
behind no trusted proxy it is the socket's peer; behind trusted proxies it walks
``X-Forwarded-For`` (or RFC 7239 ``Forwarded``) from the right, skipping trusted proxies, and
takes the first address that is not one. A client can prepend anything it likes to those
headers, but it cannot get past the proxy that appended its real address.
"""

from ._http._identity import KeyFunc, Request, client_ip, first, header

__all__ = ["KeyFunc", "Request", "client_ip", "first", "header"]
