"""The drivers: ``Limiter`` and ``AsyncLimiter``, which run the engine's decision path on a
storage, and what they hand out.

Its modules: ``limiter`` (both limiters and what they share), ``options`` (what
``from_url`` settles before a limiter exists), ``reservation``, ``lease`` (concurrency leases)
and ``wait`` (waiting until allowed).
"""
