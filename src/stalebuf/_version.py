"""The package version (one place: the package facade and the CLI read it)."""

__version__ = "0.1.0.dev0"
