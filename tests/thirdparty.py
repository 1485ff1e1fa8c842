"""Third-party models for the tests and benchmarks: torchvision and timm, tiny configurations,
no downloaded weights.

``import_torchvision()`` must run before ``import torchvision`` / ``import timm``: the installed
torchvision is a CUDA build whose C++ ops are missing on this CPU torch; defining the two ops it
registers fake kernels for lets it import (once per process).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

_DEFINED = False


def define_torchvision_ops() -> None:
    """Define ``torchvision::nms``/``qnms`` once, before anything imports torchvision."""
    global _DEFINED
    if not _DEFINED:
        for name in ("nms", "qnms"):
            try:
                torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:  # defined already (another helper, an earlier import)
                pass
        _DEFINED = True


def import_torchvision() -> ModuleType:
    """``torchvision``, importable on this CPU build (defines its missing ops once)."""
    define_torchvision_ops()
    import torchvision

    return torchvision


def import_or_skip(name: str) -> ModuleType:
    """``pytest.importorskip`` after the torchvision ops are defined (transformers and timm import it)."""
    define_torchvision_ops()
    return pytest.importorskip(name)


def import_timm() -> ModuleType:
    import_torchvision()
    import timm

    return timm


class Seq2Seq(nn.Module):
    """An LSTM encoder-decoder, time-major (``batch_first=False``): inputs ``(T, B)`` of token ids."""

    def __init__(self, vocab: int = 50, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder = nn.LSTM(hidden, hidden)
        self.decoder = nn.LSTM(hidden, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        _, state = self.encoder(self.embed(src))
        h, _ = self.decoder(self.embed(tgt), state)
        t, b, d = h.shape
        halves = h.view(t, b, 2, d // 2).flip(2)  # a view that keeps the batch dim (1) apart
        return self.out(halves.reshape(t, b, d))


def _image(size: int = 32, batch: int = 4) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, size, size),)


def models() -> dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]]:
    """``{name: factory}``; each factory returns ``(model, example_inputs)`` (a batch of 4)."""

    def tv(name: str, size: int = 32, **kw: Any) -> Callable[[], tuple[nn.Module, tuple]]:
        def make() -> tuple[nn.Module, tuple]:
            tvm = import_torchvision().models
            return getattr(tvm, name)(weights=None, **kw), _image(size)

        return make

    def vit() -> tuple[nn.Module, tuple]:
        tvm = import_torchvision().models
        model = tvm.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)
        return model, _image(32)

    def swin() -> tuple[nn.Module, tuple]:
        tvm = import_torchvision().models
        model = tvm.SwinTransformer(
            patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4],
            stochastic_depth_prob=0.1, num_classes=10,
        )  # fmt: skip
        return model, _image(32)

    def timm_model(name: str, size: int = 32, **kw: Any) -> Callable[[], tuple[nn.Module, tuple]]:
        def make() -> tuple[nn.Module, tuple]:
            return import_timm().create_model(name, pretrained=False, **kw), _image(size)

        return make

    def timm_mixer() -> tuple[nn.Module, tuple]:
        import_timm()
        from timm.models.mlp_mixer import MlpMixer

        return MlpMixer(img_size=32, patch_size=8, num_blocks=2, embed_dim=32, num_classes=10), _image(32)

    def seq2seq() -> tuple[nn.Module, tuple]:
        return Seq2Seq(), (torch.randint(0, 50, (5, 4)), torch.randint(0, 50, (6, 4)))

    return {
        "tv_resnet18": tv("resnet18"),
        "tv_efficientnet_b0": tv("efficientnet_b0"),
        "tv_convnext_tiny": tv("convnext_tiny"),
        "tv_vit": vit,
        "tv_swin": swin,
        "timm_efficientnet_b0": timm_model("efficientnet_b0"),
        "timm_vit_tiny": timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2),
        "timm_convnext": timm_model("convnext_atto", num_classes=10),
        "timm_mixer": timm_mixer,
        "lstm_seq2seq": seq2seq,
    }
