"""The ``ratekeeper`` command group; each command registers on it from a module of its own."""

from __future__ import annotations

import click

from .._version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ratekeeper")
def main() -> None:
    """ratekeeper: exact, atomic, distributed rate limiting on Redis, Valkey or in memory.

    Every option can also be set in the environment: the ones several commands share as
    RATEKEEPER_<OPTION> (RATEKEEPER_STORAGE, or RATEKEEPER_STORAGE_URL as the library reads it;
    RATEKEEPER_POLICY, RATEKEEPER_RATES, RATEKEEPER_ALGORITHM, ...), the others as
    RATEKEEPER_<COMMAND>_<OPTION> (RATEKEEPER_BENCH_MODE). Each command's --help names them. A
    flag beats the variable.
    """
