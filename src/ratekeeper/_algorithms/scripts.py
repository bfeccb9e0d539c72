"""Lua scripts shipped as package data (``ratekeeper/_algorithms/lua/*.lua``), identified by SHA1.

Each script runs with ``lua/_prelude.lua`` in front of it: the parsing of the ARGV layout every
script shares and the clock (Lua scripts cannot import one another). The prelude's header says
what makes a script cheap to run; ``benchmarks/script_cost.py`` measures it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from hashlib import sha1
from importlib import resources

__all__ = ["Script", "load_script"]


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script: its name, source and the SHA1 that EVALSHA uses."""

    name: str
    source: bytes = field(repr=False)
    sha: str


@cache
def load_script(name: str) -> Script:
    """Read ``lua/<name>.lua`` from the package, with the prelude in front, once."""
    folder = resources.files("ratekeeper._algorithms").joinpath("lua")
    prelude = folder.joinpath("_prelude.lua").read_bytes()
    source = prelude + folder.joinpath(f"{name}.lua").read_bytes()
    return Script(name, source, sha1(source).hexdigest())
