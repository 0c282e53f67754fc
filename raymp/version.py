"""The package version, in a module of its own so any module can record it without importing
the package (and through it the Trainer)."""

__version__ = "0.1.0"
