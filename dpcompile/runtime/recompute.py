"""Activation checkpointing in generated code: a region run so that backward recomputes it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dpcompile.errors import DpCompileError
from dpcompile.runtime.random import RandomDraws

_KEEPING = [False]  # between keep_outputs(True) and keep_outputs(False): the region's ops are saved, not recomputed


def checkpoint(region: Callable[..., Any], *args: Any, saving: bool = False, undo_writes: bool = True) -> Any:
    """``region(*args)``, saving only ``args`` for backward, which runs ``region`` again to get its
    activations; the RNG state is restored first, so dropout draws the same values, and whatever
    the recompute writes outside the region (BatchNorm's running statistics, a step counter) is put
    back, so each call updates the model's state once, as eager does.

    >>> import torch
    >>> x = torch.ones(2, requires_grad=True)
    >>> checkpoint(torch.sin, x).sum().backward(); x.grad.shape
    torch.Size([2])

    ``saving=True``: what the region runs between ``keep_outputs(True)`` and ``keep_outputs(False)``
    is saved for backward (selective checkpointing), not run again. ``undo_writes=False`` (a region
    ``passes.checkpoint_writes`` found writes nothing outside itself): the recompute runs without the
    dispatch mode that watches for such writes.
    """
    _KEEPING[0] = False
    if not torch.is_grad_enabled():
        return region(*args)
    region, args = _state_read_as_it_is(_replaying_draws(region, args), args)
    return torch.utils.checkpoint.checkpoint(
        region, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=_contexts(saving, undo_writes),
    )


def _state_read_as_it_is(region: Callable[..., Any], args: tuple) -> tuple[Callable[..., Any], tuple]:
    """``region`` given its tensors that need no gradient (buffers) itself, not through checkpoint,
    which saves its inputs and refuses, in backward, one written since: the export frontend passes
    a norm's running statistics to the region, and ``instance_norm`` updates them with a ``copy_``
    (BatchNorm's kernel writes them unseen). One the region writes is read by the recompute as it
    is (a running statistic no training output depends on; the recompute's own write is undone);
    one something else wrote between forward and backward is refused, as checkpoint would."""
    fixed = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.requires_grad}
    if not fixed:
        return region, args
    watched: dict[int, int] | None = None  # after the first run: position -> version (those it did not write)

    def run(*inputs: Any) -> Any:
        nonlocal watched
        given = iter(inputs)
        full = [fixed[i] if i in fixed else next(given) for i in range(len(args))]
        for i, version in (watched or {}).items():  # the recompute
            if fixed[i]._version != version:
                raise DpCompileError(
                    f"activation_checkpointing: argument {i} of a checkpointed region (a {tuple(fixed[i].shape)} "
                    "tensor without gradient) was modified in place between its forward and the recompute in "
                    "backward; leave that region out of activation_checkpointing="
                )
        before = {i: t._version for i, t in fixed.items()}
        out = region(*full)
        if watched is None:
            watched = {i: t._version for i, t in fixed.items() if t._version == before[i]}
        return out

    return run, tuple(a for i, a in enumerate(args) if i not in fixed)


def _replaying_draws(region: Callable[..., Any], args: tuple) -> Callable[..., Any]:
    """``region``, whose recompute reads the call's random draws (an argument, ``RandomDraws``) as its
    first run did: a pipeline stage's record counts the times a site is reached to know the
    micro-batch (``PlannedDraws``), which a recompute must not count again."""
    records = [a for a in args if isinstance(a, RandomDraws)]
    if not records:
        return region
    first = [r.replay_state() for r in records]
    ran = [False]

    def run(*inputs: Any) -> Any:
        if not ran[0]:
            ran[0] = True
            return region(*inputs)
        with contextlib.ExitStack() as stack:
            for record, state in zip(records, first, strict=True):
                stack.enter_context(record.replaying(state))
            return region(*inputs)

    return run


def keep_outputs(on: bool) -> None:
    """In a region run by ``checkpoint(..., saving=True)``: from ``keep_outputs(True)`` to
    ``keep_outputs(False)`` the outputs of every op are saved for backward instead of recomputed."""
    _KEEPING[0] = on


def kept_now(func: Any) -> bool:
    """Inside a region run by ``checkpoint(..., saving=True)``: ``func``'s outputs are saved for
    backward now, not recomputed (``explain`` counts them)."""
    # a view is free to recompute, and saving one would keep its base (a Linear's input) alive
    return _KEEPING[0] and not any(r.alias_info is not None for r in func._schema.returns)


def _keep_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if kept_now(func) else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(saving: bool, undo_writes: bool) -> Callable[[], tuple[Any, Any]]:
    """checkpoint's ``context_fn``: the forward's and the recompute's contexts (the recompute's entered afresh
    each time checkpoint enters it)."""

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        if not saving:
            recompute = _EachEntryAfresh(_outside_writes_undone) if undo_writes else contextlib.nullcontext()
            return contextlib.nullcontext(), recompute
        forward, recompute = create_selective_checkpoint_contexts(_keep_policy)
        return forward, _EachEntryAfresh(lambda: _recompute_then(recompute, undo_writes))

    return contexts


class _EachEntryAfresh(contextlib.AbstractContextManager):
    """A context checkpoint may enter more than once: a backward through the region that builds a graph
    (``torch.autograd.grad(..., create_graph=True)`` inside forward: a gradient penalty) recomputes it, and
    the backward through that gradient recomputes it again. A ``@contextmanager`` context enters once (a
    bare ``AttributeError: ... has no attribute 'args'`` the second time); each entry here makes its own."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]):
        self.make = make
        self.entered: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> Any:
        context = self.make()
        self.entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.entered.pop().__exit__(*exc)


@contextlib.contextmanager
def _recompute_then(recompute: contextlib.AbstractContextManager, undo_writes: bool) -> Iterator[None]:
    try:
        with recompute, _outside_writes_undone() if undo_writes else contextlib.nullcontext():
            yield
    finally:  # an early stop leaves the region between its markers
        _KEEPING[0] = False


@contextlib.contextmanager
def _outside_writes_undone() -> Iterator[None]:
    mode = _OutsideWrites()
    try:
        with mode:
            yield  # checkpoint may stop the recompute early, by an exception, once it has what backward needs
    finally:
        with torch.no_grad():
            for tensor, before in mode.saved.values():
                # through .data: the version counter stays, so a kernel that saved the tensor for
                # backward (batch norm saves its running statistics) does not see it modified
                tensor.data.copy_(before)


# batch norm kernels whose schema does not mark the running statistics they update (arguments 3, 4)
_RUNNING_STATS = {
    op: (3, 4)
    for op in (torch.ops.aten.native_batch_norm, torch.ops.aten.cudnn_batch_norm, torch.ops.aten.miopen_batch_norm,
               torch.ops.aten._batch_norm_impl_index, torch.ops.aten.batch_norm)
}  # fmt: skip


def writes_running_statistics(op: Any) -> bool:
    """Whether ATen ``op`` (an overload or its packet) is a batch norm kernel that updates running
    statistics its schema does not mark as written."""
    return getattr(op, "overloadpacket", op) in _RUNNING_STATS


class _OutsideWrites(TorchDispatchMode):
    """Saves, before its first in-place write, each tensor a recompute writes that it did not make."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()  # storages of tensors made during the recompute
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        written = _RUNNING_STATS.get(func.overloadpacket, ())
        if schema.is_mutable or written:
            for i, argument in enumerate(schema.arguments):
                info = argument.alias_info
                if (info is not None and info.is_write) or i in written:
                    value = args[i] if i < len(args) else kwargs.get(argument.name)
                    for tensor in value if isinstance(value, (list, tuple)) else [value]:
                        if isinstance(tensor, torch.Tensor):
                            self._save(tensor)
        out = func(*args, **kwargs)
        outputs = out if isinstance(out, (list, tuple)) else [out]
        for returned, value in zip(schema.returns, outputs):
            if returned.alias_info is None and isinstance(value, torch.Tensor):  # new memory, not a view or the input
                self.made.add(value.untyped_storage().data_ptr())
        return out

    def _save(self, tensor: torch.Tensor) -> None:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer and pointer not in self.made and id(tensor) not in self.saved:
            self.saved[id(tensor)] = (tensor, tensor.detach().clone())


def _tokens_of(x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise DpCompileError(
            f"activation_checkpointing 'tiles': a tiled region reads {type(x).__name__} "
            f"{tuple(getattr(x, 'shape', ()))}, not a tensor of tokens x features; leave 'tiles' out for it"
        )
    return x.flatten(0, -2)


def token_tiles(x: torch.Tensor, tiles: int) -> tuple[torch.Tensor, ...]:
    """``x``'s tokens (every dim but the last, flattened: a view where ``x`` is contiguous) cut into
    ``tiles`` slices of rows, each contiguous (a region may ``view`` them, as GPT-2's ``Conv1D`` does).

    >>> [tuple(t.shape) for t in token_tiles(torch.ones(2, 8, 3), 4)]
    [(4, 3), (4, 3), (4, 3), (4, 3)]
    """
    return _tokens_of(x).tensor_split(tiles)


def join_tiles(parts: list[Any], like: torch.Tensor) -> Any:
    """The outputs of a region run on ``token_tiles(like, k)``, concatenated and given ``like``'s
    token dims back (a region of several outputs: each output's tiles)."""
    tokens = like.shape[:-1]
    if isinstance(parts[0], (tuple, list)):
        return tuple(torch.cat(list(column)).unflatten(0, tokens) for column in zip(*parts, strict=True))
    return torch.cat(parts).unflatten(0, tokens)


__all__ = ["checkpoint", "join_tiles", "keep_outputs", "token_tiles"]
