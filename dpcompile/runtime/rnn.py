"""``flatten_parameters`` as generated code calls it: once per RNN per replica."""

from __future__ import annotations

import torch
from torch import nn


def cudnn_order(names: list[str]) -> list[int]:
    """The positions of an RNN's flat weights in the order cuDNN lays them into its buffer: every
    matrix (layer by layer, as listed), then every bias. Seen on CUDA 13 / cuDNN 9 for a 2-layer
    LSTM: ``weight_ih_l0, weight_hh_l0, weight_ih_l1, weight_hh_l1, bias_ih_l0, ... bias_hh_l1``."""
    matrices = [k for k, n in enumerate(names) if not n.startswith("bias")]
    return matrices + [k for k, n in enumerate(names) if n.startswith("bias")]


def weights_in_one_buffer(rnn: nn.RNNBase) -> bool:
    """True when the RNN's weights are views laid into one storage in cuDNN's order
    (:func:`cudnn_order`), without overlap.

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
    for k in cudnn_order(list(rnn._flat_weights_names)):
        w = weights[k]
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
