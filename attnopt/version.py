"""The package version, in one place (the root package and the saved headers read it)."""

__version__ = "0.1.0"
