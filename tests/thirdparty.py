"""Third-party model libraries for tests, importable on a CPU-only torch.

torchvision 0.28.0 on PyPI is a CUDA build whose C extension cannot load beside the CPU build
of torch; its Python models import once its ``nms`` ops are defined by hand (transformers and
timm import torchvision too). Models are built from tiny configs with random weights: nothing
is downloaded.
"""

from __future__ import annotations

import pytest
import torch

_DEFINED = False


def define_torchvision_ops() -> None:
    """Define ``torchvision::nms``/``qnms`` once, before anything imports torchvision."""
    global _DEFINED
    if _DEFINED:
        return
    for name in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:  # defined already (torchvision's own extension loaded)
            pass
    _DEFINED = True


def import_or_skip(name: str):
    """``pytest.importorskip`` after the torchvision ops are defined."""
    define_torchvision_ops()
    return pytest.importorskip(name)
