"""``flatten_parameters`` as generated code calls it: once per RNN per replica."""

from __future__ import annotations

import torch
from torch import nn


def weights_in_one_buffer(rnn: nn.RNNBase) -> bool:
    """True when the RNN's weights are views laid in order into one storage, without overlap.

    That is the state ``flatten_parameters`` leaves them in, and the state replication
    creates them in, so there is nothing to copy.
    """
    weights = rnn._flat_weights
    if not weights or not all(isinstance(w, torch.Tensor) and w.is_contiguous() for w in weights):
        return False
    if any(type(w).__name__ == "FakeTensor" or w.device.type == "meta" for w in weights):
        return False
    if len({w.untyped_storage().data_ptr() for w in weights}) != 1:
        return False
    end = -1
    for w in weights:
        if w.storage_offset() < end:
            return False
        end = w.storage_offset() + w.numel()
    return True


def flatten_parameters(rnn: nn.RNNBase) -> None:
    """Make ``rnn``'s weights one contiguous chunk for cuDNN, unless they already are.

    Unlike ``nn.RNNBase.flatten_parameters`` this copies nothing when the weights already
    share one buffer in order, which replicas made by :func:`~dpcompile.runtime.replicate`
    always do. On CPU it is a no-op, as in PyTorch.
    """
    if weights_in_one_buffer(rnn):
        return
    nn.RNNBase.flatten_parameters(rnn)
