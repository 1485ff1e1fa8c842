"""Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``) whose parameters are not made yet.

A lazy module makes its parameters from the first input it sees. ``transform`` captures and
shards the parameters the model holds, and an uninitialised one holds none yet: its
``UninitializedParameter`` cannot be moved, split or copied (``Cannot copy out of meta tensor``
at the first call, a gather of no data under ``data_parallel="fsdp"``). It is refused by name
before anything is changed; one call of the model on an example makes the parameters.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

from dpcompile.errors import ArgumentError


def refuse_uninitialised(model: nn.Module) -> None:
    """Raise :class:`ArgumentError` naming the lazy modules of ``model`` not initialised yet."""
    lazy = [
        f"'{path or type(model).__name__}' ({type(module).__name__})"
        for path, module in model.named_modules()
        if any(isinstance(t, UninitializedTensorMixin) for t in (*module._parameters.values(), *module._buffers.values()))
    ]
    if lazy:
        raise ArgumentError(
            f"model has lazy modules whose parameters are not made yet: {', '.join(lazy[:4])}"
            f"{' and more' if len(lazy) > 4 else ''}; call the model once on an example input (model(x)) "
            "to initialise them, then transform it"
        )
