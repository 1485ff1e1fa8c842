"""The version of dpcompile (its own file, so that any layer can name it)."""

__version__ = "0.1.0"
