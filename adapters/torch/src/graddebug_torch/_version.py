"""The version of the graddebug-torch distribution: its one source, read by pyproject.toml."""

__version__ = "0.2.0"
