"""The package version, in a module of its own so that any layer can read it without
importing the package's public surface (the probe cache keys answers by it)."""

__version__ = "0.1.0"
