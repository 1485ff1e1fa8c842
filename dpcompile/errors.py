"""The package's own exceptions."""

from __future__ import annotations


class DpCompileError(Exception):
    """Base class of every error dpcompile raises on its own account."""


class TraceError(DpCompileError):
    """The model cannot be captured as a ``torch.fx`` graph.

    The message names the user's file and line, quotes the offending source line and
    says the way out (``leaf_modules=[TheModule]``, or traceable code; ``example_inputs=`` gives
    Python flag arguments their values).
    """


class PassError(DpCompileError):
    """A graph pass failed; the message says which pass and what ran before it."""
