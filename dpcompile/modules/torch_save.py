"""``torch.save(pm, path)`` writes ``path`` whole or not at all.

A refusal of pickling (a lambda hook, weights not loaded, a parametrized model: raised in
``ParallelModule.__reduce__``) comes after torch has opened ``path``: torch would leave a partial
zip file there (about 600 bytes, no ``data.pkl``), over the previous file. Where the object saved
holds a program, the pickle is written to a temporary file beside ``path`` and renamed onto it once
complete; a failure removes the temporary file and leaves ``path`` as it was::

    torch.save(pm, "pm.pt")      # refused: DpCompileError, "pm.pt" untouched (absent, or the old file)

Any other object, and a file-like ``f``, go to torch's own ``save`` unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from typing import Any

import torch
from torch import nn

__all__ = ["install_atomic_torch_save"]


def _holds_program(obj: Any) -> bool:
    """``obj`` is a program, a module holding one, or a dict, list or tuple with one among its values."""
    from dpcompile.modules.base import ParallelModule

    def program_in(value: Any) -> bool:
        return isinstance(value, nn.Module) and any(isinstance(m, ParallelModule) for m in value.modules())

    if isinstance(obj, dict):
        return any(program_in(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(program_in(v) for v in obj)
    return program_in(obj)


def _save_through_temporary(save: Any, obj: Any, path: str, args: tuple, kwargs: dict) -> None:
    target = os.path.realpath(path)  # a symlink is written through, as torch does
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".partial", dir=os.path.dirname(target))
    os.close(fd)
    try:
        save(obj, temporary, *args, **kwargs)
        if os.path.exists(target):
            shutil.copymode(target, temporary)
        else:  # mkstemp's 0600: give the mode a plain open() would
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def install_atomic_torch_save() -> None:
    """Make ``torch.save`` write a program to a path atomically (once; idempotent)."""
    original = torch.save
    if getattr(original, "dpcompile_atomic", False):
        return

    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, (str, os.PathLike)) and _holds_program(obj):
            return _save_through_temporary(original, obj, os.fspath(f), args, kwargs)
        return original(obj, f, *args, **kwargs)

    save.dpcompile_atomic = True  # type: ignore[attr-defined]
    torch.save = save
