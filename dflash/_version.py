"""The version of this project (one place: the package, the CLI and benchmark records read it)."""

__version__ = "0.1.0"
