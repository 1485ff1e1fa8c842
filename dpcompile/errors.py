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


class ArgumentError(DpCompileError, ValueError, TypeError):
    """A bad argument of ``transform`` (or of another public function): a value of the wrong kind, an
    unknown name, a device list or layout that does not add up, or a keyword the layout would not
    read. The message names the argument and what to pass; nothing has been changed. A
    ``DpCompileError``, and a ``ValueError`` (as the API has always raised for bad arguments) and a
    ``TypeError`` (as Python says of a value of the wrong type) alike, as :class:`ExampleError`."""


class ExampleError(DpCompileError, ValueError, TypeError):
    """``example_inputs=`` / ``example_kwargs=`` that ``forward`` cannot take: a wrong count, a
    keyword it does not have, a value of the wrong type, dtype or shape. Raised by ``transform``
    before anything is traced; a ``ValueError`` (a bad argument) and a ``TypeError`` (as Python
    says of a call that does not fit the signature) alike."""


class StateDictError(DpCompileError, RuntimeError):
    """``pm.load_state_dict(sd)`` refused ``sd`` (a missing or unexpected key, a shape that does not fit, a
    value that is not a tensor); nothing was loaded. A ``RuntimeError`` too, as torch's own refusal is."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type where it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
