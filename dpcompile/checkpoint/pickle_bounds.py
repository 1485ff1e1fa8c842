"""Bounds on a pickle read from a file we do not trust, checked before it is unpickled.

A restricted unpickler builds only allowed classes, but a few kilobytes of pickle can still describe
a structure whose *expansion* is astronomically large: a tuple holding the same tuple twice, forty
levels deep (each level one memo ``GET``), is 2**40 elements to hash, compare or print. The
unpickler hashes a dict key as it builds it, so such a file hangs the load before any check runs.

:func:`check_expansion` walks the opcodes (``pickletools.genops``, nothing is built) and gives each
stack value the number of values it expands to (itself plus what built it, a memo ``GET`` counting
the whole value again): a pickle whose largest value expands past ``limit`` is refused. A pickle of
a tree (what ``pickle.dumps`` writes of metadata, sharing a few small ``torch.Size`` objects) expands
to about its own opcode count.

:func:`brief` is ``repr`` bounded in depth and length, for error messages about such values.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import pickletools
import reprlib
from typing import Any

_MARK = -1  # a mark on the simulated stack (values are indices into the weights)
_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
_IN_PLACE = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})  # fill the value below


def expansion_limit(size: int) -> int:
    """A generous bound on what a tree-shaped pickle of ``size`` bytes expands to."""
    return 8 * size + 4096


#: digests of the pickles (with their limits) that passed lately: a DCP load reads its ``.metadata``
#: three times (dpcompile's check of the keys, then torch's reader), each time walking every opcode
#: in Python (~4% of a rank's time in test_training_checkpoint_mesh.py); the same bytes pass the same
#: check again, so they are walked once
_PASSED: collections.OrderedDict[tuple[bytes, int], None] = collections.OrderedDict()
_PASSED_KEPT = 64


def check_expansion(raw: bytes, limit: int) -> None:
    """Raise ``ValueError`` where a value of the pickle ``raw`` expands past ``limit`` values, a
    value is filled (``APPENDS``, ``BUILD``, ...) after it was put inside another (which would let
    a structure grow after its size was counted; a pickle of a tree never does), or the opcodes do
    not make a well-formed stack program (see the module's docstring). Bytes that passed under the
    same limit lately are not walked again."""
    key = (hashlib.sha256(raw).digest(), limit)
    if key in _PASSED:
        _PASSED.move_to_end(key)
        return
    _walk(raw, limit)
    _PASSED[key] = None
    if len(_PASSED) > _PASSED_KEPT:
        _PASSED.popitem(last=False)


def _walk(raw: bytes, limit: int) -> None:
    """:func:`check_expansion`'s walk over every opcode of ``raw``."""
    weights: list[int] = []  # what each value built so far expands to
    inside: set[int] = set()  # values put inside another: never filled again
    stack: list[int] = []
    memo: dict[int, int] = {}
    try:
        for op, arg, pos in pickletools.genops(raw):
            kind, to_mark, below, pushes = _EFFECTS[op.code]
            if kind == "put":
                memo[len(memo) if arg is None else arg] = stack[-1]
            elif kind == "get":
                stack.append(memo[arg])
            elif kind == "dup":
                stack.append(stack[-1])
            else:
                taken = _pop(stack, to_mark, below)
                inside.update(taken[1:] if kind == "fill" else taken)
                weight = 1 + sum(weights[v] for v in taken)
                if weight > limit:
                    raise ValueError(f"its value at byte {pos} expands to more than {limit} values (a shared structure)")
                if kind == "fill":
                    if taken[0] in inside:
                        raise ValueError(f"it fills a value at byte {pos} after putting it inside another")
                    weights[taken[0]] = weight - 1
                    stack.append(taken[0])
                    continue
                for mark in pushes:
                    stack.append(_MARK if mark else len(weights))
                    if not mark:
                        weights.append(weight)
    except (IndexError, KeyError) as e:
        raise ValueError(f"its opcodes do not make a well-formed pickle ({type(e).__name__})") from None


def _pop(stack: list[int], to_mark: bool, below: int) -> list[int]:
    """The values an opcode consumes, deepest first: those down to the mark (and the mark), then
    ``below`` more."""
    taken: list[int] = []
    if to_mark:
        while (v := stack.pop()) != _MARK:
            taken.append(v)
    for _ in range(below):
        v = stack.pop()
        if v == _MARK:
            raise IndexError("a mark where a value was expected")
        taken.append(v)
    taken.reverse()
    return taken


def _effect(op: pickletools.OpcodeInfo) -> tuple[str, bool, int, tuple[bool, ...]]:
    """``(kind, pops down to a mark, values popped below it, pushes: a mark or not)`` of an opcode."""
    if op.name in _PUT:
        return "put", False, 0, ()
    if op.name in _GET:
        return "get", False, 0, ()
    if op.name == "DUP":
        return "dup", False, 0, ()
    before = op.stack_before
    pushes = tuple(s is pickletools.markobject for s in op.stack_after)
    to_mark = pickletools.markobject in before
    below = before.index(pickletools.markobject) if to_mark else len(before)
    return "fill" if op.name in _IN_PLACE else "new", to_mark, below, pushes


_EFFECTS = {op.code: _effect(op) for op in pickletools.opcodes}


class _Brief(reprlib.Repr):
    """``reprlib`` over every container type (subclasses, dataclasses too), never a class's own
    ``repr`` of an unbounded value."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict = 3, 6, 6, 4
        self.maxstring = self.maxother = self.maxlong = 80

    def repr1(self, x: Any, level: int) -> str:
        for kind, show in ((dict, self.repr_dict), (list, self.repr_list), (tuple, self.repr_tuple)):
            if isinstance(x, kind) and type(x) is not kind:
                shown = show(kind(x), level)
                return f"{type(x).__name__}({shown})"
        return super().repr1(x, level)

    def repr_instance(self, x: Any, level: int) -> str:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            if level <= 0:
                return f"{type(x).__name__}(...)"
            inner = ", ".join(f"{f.name}={self.repr1(getattr(x, f.name, None), level - 1)}" for f in dataclasses.fields(x))
            return f"{type(x).__name__}({inner})"
        if isinstance(x, (str, bytes, int, float, bool, type(None))) or type(x).__module__ in ("torch", "pathlib"):
            return super().repr_instance(x, level)
        return f"<{type(x).__name__}>"


_BRIEF = _Brief()


def brief(value: Any) -> str:
    """``repr(value)``, at most 3 levels deep and a few items a level (never exponential in a
    shared structure)."""
    return _BRIEF.repr(value)


__all__ = ["brief", "check_expansion", "expansion_limit"]
