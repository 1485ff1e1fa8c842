"""fx frontend: the mode of a module the program calls, read by another module's code.

Tracing runs ``0.3 if self.emb.training else 0.0`` in the parent's forward once: the program keeps the
value, and the guards keyed programs by the modes of the modules forward enters, not of those it calls
(an ``nn.Embedding``, an RNN: their own reads of their mode run at each call). A call with ``emb``
alone switched ran the traced value, silently. Such a read is remembered for the model
(:func:`called_modes_read`), and the guards key programs by that module's mode too: a call with it
switched runs a program traced for it.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch.fx as fx
from torch import nn


@contextlib.contextmanager
def called_mode_reads(root: Any, tracer: fx.Tracer) -> Iterator[list[str]]:
    """While ``tracer`` traces ``root``: the path of each called (leaf) module whose ``training`` code outside
    that module's own methods reads."""
    from dpcompile.capture.errors import is_library_file

    reads: list[str] = []
    paths = {id(m): p for p, m in root.named_modules()} if isinstance(root, nn.Module) else {}
    previous = nn.Module.__dict__.get("training")

    def read(module: nn.Module) -> bool:
        value = previous.__get__(module) if previous is not None else module.__dict__["training"]
        frame = sys._getframe(1)
        path = paths.get(id(module))
        if path and frame.f_locals.get("self") is not module and not is_library_file(frame.f_code.co_filename):
            if tracer.is_leaf_module(module, path):
                reads.append(path)
        return value

    def write(module: nn.Module, value: bool) -> None:
        if previous is not None:
            previous.__set__(module, value)
        else:
            module.__dict__["training"] = value

    nn.Module.training = property(read, write)  # type: ignore[assignment]
    try:
        yield reads
    finally:
        if previous is None:
            if "training" in nn.Module.__dict__:  # an inner patch's cleanup may have taken it already
                del nn.Module.training
        else:
            nn.Module.training = previous  # type: ignore[assignment]


_READ: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def remember_called_modes(root: Any, reads: list[str]) -> None:
    """Remember the paths of the called modules whose mode ``root``'s forward read (:func:`called_mode_reads`)."""
    if reads and isinstance(root, nn.Module):
        _READ.setdefault(root, set()).update(reads)


def called_modes_read(model: nn.Module) -> list[str]:
    """The paths of the modules the program calls whose mode forward read while traced: the guards key by them."""
    return sorted(_READ.get(model, ()))
