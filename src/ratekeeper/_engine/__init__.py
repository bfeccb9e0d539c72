"""The sans-I/O decision engine both limiters drive: from a policy and an identity to a store
call, and from its reply (or its failure) to a decision.

Its modules: ``keys`` (key building), ``core`` (store calls and their replies), ``path`` (the one
decision path, a generator of steps), ``guard`` (breakers per node and the failure-mode choice),
``fallback`` (the ``local`` failure mode), ``breaker``, ``denycache``, ``fleet`` (the live
instance count behind ``local_share="auto"``), ``top`` (top offenders) and ``metrics`` (the
hooks; the public face is ``ratekeeper.metrics``).
"""
