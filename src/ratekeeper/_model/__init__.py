"""The values every other wing speaks in, with no behaviour beyond checking themselves: rates,
decisions, errors, the clock and the option types. Imports nothing else of the package.

Its modules: ``errors`` (the exception tree), ``rates`` (``Rate`` and the rate strings),
``decision`` (``Decision``), ``clock`` (``Clock`` and the system clock), ``options`` (the
literal option types and ``AutoShare``).
"""
