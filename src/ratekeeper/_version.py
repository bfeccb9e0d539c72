"""The package's version, in a module of its own so that any module can read it without
importing the package (``from . import __version__`` inside the package is an import cycle)."""

__version__ = "0.1.0"
